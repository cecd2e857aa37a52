"""A decoding step's attention through JAX's own Pallas flash-decoding kernel.

At batch 1 XLA:GPU runs a step's attention as six kernels per layer (the scores' dot, the
softmax's max and sum, a convert, the values' dot, a transpose); with
`jax.experimental.pallas.ops.gpu.decode_attention.gqa` it is one Triton kernel (~3.9 us per layer
at Llama-8B shapes, KV 1K, one H200) and a few small fusions that merge its splits. Measured on
that host, TP=1, lax.psum, pipelined: 4.240 -> 4.154-4.162 ms at KV 1K, 4.926 -> 4.796 at KV 16K
(docs/performance.md). The cache write and the rotary embedding stay XLA's.

The kernel reads the cache in place only in the "bhsd" layout ([B, kv heads, S, D]: the library
takes [B, S, kv heads, D] and swaps the axes back, two transposes XLA cancels); it splits the
whole cache into `k_splits` equal parts, of which those past the last filled slot return at once,
so the cache's capacity must be a multiple of the split length, in at most MAX_SPLITS parts.
Elsewhere (and for head sizes that are not powers of two) the einsums run (`decode_attention`
returns None). Slots a row does not see are masked by their scores, not left
unread (the kernel loads whole blocks): they must hold finite values, as the cache always does
(zeros, or keys and values of earlier tokens).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

SPLITS = 16  # parts per attention bucket: the best of 4, 8, 16 at KV 1K and of 8, 16 at 16K
MIN_SPLIT = 64  # slots per part at least
MAX_SPLITS = 128  # parts per cache at most: every part, even one past pos, writes a partial
#                   result the merge reads (8 KB per part and row at Llama-8B's 32 heads): a
#                   small fill of a large cache runs the einsums over its bucket instead
BLOCK = 128  # slots per step of the kernel's loop at most


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def split_length(capacity: int, attend_len: int) -> Optional[int]:
    """Slots per kernel split (a power of two: Triton's blocks are) for a bucket of attend_len
    slots in a cache of `capacity`, or None where the cache does not split evenly into at most
    MAX_SPLITS parts."""
    split = min(_pow2_floor(max(MIN_SPLIT, attend_len // SPLITS)), _pow2_floor(attend_len))
    if capacity % split or capacity // split > MAX_SPLITS:
        return None
    return split


def _kernel_split(q: jax.Array, kc: jax.Array, attend_len: int) -> Optional[int]:
    """The split length decode_attention runs the kernel with, or None where it does not."""
    d = q.shape[-1]
    if d < 16 or d & (d - 1) or q.dtype != kc.dtype:
        return None
    return split_length(kc.shape[2], attend_len)


def applies(q: jax.Array, kc: jax.Array, attend_len: int) -> bool:
    """Whether decode_attention runs the kernel for these operands (else it returns None)."""
    return _kernel_split(q, kc, attend_len) is not None


def decode_attention(q: jax.Array, kc: jax.Array, vc: jax.Array, pos: jax.Array,
                     start: Optional[jax.Array], attend_len: int) -> Optional[jax.Array]:
    """Attention of one new token per row: q [B, kv heads, group, D] (rotated), kc/vc the
    written caches [B, kv heads, S, D]; slot s of row b is seen where start[b] <= s <= pos.
    Returns [B, kv heads * group, D] (heads in (kv head, group) order), or None where the
    kernel does not apply (`applies`: D a power of two >= 16, q in the cache's dtype, and
    split_length). Each split's partial result is stored and merged in q's dtype (bf16 adds a
    rounding the einsums do not make; the final division is float32, and so is the result)."""
    from jax.experimental.pallas.ops.gpu import decode_attention as pallas_decode

    split = _kernel_split(q, kc, attend_len)
    if split is None:
        return None
    b, kv, g, d = q.shape
    kv_len = jnp.broadcast_to(pos + 1, (b,)).astype(jnp.int32)
    return pallas_decode.gqa(q.reshape(b, kv * g, d), jnp.swapaxes(kc, 1, 2),
                             jnp.swapaxes(vc, 1, 2), start_idx=start, kv_seq_len=kv_len,
                             k_splits=kc.shape[2] // split, block_k=min(BLOCK, split),
                             interpret=jax.default_backend() != "gpu")
