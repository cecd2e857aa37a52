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
so the cache's capacity must be a multiple of the split length. Elsewhere the einsums run
(`decode_attention` returns None). Slots a row does not see are masked by their scores, not left
unread (the kernel loads whole blocks): they must hold finite values, as the cache always does
(zeros, or keys and values of earlier tokens).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

SPLITS = 16  # parts per attention bucket: the best of 4, 8, 16 at KV 1K and of 8, 16 at 16K
MIN_SPLIT = 64  # slots per part at least (the kernel's blocks are >= 16 slots)


def split_length(capacity: int, attend_len: int) -> Optional[int]:
    """Slots per kernel split for a bucket of attend_len slots in a cache of `capacity`, or None
    where the cache cannot be split evenly."""
    split = min(attend_len, max(MIN_SPLIT, attend_len // SPLITS))
    return split if capacity % split == 0 and split % 16 == 0 else None


def decode_attention(q: jax.Array, kc: jax.Array, vc: jax.Array, pos: jax.Array,
                     start: Optional[jax.Array], attend_len: int) -> Optional[jax.Array]:
    """Attention of one new token per row: q [B, kv heads, group, D] (rotated), kc/vc the
    written caches [B, kv heads, S, D]; slot s of row b is seen where start[b] <= s <= pos.
    Returns [B, kv heads * group, D] (heads in (kv head, group) order; float32 for a bf16 q: the
    splits are merged in float32), or None
    where the kernel does not apply (see split_length)."""
    from jax.experimental.pallas.ops.gpu import decode_attention as pallas_decode

    b, kv, g, d = q.shape
    split = split_length(kc.shape[2], attend_len)
    if split is None:
        return None
    kv_len = jnp.broadcast_to(pos + 1, (b,)).astype(jnp.int32)
    return pallas_decode.gqa(q.reshape(b, kv * g, d), jnp.swapaxes(kc, 1, 2),
                             jnp.swapaxes(vc, 1, 2), start_idx=start, kv_seq_len=kv_len,
                             k_splits=kc.shape[2] // split, block_k=min(128, split),
                             interpret=jax.default_backend() != "gpu")
