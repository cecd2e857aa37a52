"""A decoding step's attention through the kernel of JAX's Pallas flash-decoding op.

At batch 1 XLA:GPU runs a step's attention as six kernels per layer (the scores' dot, the
softmax's max and sum, a convert, the values' dot, a transpose). Here it is two: the kernel body
of `jax.experimental.pallas.ops.gpu.decode_attention` (one Triton program per row, kv head and
split of the cache), launched by our own
pallas_call on the bhsd cache in place, and one Pallas program per (row, kv head) that merges the
splits' partial results (the library's `gqa` merges them in three XLA fusions). The split count
follows the kv heads (TARGET_PROGRAMS: TP=2's 4 kv heads per rank get twice TP=1's splits) and
each program keeps three key/value blocks in flight (NUM_STAGES). Against the library's `gqa`
a step is faster at TP=1 and at TP=2's per-rank shapes, most at long caches
(docs/performance.md). The cache write and the rotary embedding stay XLA's.

The kernel reads a layer's keys and values in place from the whole cache array only in the
"bhsd" layout ([layers, 2, B, kv heads, S, D]); it cuts the cache into equal parts and runs
those of the bucket, so the cache's capacity must be a multiple of the split length. Elsewhere
(head sizes that are not powers of two, parts under 16 slots, blocks too large for shared
memory) the einsums run (`decode_attention` returns None). Slots a row does not see are masked
by their scores, not left unread (the kernel loads whole blocks): they must hold finite values,
as the cache always does (zeros, or keys and values of earlier tokens).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

TARGET_PROGRAMS = 128  # kernel programs (rows x kv heads x splits) per bucket: at 8 kv heads
#                       and batch 1, 16 splits, the best of 4, 8, 16 at KV 1K and of 8, 16 at 16K
MIN_SPLIT = 64  # slots per part at least (buckets of 16-32 slots: one part of the bucket)
KERNEL_MIN_SPLIT = 16  # the kernel's own floor (its blocks feed Triton dots of >= 16 rows)
BLOCK = 128  # slots per step of the kernel's loop at most
MERGE_MAX_ELEMENTS = 1 << 14  # partial outputs (splits x group x D) one merge program holds in
#                               registers; more (many splits of a long group) merge in XLA's ops
NUM_WARPS = 4  # the kernel's warps per program (the library's default; 8 was slower at 16K)
NUM_STAGES = 3  # key/value blocks in flight per program (the library's 2 was slower at TP=2's
#                 shapes at 16K, docs/performance.md), as far as SMEM_BUDGET holds them
SMEM_BUDGET = 200 * 1024  # bytes of shared memory the pipelined blocks may take (H100/H200: 227 KB)
BLOCK_H = 16  # query heads per kernel program (Triton's dots need 16 rows; fewer are masked)
TOTAL_FLOOR = 1e-30  # the merge's denominator at least (see _combine)


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _is_pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def split_length(capacity: int, attend_len: int, rows_heads: int = 8) -> Optional[int]:
    """Slots per kernel split (a power of two: Triton's blocks are) for a bucket of attend_len
    slots in a cache of `capacity` read by rows_heads (batch rows x kv heads) programs per split,
    or None where the cache does not split evenly into parts of at least KERNEL_MIN_SPLIT slots.
    The bucket is cut into about TARGET_PROGRAMS / rows_heads parts (only the bucket's parts
    run), so that fewer kv heads per rank (TP=2) still give the GPU enough programs."""
    parts = max(1, TARGET_PROGRAMS // rows_heads)
    split = min(_pow2_floor(max(MIN_SPLIT, attend_len // parts)), _pow2_floor(attend_len))
    if split < KERNEL_MIN_SPLIT or capacity % split:
        return None
    return split


def _kernel_split(q: jax.Array, cache: jax.Array, attend_len: int) -> Optional[int]:
    """The split length decode_attention runs the kernel with, or None where it does not (also
    where one key and one value block would not fit in SMEM_BUDGET)."""
    d = q.shape[-1]
    if d < 16 or not _is_pow2(d) or q.dtype != cache.dtype:
        return None
    split = split_length(cache.shape[-2], attend_len, q.shape[0] * q.shape[1])
    if split is None or 2 * min(BLOCK, split) * d * cache.dtype.itemsize > SMEM_BUDGET:
        return None
    return split


def applies(q: jax.Array, cache: jax.Array, attend_len: int) -> bool:
    """Whether decode_attention runs the kernel for these operands (else it returns None)."""
    return _kernel_split(q, cache, attend_len) is not None


def pipeline_stages(block_k: int, d: int, itemsize: int) -> int:
    """Key/value blocks the kernel keeps in flight: NUM_STAGES where SMEM_BUDGET holds them
    (a stage is a key and a value block), fewer for long heads or wide dtypes, at least one
    (_kernel_split runs the kernel only where one stage fits)."""
    return max(1, min(NUM_STAGES, SMEM_BUDGET // (2 * block_k * d * itemsize)))


def _partials(q, cache, layer: int, start, kv_len, split: int, splits: int, interpret: bool):
    """Each split's unnormalised output o [B, KV, splits, G, D] float32 and its rows' exp-sum l
    and score maximum m [B, KV, splits, G] (in that order), from the library's kernel body: one
    program per (head block, split, row, kv head) over the first `splits` parts of `split` slots
    of layer `layer`'s keys and values, read in place from the whole cache (a split past kv_len
    or before start returns at once). The kernel reads its head block and split as program ids
    0 and 1."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    from jax.experimental.pallas.ops.gpu.decode_attention import attn_forward_kernel

    b, kv, g, d = q.shape
    block_k = min(BLOCK, split)
    stages = pipeline_stages(block_k, d, cache.dtype.itemsize)
    kernel = functools.partial(attn_forward_kernel, sm_scale=d ** -0.5, block_k=block_k,
                               block_h=BLOCK_H, num_heads=g)
    part = lambda c: pl.BlockSpec((None, None, None, None, split, d),  # noqa: E731
                                  lambda i, j, r, h: (layer, c, r, h, j, 0))
    per_row = pl.BlockSpec((None,), lambda i, j, r, h: (r,))
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(g, BLOCK_H), splits, b, kv),
        in_specs=[pl.BlockSpec((None, None, BLOCK_H, d), lambda i, j, r, h: (r, h, i, 0)),
                  part(0), part(1), per_row, per_row],
        out_specs=[pl.BlockSpec((None, None, None, BLOCK_H, d), lambda i, j, r, h: (r, h, j, i, 0)),
                   pl.BlockSpec((None, None, None, BLOCK_H), lambda i, j, r, h: (r, h, j, i)),
                   pl.BlockSpec((None, None, None, BLOCK_H), lambda i, j, r, h: (r, h, j, i))],
        out_shape=[jax.ShapeDtypeStruct((b, kv, splits, g, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, kv, splits, g), jnp.float32),
                   jax.ShapeDtypeStruct((b, kv, splits, g), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=stages),
        interpret=interpret, name="decode_attention_splits")(q, cache, cache, start, kv_len)


def _combine(o, m, l, axis: int, top):
    """The splits' partial results (o [..., G, D], m and l [..., G], splits on `axis`) merged
    and normalised, with top = m's maximum over the splits: a split that saw no slot has
    m = min, weight 0; the denominator is >= 1 where a slot is seen (the split with the largest
    score adds exp(0) = 1), and the floor only keeps a row that sees nothing (start > pos, which
    the decoder never asks) finite."""
    w = jnp.exp(m - jnp.expand_dims(top, axis))
    total = jnp.maximum((l * w).sum(axis), TOTAL_FLOOR)
    return (o * w[..., None]).sum(axis) / total[..., None]


def _merge_kernel(o_ref, m_ref, l_ref, out_ref):
    """One (row, kv head): its splits [splits, G, D] merged."""
    m = m_ref[...]
    out_ref[...] = _combine(o_ref[...], m, l_ref[...], 0, m.max(axis=0)).astype(out_ref.dtype)


def _merge(o, m, l, dtype, interpret: bool):
    """[B, KV, G, D] in dtype from _partials' outputs: one Pallas program per (row, kv head)
    where the splits and the group are powers of two (Triton's tensors are), else XLA's ops
    (three fusions: the library's merge)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    splits, g, d = o.shape[2:]
    if _is_pow2(splits) and _is_pow2(g) and splits * g * d <= MERGE_MAX_ELEMENTS:
        call = pl.pallas_call(
            _merge_kernel, out_shape=jax.ShapeDtypeStruct((g, d), dtype),
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
            interpret=interpret, name="decode_attention_merge")
        return jax.vmap(jax.vmap(call))(o, m, l)
    # the barrier keeps the maximum its own kernel, as the library does (its TODO
    # b/389925439: invalid values without it)
    return _combine(o, m, l, 2, jax.lax.optimization_barrier(m.max(axis=2))).astype(dtype)


def decode_attention(q: jax.Array, cache: jax.Array, layer: int, pos: jax.Array,
                     start: Optional[jax.Array], attend_len: int) -> Optional[jax.Array]:
    """Attention of one new token per row: q [B, kv heads, group, D] (rotated); cache the written
    cache [layers, 2, B, kv heads, S, D] (keys, then values, of every layer: sharding.cache_dims
    for "bhsd"), of which layer `layer` is read; slot s of row b is seen where
    start[b] <= s <= pos. Returns [B, kv heads * group, D] (heads in (kv head, group) order) in
    q's dtype, or None where the kernel does not apply (`applies`: D a power of two >= 16, q in
    the cache's dtype, and split_length). Each split's partial result is kept in float32 and
    merged in float32."""
    split = _kernel_split(q, cache, attend_len)
    if split is None:
        return None
    b, kv, g, d = q.shape
    interpret = jax.default_backend() != "gpu"
    start = jnp.zeros((b,), jnp.int32) if start is None else start.astype(jnp.int32)
    kv_len = jnp.broadcast_to(pos + 1, (b,)).astype(jnp.int32)
    splits = -(-attend_len // split)  # the bucket's parts: pos < attend_len
    o, l, m = _partials(q, cache, layer, start, kv_len, split, splits, interpret)
    return _merge(o, m, l, q.dtype, interpret).reshape(b, kv * g, d)
