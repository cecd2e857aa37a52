"""`qwen3_moe_step`: the batch-1 decode step of a Qwen3-MoE model with FP8 or bf16 weights as
ONE op, llama_step's sibling (decode_step.py).

Every layer's RMSNorm, qkv, per-head q and k RMSNorm, RoPE, KV-cache write, attention, o,
residual add, RMSNorm, router, top-k (renormalised with norm_topk_prob), the chosen experts'
gate_up, SwiGLU and down, their routing-weighted sum and residual add, then the final norm and
optionally the LM head, in one call: on CUDA GPUs one cooperative launch of a persistent kernel
(ffi/step/cuda_qwen3_moe_step.cu, whose weight-streaming warp waits for each layer's expert
selection before streaming the chosen experts' rows), on the CPU a reference of the same phases
(ffi/step/qwen3_moe_step.cc). What is rounded where, the top-k's tie rule (the lower expert
index, as jax.lax.top_k) and the softmax's summation order: ffi/step/qwen3_moe_step.h. TP = 1, or R
virtual ranks on one device (no step across devices). models/qwen3_moe/step.py builds a decoder step
on it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import _ext
from .decode_step import (ALLREDUCE_PHASES, BF16, CHUNK, DEFAULT_TIMEOUT_S, HEAD_DIM, MAX_GROUP,
                          MAX_LAYERS, MAX_RANKS, WEIGHT_DTYPES)

__all__ = ["Qwen3MoeLayer", "qwen3_moe_step", "qwen3_moe_step_virtual_ranks", "workspace_bytes",
           "MAX_EXPERTS", "MAX_TOP_K"]

_limits = _ext.lib.qwen3_moe_step_limits()
MAX_EXPERTS = _limits["max_experts"]
MAX_TOP_K = _limits["max_top_k"]
_NAME = "sifar_jax.qwen3_moe_step"


class Qwen3MoeLayer(NamedTuple):
    """One layer's operands. Norm scales bf16: input_norm, post_norm [H]; q_norm, k_norm
    [128] (Qwen3's per-head RMSNorm). qkv [kv * (group + 2) * 128, H] and o [H, heads * 128]
    as llama_step's, each with a float32 scale per row [N] or per tensor [1]. router [E, H]
    bf16 rows (the transpose of the model's [H, E]). The experts as rows: gate_up [E, 2I, H]
    (per expert its gate rows, then its up rows), down [E, H, I], each with a float32 scale per
    row of every expert [E * N], per expert [E] or per tensor [1]. qkv, o and the experts are
    one weight type: float8_e4m3fn or bfloat16."""
    input_norm: jax.Array
    qkv: jax.Array
    qkv_scale: jax.Array
    q_norm: jax.Array
    k_norm: jax.Array
    o: jax.Array
    o_scale: jax.Array
    post_norm: jax.Array
    router: jax.Array
    gate_up: jax.Array
    gate_up_scale: jax.Array
    down: jax.Array
    down_scale: jax.Array


def _workspace(hidden, kv_heads, group, inter, layers, experts, top_k, ranks=1) -> dict:
    return _ext.lib.qwen3_moe_step_workspace(int(hidden), int(kv_heads), int(group), int(inter),
                                             int(layers), int(experts), int(top_k), int(ranks))


def workspace_bytes(hidden: int, kv_heads: int, group: int, inter: int, layers: int,
                    experts: int, top_k: int, ranks: int = 1) -> int:
    """The bytes of the op's workspace (ffi/step/qwen3_moe_step.cc, Qwen3MoeWorkspace; the op
    checks the size it is given against it). ValueError outside the op's limits."""
    return int(_workspace(hidden, kv_heads, group, inter, layers, experts, top_k, ranks)["total"])


def _check(x, rope, pos, final_norm, layers, cache, kv_heads, group, top_k):
    """Trace-time checks of what the op checks again: (E, I, weight dtype)."""
    if x.ndim != 1 or jnp.dtype(x.dtype) != BF16 or x.shape[0] % CHUNK:
        raise ValueError(f"{_NAME}: x must be bfloat16 [H], H a multiple of {CHUNK}, got "
                         f"{x.dtype} {x.shape}")
    h = x.shape[0]
    if rope.shape != (2, HEAD_DIM) or pos.shape != (2,) or final_norm.shape != (h,):
        raise ValueError(f"{_NAME}: rope [2, {HEAD_DIM}], pos [2] and final_norm [{h}] needed, "
                         f"got {rope.shape}, {pos.shape}, {final_norm.shape}")
    if not 1 <= len(layers) <= MAX_LAYERS or not 1 <= group <= MAX_GROUP or kv_heads < 1:
        raise ValueError(f"{_NAME}: 1..{MAX_LAYERS} layers, kv_heads >= 1 and 1 <= group <= "
                         f"{MAX_GROUP}, got {len(layers)}, {kv_heads}, {group}")
    gu = layers[0].gate_up
    if gu.ndim != 3:
        raise ValueError(f"{_NAME}: gate_up must be [E, 2I, H], got {list(gu.shape)}")
    e, inter = gu.shape[0], gu.shape[1] // 2
    if not 1 <= top_k <= min(MAX_TOP_K, e) or e > MAX_EXPERTS:
        raise ValueError(f"{_NAME}: top_k in [1, min({MAX_TOP_K}, E)] and E <= {MAX_EXPERTS} "
                         f"needed, got top_k={top_k}, E={e}")
    wdt = jnp.dtype(layers[0].qkv.dtype)
    if wdt not in WEIGHT_DTYPES:
        raise ValueError(f"{_NAME}: the weights must be float8_e4m3fn or bfloat16 (layer 0 qkv "
                         f"is {wdt})")
    q = kv_heads * group * HEAD_DIM
    want = {"qkv": (kv_heads * (group + 2) * HEAD_DIM, h), "o": (h, q),
            "gate_up": (e, 2 * inter, h), "down": (e, h, inter)}
    for i, layer in enumerate(layers):
        for name, shape in want.items():
            w = getattr(layer, name)
            if jnp.dtype(w.dtype) != wdt or tuple(w.shape) != shape:
                raise ValueError(f"{_NAME}: layer {i} {name} must be {wdt} {list(shape)}, got "
                                 f"{w.dtype} {list(w.shape)}")
        if tuple(layer.router.shape) != (e, h) or jnp.dtype(layer.router.dtype) != BF16:
            raise ValueError(f"{_NAME}: layer {i} router must be bfloat16 [{e}, {h}] (rows), "
                             f"got {layer.router.dtype} {list(layer.router.shape)}")
    n = len(layers)
    if cache.ndim != 6 or cache.shape[:4] != (n, 2, 1, kv_heads) or cache.shape[5] != HEAD_DIM:
        raise ValueError(f"{_NAME}: cache must be bfloat16 [{n}, 2, 1, {kv_heads}, S, "
                         f"{HEAD_DIM}] (bhsd, batch 1), got {list(cache.shape)}")
    return e, inter, wdt


def qwen3_moe_step(x: jax.Array, rope: jax.Array, pos: jax.Array, final_norm: jax.Array,
                   layers: Sequence[Qwen3MoeLayer], cache: jax.Array, *, kv_heads: int,
                   group: int, top_k: int, norm_topk_prob: bool, eps: float,
                   head: Optional[tuple[jax.Array, jax.Array]] = None,
                   routing: bool = False) -> tuple:
    """One decode step of a Qwen3-MoE model on one device: returns (h, new cache), with `head`
    (h, new cache, logits), and with routing=True also (ids [layers, top_k] int32, weights
    [layers, top_k] float32): the experts each layer chose, in slot order, and their weights
    (bf16 values).

    x, rope, pos, final_norm, cache, head: as sifar_jax.llama_step's (the cache donated, the
    head of the layers' weight type with its float32 scale). layers: one Qwen3MoeLayer per
    layer. top_k: experts per token; norm_topk_prob: the chosen weights renormalised to sum to
    1. eps: every RMSNorm's epsilon (the q/k norms' too). A slot outside the cache is an error
    on the CPU and NaN on GPUs."""
    return _call(x, rope, pos, final_norm, layers, cache, kv_heads=kv_heads, group=group,
                 top_k=top_k, norm_topk_prob=norm_topk_prob, eps=eps, head=head, routing=routing)


def qwen3_moe_step_virtual_ranks(x: jax.Array, rope: jax.Array, pos: jax.Array,
                                 final_norm: jax.Array, layers: Sequence[Qwen3MoeLayer],
                                 cache: jax.Array, *, kv_heads: int, group: int, top_k: int,
                                 norm_topk_prob: bool, eps: float, ranks: int,
                                 allreduce: str = "sifar",
                                 head: Optional[tuple[jax.Array, jax.Array]] = None,
                                 routing: bool = False) -> tuple:
    """`qwen3_moe_step` as a TP=`ranks` model (the TP=1 operands; rank r reads KV heads
    [r kv/R, (r+1) kv/R) and every expert's FFN rows [r I/R, (r+1) I/R)), o's and the MoE
    block's per-rank outputs rounded to bf16 and added in rank order in float32, rounded once,
    as a TP decoder with sifar_psum computes them. Returns what qwen3_moe_step returns. On a GPU
    the ranks are R equal sets of blocks of the one launch, the all-reduce phase between them
    (`allreduce`: "sifar" or "oneshot", as llama_step_virtual_ranks)."""
    if not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS or kv_heads % ranks:
        raise ValueError(f"{_NAME}: ranks must be an int in [1, {MAX_RANKS}] splitting "
                         f"{kv_heads} KV heads, got {ranks!r}")
    if allreduce not in ALLREDUCE_PHASES:
        raise ValueError(f"{_NAME}: allreduce must be one of {ALLREDUCE_PHASES}, got "
                         f"{allreduce!r}")
    return _call(x, rope, pos, final_norm, layers, cache, kv_heads=kv_heads, group=group,
                 top_k=top_k, norm_topk_prob=norm_topk_prob, eps=eps, head=head, routing=routing,
                 ranks=ranks, oneshot=allreduce == "oneshot")


def _call(x, rope, pos, final_norm, layers, cache, *, kv_heads, group, top_k, norm_topk_prob,
          eps, head, routing, ranks=1, oneshot=False):
    e, inter, wdt = _check(x, rope, pos, final_norm, layers, cache, kv_heads, group, top_k)
    vocab = 0
    if head is not None:
        w, s = head
        if jnp.dtype(w.dtype) != wdt or w.ndim != 2 or w.shape[1] != x.shape[0]:
            raise ValueError(f"{_NAME}: head must be {wdt} [V, {x.shape[0]}] (the layers' "
                             f"weight type), got {w.dtype} {list(w.shape)}")
        vocab = int(w.shape[0])
    if inter % (CHUNK * ranks):
        raise ValueError(f"{_NAME}: I={inter} must split over {ranks} ranks in multiples of "
                         f"{CHUNK}")
    ws = _workspace(x.shape[0], kv_heads, group, inter, len(layers), e, top_k, ranks)
    operands = [x, rope, pos, final_norm]
    for layer in layers:
        operands.extend(layer)
    operands.append(cache)
    cache_at = len(operands) - 1
    if head is not None:
        operands.extend(head)
    call = jax.ffi.ffi_call(
        _ext.TARGETS.qwen3_moe_step,
        (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(cache.shape, cache.dtype),
         jax.ShapeDtypeStruct((ws["total"],), jnp.uint8),
         jax.ShapeDtypeStruct((vocab,), jnp.float32)),
        input_output_aliases={cache_at: 1})
    h, new_cache, work, logits = call(
        *operands, layers=np.int64(len(layers)), kv_heads=np.int64(kv_heads),
        group=np.int64(group), top_k=np.int64(top_k), norm_topk_prob=np.int64(bool(norm_topk_prob)),
        eps=np.float32(eps), ranks=np.int64(ranks), oneshot=np.int64(oneshot),
        timeout_ns=np.int64(int(DEFAULT_TIMEOUT_S * 1e9)))
    out = (h, new_cache) if head is None else (h, new_cache, logits)
    if routing:
        n = len(layers) * top_k
        words = jax.lax.bitcast_convert_type(
            work[ws["sel"]:ws["sel"] + 8 * n].reshape(2 * n, 4), jnp.int32)
        ids = words[:n].reshape(len(layers), top_k)
        weights = jax.lax.bitcast_convert_type(words[n:], jnp.float32).reshape(len(layers), top_k)
        out = out + (ids, weights)
    return out
