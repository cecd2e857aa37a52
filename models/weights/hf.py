"""Hugging Face tensor names and the readers and writers every family's loader shares: the
embedding, the final norm, the LM head, and each layer's two norms and attention (HF's
q/k/v/o_proj, optional q/k norms) <-> our parameter layout, on checkpoint.py's Checkpoint. A
family's loader (llama/hf.py, qwen3_moe/hf.py) adds its MLP's or MoE's tensors.

HF stores linear weights as [out_features, in_features] and uses the rotate_half rotary
convention, which core/attention.py follows, so no q/k permutation is needed.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import numpy as np

from .checkpoint import Checkpoint


def hf_name(name: str, i: Optional[int] = None) -> str:
    """The HF tensor name of `name` ("self_attn.q_proj", ...) in layer i, or a global one."""
    return f"model.layers.{i}.{name}.weight" if i is not None else name


def attention_builders(config, ck: Checkpoint, i: int, kv_replicas: int = 1, *,
                       qk_norm: bool = False) -> dict:
    """Layer i's attention parameters (attention.Attention) as f(lo, hi) builders: qkv over the
    layout's KV heads [lo, hi), o over query heads, and with qk_norm q_norm/k_norm (replicated,
    Qwen3). Any family whose attention is HF's q/k/v/o_proj reads it so.
    `config` is the layout's: with kv_replicas r > 1, layout KV head j is a copy of the
    checkpoint's head j // r."""
    c = config
    H, d, g = c.hidden_size, c.head_dim, c.group_size

    def t(a):  # HF [out, in] -> ours [in, out]
        return np.ascontiguousarray(a.T)

    def kv_rows(name, lo, hi):  # layout heads [lo, hi) -> [H, hi - lo, 1, d]
        heads = np.arange(lo, hi) // kv_replicas
        a = t(ck.read(name, 0, heads[0] * d, (heads[-1] + 1) * d)).reshape(H, -1, d)
        return a[:, heads - heads[0], None, :]

    def qkv(lo, hi):  # lo, hi: kv heads of the layout
        n = hi - lo
        q = t(ck.read(hf_name("self_attn.q_proj", i), 0, lo * g * d, hi * g * d)).reshape(H, n, g, d)
        k = kv_rows(hf_name("self_attn.k_proj", i), lo, hi)
        v = kv_rows(hf_name("self_attn.v_proj", i), lo, hi)
        return np.concatenate([q, k, v], axis=2)

    def o(lo, hi):  # heads
        return t(ck.read(hf_name("self_attn.o_proj", i), 1, lo * d, hi * d)).reshape(hi - lo, d, H)

    out = {"qkv": qkv, "o": o}
    if qk_norm:
        for norm in ("q_norm", "k_norm"):
            out[norm] = {"weight": functools.partial(
                lambda name, lo, hi: ck.read(name), hf_name(f"self_attn.{norm}", i))}
    return out


def host(a) -> np.ndarray:
    """A (global) parameter gathered to the host."""
    return np.asarray(jax.device_get(a))


def attention_to_hf(attn: dict, config, i: int) -> dict[str, np.ndarray]:
    """Layer i's attention parameters (global; KV heads possibly replicated, see
    attention_builders) -> HF-named numpy tensors, each KV head once."""
    c = config
    H, d = c.hidden_size, c.head_dim
    qkv = host(attn["qkv"])  # [H, kv * r, g / r + 2, d]
    r, g = qkv.shape[1] // c.num_kv_heads, qkv.shape[2] - 2
    out = {hf_name("self_attn.q_proj", i): qkv[:, :, :g].reshape(H, c.num_heads * d).T,
           hf_name("self_attn.k_proj", i): qkv[:, ::r, g].reshape(H, c.num_kv_heads * d).T,
           hf_name("self_attn.v_proj", i): qkv[:, ::r, g + 1].reshape(H, c.num_kv_heads * d).T,
           hf_name("self_attn.o_proj", i): host(attn["o"]).reshape(c.num_heads * d, H).T}
    for norm in ("q_norm", "k_norm"):
        if norm in attn:
            out[hf_name(f"self_attn.{norm}", i)] = host(attn[norm]["weight"])
    return out


def stack_builders(config, ck: Checkpoint, kv_replicas: int = 1, *, qk_norm: bool = False) -> dict:
    """The builders (see hf_builders) of what every family's stack holds: the embedding, the
    final norm, the LM head (untied), and per layer its two norms and its attention; a family
    adds its layers' MLP (or MoE) entries."""
    def full(name):
        return lambda lo, hi: ck.read(name)

    out = {"embed": full("model.embed_tokens.weight"), "norm": {"weight": full("model.norm.weight")},
           "layers": {}}
    if not config.tie_word_embeddings:
        out["lm_head"] = lambda lo, hi: np.ascontiguousarray(ck.read("lm_head.weight", 0, lo, hi).T)
    for i in range(config.num_layers):
        out["layers"][i] = {
            "input_norm": {"weight": full(hf_name("input_layernorm", i))},
            "post_norm": {"weight": full(hf_name("post_attention_layernorm", i))},
            "attn": attention_builders(config, ck, i, kv_replicas, qk_norm=qk_norm),
        }
    return out


def stack_to_hf(params: dict, config) -> dict[str, np.ndarray]:
    """The stack's HF-named tensors every family writes (the inverse of stack_builders):
    embedding, final norm, LM head, and each layer's attention and two norms. A family's writer
    adds its MLP's."""
    c = config
    out = {"model.embed_tokens.weight": host(params["embed"]),
           "model.norm.weight": host(params["norm"]["weight"])}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = host(params["lm_head"]).T
    for i in range(c.num_layers):
        p = params["layers"][i]
        out.update(attention_to_hf(p["attn"], c, i))
        out[hf_name("input_layernorm", i)] = host(p["input_norm"]["weight"])
        out[hf_name("post_attention_layernorm", i)] = host(p["post_norm"]["weight"])
    return out
