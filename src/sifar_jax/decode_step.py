"""`llama_step`: the batch-1 decode step of a Llama-family model with FP8 weights as ONE op.

Every layer's RMSNorm, qkv, RoPE, KV-cache write, attention, o, residual add, RMSNorm,
gate_up, SwiGLU, down and residual add, then the final norm, in one call: on CUDA GPUs one
cooperative launch of a persistent kernel (ffi/step/cuda_llama_step.cu: grid barriers between
the phases, the weights streamed into shared memory by a producer warp per block that runs
ahead of them), on the CPU a reference of the same phases (ffi/step/llama_step.cc). With an
FP8 LM head (`head=`) the op also returns the logits, the head streamed by the same kernel;
without one it returns the final norm's output for a head outside. What is rounded where, and
why the attention is not bit-equal to XLA's: ffi/step/llama_step.h. models/persistent.py builds
a decoder step on it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import _ext

__all__ = ["LlamaLayer", "llama_step", "workspace_bytes", "HEAD_DIM", "MAX_GROUP", "MAX_LAYERS"]

HEAD_DIM = 128  # the kernel's head width (ffi/step/llama_step.h)
MAX_GROUP = 8  # query heads per KV head
MAX_SPLITS = 64  # key ranges per KV head
MAX_LAYERS = 128
CHUNK = 16  # weights per 16-byte load: every K a multiple of it
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
BF16 = jnp.dtype(jnp.bfloat16)


class LlamaLayer(NamedTuple):
    """One layer's operands: the norm scales bf16 [H]; each projection's e4m3 weight in the
    checkpoint's layout [N, K] (qkv [kv * (group + 2) * 128, H]: per KV head its query heads,
    key, value; o [H, heads * 128]; gate_up [2F, H], gate rows then up rows; down [H, F]) and
    its float32 scale, per output channel [N] or per tensor [1]."""
    input_norm: jax.Array
    qkv: jax.Array
    qkv_scale: jax.Array
    o: jax.Array
    o_scale: jax.Array
    post_norm: jax.Array
    gate_up: jax.Array
    gate_up_scale: jax.Array
    down: jax.Array
    down_scale: jax.Array


def workspace_bytes(hidden: int, kv_heads: int, group: int, ffn: int, layers: int) -> int:
    """The op's workspace (ffi/step/llama_step.cc, StepWorkspace: the same layout)."""
    up = lambda v: (v + 255) // 256 * 256  # noqa: E731
    return (up(4 * (1 + layers * kv_heads)) + up(2 * kv_heads * (group + 2) * HEAD_DIM)
            + up(2 * kv_heads * group * HEAD_DIM) + up(2 * ffn) + up(2 * hidden)
            + up(4 * kv_heads * MAX_SPLITS * group * (HEAD_DIM + 2)))


def _check(x, rope, pos, final_norm, layers, cache, kv_heads, group):
    name = "sifar_jax.llama_step"
    if x.ndim != 1 or jnp.dtype(x.dtype) != BF16:
        raise TypeError(f"{name}: x must be bfloat16 [H], got {x.dtype} {x.shape}")
    h = x.shape[0]
    if h % CHUNK:
        raise ValueError(f"{name}: H={h} must be a multiple of {CHUNK}")
    if rope.shape != (2, HEAD_DIM) or jnp.dtype(rope.dtype) != jnp.float32:
        raise ValueError(f"{name}: rope must be float32 [2, {HEAD_DIM}] (cos, sin), got "
                         f"{rope.dtype} {rope.shape}")
    if pos.shape != (2,) or jnp.dtype(pos.dtype) != jnp.int32:
        raise ValueError(f"{name}: pos must be int32 [2] (the slot written, the first slot "
                         f"attended), got {pos.dtype} {pos.shape}")
    if final_norm.shape != (h,) or jnp.dtype(final_norm.dtype) != BF16:
        raise ValueError(f"{name}: final_norm must be bfloat16 [{h}], got {final_norm.dtype} "
                         f"{final_norm.shape}")
    if not 1 <= len(layers) <= MAX_LAYERS:
        raise ValueError(f"{name}: 1..{MAX_LAYERS} layers, got {len(layers)}")
    if not 1 <= group <= MAX_GROUP or kv_heads < 1:
        raise ValueError(f"{name}: kv_heads >= 1 and 1 <= group <= {MAX_GROUP}, got "
                         f"{kv_heads}, {group}")
    ffn = layers[0].gate_up.shape[0] // 2
    q_dim = kv_heads * group * HEAD_DIM
    want = {"qkv": (kv_heads * (group + 2) * HEAD_DIM, h), "o": (h, q_dim),
            "gate_up": (2 * ffn, h), "down": (h, ffn)}
    for i, layer in enumerate(layers):
        for norm in ("input_norm", "post_norm"):
            v = getattr(layer, norm)
            if v.shape != (h,) or jnp.dtype(v.dtype) != BF16:
                raise ValueError(f"{name}: layer {i} {norm} must be bfloat16 [{h}], got "
                                 f"{v.dtype} {v.shape}")
        for proj, shape in want.items():
            w, s = getattr(layer, proj), getattr(layer, proj + "_scale")
            if jnp.dtype(w.dtype) != E4M3 or tuple(w.shape) != shape:
                raise ValueError(f"{name}: layer {i} {proj} must be float8_e4m3fn {list(shape)}"
                                 f" ([N, K]), got {w.dtype} {list(w.shape)}")
            if shape[1] % CHUNK:
                raise ValueError(f"{name}: layer {i} {proj}: K={shape[1]} must be a multiple "
                                 f"of {CHUNK}")
            if jnp.dtype(s.dtype) != jnp.float32 or s.ndim != 1 or s.shape[0] not in (1, shape[0]):
                raise ValueError(f"{name}: layer {i} {proj}_scale must be float32 [1] (per "
                                 f"tensor) or [{shape[0]}] (per channel), got {s.dtype} "
                                 f"{list(s.shape)}")
    n = len(layers)
    if (cache.ndim != 6 or jnp.dtype(cache.dtype) != BF16 or cache.shape[:4] != (n, 2, 1, kv_heads)
            or cache.shape[5] != HEAD_DIM):
        raise ValueError(f"{name}: cache must be bfloat16 [{n}, 2, 1, {kv_heads}, S, {HEAD_DIM}] "
                         f"(bhsd, batch 1), got {cache.dtype} {list(cache.shape)}")
    return ffn


def llama_step(x: jax.Array, rope: jax.Array, pos: jax.Array, final_norm: jax.Array,
               layers: Sequence[LlamaLayer], cache: jax.Array, *, kv_heads: int, group: int,
               eps: float, head: Optional[tuple[jax.Array, jax.Array]] = None) -> tuple:
    """One decode step of a Llama model with FP8 projections: returns (h, new cache), or with
    `head` (h, new cache, logits).

    x [H] bfloat16: the token's embedding. rope float32 [2, 128]: cos and sin at the token's
    rotary position (models.attention.rope_cos_sin). pos int32 [2]: the cache slot this
    token's key and value go to, and the first slot attended (left padding before it).
    final_norm [H]: the final RMSNorm's scale. layers: one LlamaLayer per layer. cache
    bfloat16 [layers, 2, 1, kv_heads, S, 128] (bhsd), updated in place (donate it). eps: the
    RMSNorms' epsilon. h [H] bfloat16 = final_norm(the residual stream after the last layer).
    head: (weight float8_e4m3fn [V, H], scale float32 [V] or [1]): logits [V] float32 = the
    head's rows times h in fp8_matvec's order, times the scale (not rounded).
    A slot outside [0, S), or a first slot after it, gives NaN in h (and in the logits) on GPUs
    and an error on the CPU."""
    ffn = _check(x, rope, pos, final_norm, layers, cache, kv_heads, group)
    vocab = _check_head(head, x.shape[0]) if head is not None else 0
    ws = workspace_bytes(x.shape[0], kv_heads, group, ffn, len(layers))
    operands = [x, rope, pos, final_norm]
    for layer in layers:
        operands.extend(layer)
    operands.append(cache)
    cache_at = len(operands) - 1
    if head is not None:
        operands.extend(head)
    call = jax.ffi.ffi_call(
        _ext.TARGETS.llama_step,
        (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(cache.shape, cache.dtype),
         jax.ShapeDtypeStruct((ws,), jnp.uint8), jax.ShapeDtypeStruct((vocab,), jnp.float32)),
        input_output_aliases={cache_at: 1})
    h, new_cache, _, logits = call(*operands, layers=np.int64(len(layers)),
                                   kv_heads=np.int64(kv_heads), group=np.int64(group),
                                   eps=np.float32(eps))
    return (h, new_cache) if head is None else (h, new_cache, logits)


def _check_head(head, hidden: int) -> int:
    name = "sifar_jax.llama_step"
    if not isinstance(head, (tuple, list)) or len(head) != 2:
        raise TypeError(f"{name}: head must be (weight, scale), got {type(head).__name__}")
    w, s = head
    if jnp.dtype(w.dtype) != E4M3 or w.ndim != 2 or w.shape[1] != hidden or w.shape[0] < 1:
        raise ValueError(f"{name}: head must be float8_e4m3fn [V, {hidden}], got {w.dtype} "
                         f"{list(w.shape)}")
    if jnp.dtype(s.dtype) != jnp.float32 or s.ndim != 1 or s.shape[0] not in (1, w.shape[0]):
        raise ValueError(f"{name}: head's scale must be float32 [1] (per tensor) or "
                         f"[{w.shape[0]}] (per row), got {s.dtype} {list(s.shape)}")
    return int(w.shape[0])

