"""What the families' one-kernel steps share (models/llama/step.py, models/qwen3_moe/step.py):
a projection as the ops take it, whether their kernels stream it, the LM head inside the op or
in XLA, and the operands before the layers (embedding row, RoPE angles, slots, final norm).
Family-agnostic: a model with `embed`, `norm`, `lm_head` (untied) and `layers[i].attn.qkv`."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from ..weights.types import Fp8Weight, RowWeight
from .attention import rope_cos_sin
from .tp import project


def streamable(w) -> bool:
    """Whether the kernel streams projection w: bf16 rows, or FP8 whose scales are per output
    row or per tensor (its two kinds of scale)."""
    if isinstance(w, RowWeight):
        return jnp.dtype(w.dtype) == jnp.bfloat16
    return isinstance(w, Fp8Weight) and (
        w.scale.size == 1 or (w.block[0] == 1 and w.scale.shape[-1] == 1))


def unstreamable(w, where: str) -> Optional[str]:
    """Why the kernels cannot stream projection w (an Fp8Weight or a RowWeight; `where` names
    it), or None."""
    if streamable(w):
        return None
    if isinstance(w, RowWeight):
        return (f"{where} is {jnp.dtype(w.dtype).name} rows: the persistent step streams bf16 or "
                f"FP8 weights")
    return (f"{where} has block scales {w.block}: the persistent step takes per-channel or "
            f"per-tensor scales")


def operands(w):
    """(weight [N, K], float32 scale [N] or [1]): a projection as the op takes it (an
    Fp8Weight's e4m3 values and scales; a RowWeight's bf16 rows and a scale of one)."""
    if isinstance(w, RowWeight):
        return w.rows(), jnp.ones((1,), jnp.float32)
    q2, s2, _ = w.kernel_operands()
    return q2, s2.reshape(-1).astype(jnp.float32)


def head_operands(model, c):
    """The op's head operands when the LM head is untied and of the layers' weight type (FP8
    with per-row or per-tensor scales, or bf16 rows): the kernel streams it; else None (the
    head runs in XLA on the op's h)."""
    w = None if c.tie_word_embeddings else model.lm_head[...]
    kind = type(model.layers[0].attn.qkv[...])
    if isinstance(w, kind) and streamable(w):
        return operands(w)
    return None


def step_operands(model, c, tokens, positions, start, inv_freq):
    """The op's operands but the layers and cache: (x, rope, pos, final_norm) for tokens [1, 1]
    at positions [1], the row's first slot `start` ([1]; None: 0)."""
    pos = positions[0].astype(jnp.int32)
    first = jnp.int32(0) if start is None else start[0].astype(jnp.int32)
    cos, sin = rope_cos_sin((pos - first)[None], inv_freq)
    x = jnp.take(model.embed[...], tokens[0, 0], axis=0)
    return x, jnp.concatenate([cos, sin]), jnp.stack([pos, first]), model.norm.weight[...]


def xla_head(model, c, h, rows: int, rank=None, ranks: int = 1):
    """Logits [1, 1, vocab / ranks] float32 of h [H] in XLA: the untied head's shard, or the
    tied embedding's vocabulary rows of this rank (the XLA decoder's split)."""
    h = h[None, None]
    if not c.tie_word_embeddings:
        return project("bth,hv->btv", h, model.lm_head[...], rows,
                       preferred_element_type=jnp.float32)
    w = model.embed[...]
    if ranks > 1:
        n = c.vocab_size // ranks
        w = jax.lax.dynamic_slice_in_dim(w, rank * n, n, axis=0)
    return project("bth,vh->btv", h, w, rows, preferred_element_type=jnp.float32)
