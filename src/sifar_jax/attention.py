"""`decode_attention`: one decoding step's attention for one new token per sequence.

A decoding step's attention is small (at batch 1 and 1K cached tokens, ~4 MB of keys and values
per layer of Llama-3.1-8B) but XLA:GPU runs it as about ten kernels per layer: the rotary
embedding, the two cache updates, two dots, the softmax's reductions and converts, ~15 us per
layer on an H200 (docs/performance.md). `decode_attention` is the same step as two kernels of our
own (ffi/attention/): the rotary embedding of the query heads and the key, the key and value
written into the cache in place, and flash-decoding over the visible slots (chunks of the cache
in parallel, then a merge of the chunks in order), reading each KV head's keys and values once
for all its query heads (GQA). Chunks past `pos` are never read, so a step's cost follows the
sequence's length, not the cache's.

Numerics: the rotated query and key are rounded to the activation dtype (the key is stored so),
scores, softmax and the weighted sum of values stay float32 and the output is rounded once (a
model's XLA code usually rounds the probabilities to the activation dtype first). Off CUDA,
`impl="auto"` runs the same math with XLA's ops; the CPU handler (`impl="kernel"`) runs the
kernels' chunks and merge in plain loops. Not differentiable (a decoding kernel).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _ext, _jax_compat

__all__ = ["attention_plan", "decode_attention"]

DTYPES = tuple(jnp.dtype(n) for n in ("float32", "bfloat16", "float16"))
IMPLS = ("auto", "kernel", "xla")
LAYOUTS = {"bhsd": 0, "bshd": 1}  # the cache's dims: batch, kv heads, slots, head_dim
HEAD_DIMS = (16, 32, 64, 128, 256)
MAX_GROUP = 8  # query heads per KV head the kernel holds accumulators for
MAX_CHUNK = 512  # ffi/attention/attention.h kMaxChunk: slots per chunk (scores in shared memory)
MAX_SPLITS = 1024  # kMaxSplits: chunks the merge weighs at once
MIN_CHUNK = 16  # below this a chunk's block is mostly its fixed cost
TARGET_BLOCKS = 4 * 132  # chunk blocks a call aims for: four per SM of an H100/H200
MAX_PLANNED_CHUNK = 256  # the plan's longest chunk (a block's keys are a serial loop)


def attention_plan(batch: int, kv_heads: int, length: int,
                   target_blocks: int | None = None) -> int:
    """The number of chunks (splits) `length` cache slots are cut into: enough blocks
    (batch x kv_heads x splits) to reach target_blocks (None: TARGET_BLOCKS, read when called),
    chunks of at least MIN_CHUNK and at most MAX_PLANNED_CHUNK slots (at most MAX_SPLITS
    chunks)."""
    target = TARGET_BLOCKS if target_blocks is None else target_blocks
    splits = math.ceil(target / max(1, batch * kv_heads))
    splits = min(splits, max(1, length // MIN_CHUNK))
    return min(max(splits, math.ceil(length / MAX_PLANNED_CHUNK), 1), MAX_SPLITS)


def _cache_dims(layout: str, k_cache) -> tuple[int, int]:
    """(kv heads, slots) of a cache in `layout`."""
    _, a, b, _ = k_cache.shape
    return (a, b) if layout == "bhsd" else (b, a)


def _rope(x, cos, sin):
    """x [..., D] rotated (rotate_half) in float32 and rounded back; cos/sin broadcastable."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def _reference(qkv, k_cache, v_cache, pos, cos, sin, start, length: int, layout: str):
    """The same step with XLA's ops: (out [B, KV, G, D], k_cache, v_cache)."""
    b, kv, g2, d = qkv.shape
    g = g2 - 2
    c = cos[:, None, None, :]  # [Bc, 1, 1, D] against [B, KV, G + 1, D]
    s = sin[:, None, None, :]
    rotated = _rope(qkv[:, :, :g + 1], c, s)
    q, k, v = rotated[:, :, :g], rotated[:, :, g], qkv[:, :, g + 1]
    axis = 2 if layout == "bhsd" else 1
    at = [0, 0, 0, 0]
    at[axis] = pos
    to_cache = (lambda x: x[:, :, None, :]) if layout == "bhsd" else (lambda x: x[:, None])
    kc = jax.lax.dynamic_update_slice(k_cache, to_cache(k).astype(k_cache.dtype), at)
    vc = jax.lax.dynamic_update_slice(v_cache, to_cache(v).astype(v_cache.dtype), at)
    ka = jax.lax.slice_in_dim(kc, 0, length, axis=axis)
    va = jax.lax.slice_in_dim(vc, 0, length, axis=axis)
    dims = "bksd" if layout == "bhsd" else "bskd"
    scores = jnp.einsum(f"bkgd,{dims}->bkgs", q, ka, preferred_element_type=jnp.float32)
    scores = scores * np.float32(1.0 / math.sqrt(d))
    slots = jnp.arange(length)
    seen = (slots[None, :] <= pos) & (slots[None, :] >= start[:, None])  # [B, S]
    visible = seen[:, None, None, :]
    top = jnp.max(jnp.where(visible, scores, -jnp.inf), axis=-1, keepdims=True)
    p = jnp.where(visible, jnp.exp(scores - jnp.where(visible, top, 0.0)), 0.0)
    total = jnp.sum(p, axis=-1, keepdims=True)
    # slots never written may hold anything (NaN): 0 * NaN would reach the sum
    seen_v = seen[:, None, :, None] if layout == "bhsd" else seen[:, :, None, None]
    va = jnp.where(seen_v, va.astype(jnp.float32), 0.0)
    out = jnp.einsum(f"bkgs,{dims}->bkgd", p, va)
    out = jnp.where(total > 0, out / jnp.where(total > 0, total, 1.0), 0.0)
    return out.astype(qkv.dtype), kc, vc


def _kernel(qkv, k_cache, v_cache, pos, cos, sin, start, length: int, layout: str,
            splits: int):
    b, kv, g2, d = qkv.shape
    # Under shard_map the operands get one varying type and the results that type.
    qkv, k_cache, v_cache, pos, cos, sin, start = _jax_compat.same_varying(
        qkv, k_cache, v_cache, pos, cos, sin, start)
    like = jax.typeof(qkv)
    ws_shape = (b, kv, splits, g2 - 2, d + 2) if splits > 1 else (1,)
    call = jax.ffi.ffi_call(
        _ext.TARGETS.decode_attention,
        (like.update(shape=(b, kv, g2 - 2, d)), jax.typeof(k_cache), jax.typeof(v_cache),
         like.update(shape=ws_shape, dtype=jnp.dtype(jnp.float32))),
        input_output_aliases={1: 1, 2: 2},
    )
    out, kc, vc, _ = call(qkv, k_cache, v_cache, pos, cos, sin, start, length=np.int64(length),
                          splits=np.int64(splits), layout=np.int64(LAYOUTS[layout]))
    return out, kc, vc


def _kernel_refusal(qkv, k_cache, length: int) -> str | None:
    dt = jnp.dtype(qkv.dtype)
    b, kv, g2, d = qkv.shape
    if dt not in DTYPES:
        return f"dtype {dt} (the kernel runs {', '.join(x.name for x in DTYPES)})"
    if jnp.dtype(k_cache.dtype) != dt:
        return f"a {k_cache.dtype} cache with {dt} activations (the kernel needs one dtype)"
    if d not in HEAD_DIMS or d * dt.itemsize > 512:
        return f"head_dim {d} (the kernel runs {HEAD_DIMS}, at most 512 bytes per head)"
    if g2 - 2 > MAX_GROUP:
        return f"{g2 - 2} query heads per KV head (the kernel runs at most {MAX_GROUP})"
    if b > 65535 or kv > 65535:
        return "more than 65535 sequences or KV heads"
    if length > MAX_SPLITS * MAX_CHUNK:
        return f"length {length} (at most {MAX_SPLITS * MAX_CHUNK} slots)"
    return None


def _check(qkv, k_cache, v_cache, cos, sin, start, layout: str):
    if layout not in LAYOUTS:
        raise ValueError(f"sifar_jax.decode_attention: layout must be one of "
                         f"{sorted(LAYOUTS)}, got {layout!r}")
    if qkv.ndim != 4 or qkv.shape[2] < 3:
        raise ValueError(f"sifar_jax.decode_attention: qkv must be [B, KV heads, G + 2, D] (each "
                         f"KV group's G >= 1 query heads, then its key, then its value), got "
                         f"shape {qkv.shape}")
    b, kv, _, d = qkv.shape
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"sifar_jax.decode_attention: the caches must be two arrays of one rank-4 "
                         f"shape, got {k_cache.shape} and {v_cache.shape}")
    cache_kv, _ = _cache_dims(layout, k_cache)
    if k_cache.shape[0] != b or cache_kv != kv or k_cache.shape[3] != d:
        want = (b, kv, "S", d) if layout == "bhsd" else (b, "S", kv, d)
        raise ValueError(f"sifar_jax.decode_attention: a {layout} cache for qkv {qkv.shape} is "
                         f"{want}, got {k_cache.shape}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"sifar_jax.decode_attention: the caches have dtypes {k_cache.dtype} and "
                        f"{v_cache.dtype}")
    if cos.shape != sin.shape or cos.shape[-1:] != (d,) or cos.ndim > 2 or (
            cos.ndim == 2 and cos.shape[0] not in (1, b)):
        raise ValueError(f"sifar_jax.decode_attention: cos and sin must be [D={d}] or [1 or B, D], "
                         f"got {cos.shape} and {sin.shape}")
    if start is not None and start.shape != (b,):
        raise ValueError(f"sifar_jax.decode_attention: start must be [B={b}], got {start.shape}")


def decode_attention(qkv: jax.Array, k_cache: jax.Array, v_cache: jax.Array, pos,
                     cos: jax.Array, sin: jax.Array, *, length: int | None = None,
                     start: jax.Array | None = None, layout: str = "bhsd", impl: str = "auto",
                     splits: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decoding step's attention: returns (out [B, KV, G, D], k_cache, v_cache).

    qkv: [B, KV, G + 2, D], this step's token of each sequence: each KV group's G query heads,
    then its key, then its value, before the rotary embedding. k_cache, v_cache: [B, KV, S, D]
    (layout "bhsd") or [B, S, KV, D] ("bshd"), updated in place where donated: the rotated key
    and the value are written at slot `pos` (an int32 scalar, clamped to [0, S) as
    dynamic_update_slice does). cos, sin: [D] or [1 or B, D] float32, the rotary factors of
    this token's position (rotate_half layout, as transformers' Llama). Each query head attends
    to the visible slots of the first `length` (static; default S): slot j is visible when
    start[b] <= j <= pos (start: [B] int32, each sequence's first slot; default 0). A sequence
    with no visible slot gets zeros. Scale 1/sqrt(D).

    impl: "auto" runs the kernels on CUDA GPUs and XLA's ops elsewhere; "kernel" runs the
    kernels on every platform (CPU: the handler's loops; raises where they cannot run); "xla"
    always XLA's ops. splits: chunks of the cache run in parallel (default attention_plan).
    """
    if impl not in IMPLS:
        raise ValueError(f"sifar_jax.decode_attention: impl must be one of {IMPLS}, got {impl!r}")
    cos = jnp.asarray(cos, jnp.float32)
    sin = jnp.asarray(sin, jnp.float32)
    _check(qkv, k_cache, v_cache, cos, sin, start, layout)
    b, kv, _, _ = qkv.shape
    _, slots = _cache_dims(layout, k_cache)
    length = slots if length is None else length
    if not 1 <= length <= slots:
        raise ValueError(f"sifar_jax.decode_attention: length={length} must be in [1, S={slots}]")
    cos, sin = cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
    pos = jnp.asarray(pos, jnp.int32).reshape(())
    start = jnp.zeros((b,), jnp.int32) if start is None else start.astype(jnp.int32)
    why = _kernel_refusal(qkv, k_cache, length)
    if impl == "xla" or (why is not None and impl == "auto"):
        return _reference(qkv, k_cache, v_cache, pos, cos, sin, start, length, layout)
    if why is not None:
        raise TypeError(f"sifar_jax.decode_attention: the kernel cannot run {why}; "
                        f"use impl='auto'")
    if splits is None:
        splits = attention_plan(b, kv, length)
    if not 1 <= splits <= min(length, MAX_SPLITS) or math.ceil(length / splits) > MAX_CHUNK:
        raise ValueError(f"sifar_jax.decode_attention: splits={splits} must be in [1, "
                         f"min(length={length}, {MAX_SPLITS})] with chunks of at most "
                         f"{MAX_CHUNK} slots")
    args = (qkv, k_cache, v_cache, pos, cos, sin, start, length, layout)
    if impl == "kernel":
        return _kernel(*args, splits)
    if "cuda" not in _ext.PLATFORMS:  # a build without the CUDA backend
        return _reference(*args)
    # the platform is known only when lowering
    return jax.lax.platform_dependent(*args[:7], cuda=lambda *a: _kernel(*a, length, layout, splits),
                                      default=lambda *a: _reference(*a, length, layout))
