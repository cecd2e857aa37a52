"""`fp8_matvec`: a decoding step's products with FP8 weights, y[m] = x[m] @ dequant(w[ids[m]]).T.

At batch 1 a projection is a stream of its weight: FP8 halves the bytes, but no XLA path reads
e4m3 weights faster than bf16 ones (docs/performance.md). This op reads every weight byte once
in a kernel of our own (ffi/matvec/cuda_fp8_matvec.cu): w stays in the checkpoint's layout
[N, K] (one output channel per row of K bytes; [E, N, K] with ids for an MoE layer's experts),
the scale is float32 over a grid of (block_n x block_k) blocks: per tensor, per output channel
or 128 x 128 blocks, w = q x scale. Sums are float32 in a fixed order that the CPU handler
repeats (ffi/matvec/fp8_matvec.h), rounded once to x's dtype: the same bits on both backends.
Not differentiable (a decoding kernel).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _ext, _jax_compat

__all__ = ["fp8_matvec", "fp8_matvec_plan", "scale_block", "regrid_scale", "dequantize"]

X_DTYPES = tuple(jnp.dtype(n) for n in ("float32", "bfloat16", "float16"))
W_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
IMPLS = ("auto", "kernel", "xla")
CHUNK = 16  # weights per 16-byte load
WARPS = 8  # warps per block (ffi/matvec/fp8_matvec.h)
LANES = (32, 16, 8, 4)
KSPLITS = (1, 2, 4, 8)
TARGET_BLOCKS = 2 * 132  # blocks a call aims for: two per SM of an H100/H200
MAX_ROWS = 65535


def fp8_matvec_plan(m: int, k: int, n: int, stacked: bool,
                    target_blocks: int | None = None) -> tuple[int, int]:
    """(lanes, ksplit) for x [m, k] against w [.., n, k]: `lanes` threads per weight row, the
    widest whose threads get >= 2 chunks of the row each; then the fewest warps sharing a
    row's K whose grid reaches target_blocks (None: TARGET_BLOCKS)."""
    target = TARGET_BLOCKS if target_blocks is None else target_blocks
    chunks = k // CHUNK
    lanes = next((v for v in LANES if chunks >= 2 * v), LANES[-1])
    grid_y = m if stacked else max(1, math.ceil(m / 8))
    best = 1
    for ksplit in KSPLITS:
        if chunks < 2 * lanes * ksplit:
            break  # fewer than 2 chunks per thread: no deeper split
        best = ksplit
        if math.ceil(n / ((WARPS // ksplit) * (32 // lanes))) * grid_y >= target:
            break
    return lanes, best


def scale_block(w_shape, scale_shape) -> tuple[int, int]:
    """The (block_n, block_k) a scale's shape implies for w [.., N, K] when it is unambiguous:
    one scale (per tensor: [1, 1], [] or [E]) or one per output channel ([.., N, 1]).
    Block grids (e.g. 128 x 128) are not inferred: pass block=."""
    n, k = w_shape[-2:]
    if math.prod(scale_shape) in (1, math.prod(w_shape[:-2])):
        return n, k
    if tuple(scale_shape[-2:]) == (n, 1):
        return 1, k
    raise ValueError(f"sifar_jax.fp8_matvec: cannot infer the scale's block from w {tuple(w_shape)} "
                     f"and scale {tuple(scale_shape)}: pass block=(block_n, block_k)")


def regrid_scale(scale, block: tuple[int, int], n: int, k: int, new_block: tuple[int, int]):
    """The same scales on a finer grid new_block (each a divisor of block's, or >= the dim):
    a shard whose rows start inside a checkpoint block then starts on a block boundary.
    scale [.., ceil(n/bn), ceil(k/bk)] -> [.., ceil(n/nbn), ceil(k/nbk)] (numpy or jax)."""
    xp = jnp if isinstance(scale, jax.Array) else np
    out = scale
    for axis, (size, old, new) in enumerate(((n, block[0], new_block[0]),
                                             (k, block[1], new_block[1]))):
        ax = scale.ndim - 2 + axis
        if new >= size or new == old:
            continue
        if old % new:
            raise ValueError(f"regrid_scale: block {new} does not divide {old}")
        idx = (np.arange(math.ceil(size / new)) * new) // old
        out = xp.take(out, idx, axis=ax)
    return out


def dequantize(w, scale, block: tuple[int, int], dtype=jnp.float32):
    """w [.., N, K] e4m3 x its scale grid, as dtype (the XLA path's weight)."""
    n, k = w.shape[-2:]
    s = scale.astype(jnp.float32)
    s = jnp.repeat(jnp.repeat(s, block[0], axis=-2)[..., :n, :], block[1], axis=-1)[..., :k]
    return (w.astype(jnp.float32) * s).astype(dtype)


def _reference(x, w3, s3, ids, block):
    """XLA's ops: the dequantized weight in float32, float32 sums, one rounding."""
    wd = dequantize(w3, s3, block)
    xf = x.astype(jnp.float32)
    if ids is None:
        y = jnp.dot(xf, wd[0].T, precision=jax.lax.Precision.HIGHEST)
    else:
        y = jnp.einsum("mk,mnk->mn", xf, jnp.take(wd, ids, axis=0, mode="clip"),
                       precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)


def _kernel(x, w3, s3, ids, block, lanes, ksplit, pdl, prefetch):
    x, w3, s3, ids = _jax_compat.same_varying(x, w3, s3, ids)
    like = jax.typeof(x)
    call = jax.ffi.ffi_call(_ext.TARGETS.fp8_matvec, like.update(shape=(x.shape[0], w3.shape[1])))
    return call(x, w3, s3, ids, block_n=np.int64(block[0]), block_k=np.int64(block[1]),
                lanes=np.int64(lanes), ksplit=np.int64(ksplit), pdl=np.int64(pdl),
                prefetch=np.int64(prefetch))


def _check(x, w, scale, ids, block):
    name = "sifar_jax.fp8_matvec"
    if x.ndim != 2:
        raise ValueError(f"{name}: x must be [M, K], got shape {x.shape}")
    if jnp.dtype(x.dtype) not in X_DTYPES:
        raise TypeError(f"{name}: x must be one of {[d.name for d in X_DTYPES]}, got {x.dtype}")
    if jnp.dtype(w.dtype) != W_DTYPE:
        raise TypeError(f"{name}: w must be float8_e4m3fn, got {w.dtype}")
    want = 2 if ids is None else 3
    if w.ndim != want:
        raise ValueError(f"{name}: w must be {'[N, K]' if ids is None else '[E, N, K] (with ids)'}"
                         f", got shape {w.shape}")
    n, k = w.shape[-2:]
    if k != x.shape[1]:
        raise ValueError(f"{name}: x [M, K={x.shape[1]}] does not match w [.., N, K={k}] "
                         f"(w shape {w.shape}; w is [out, in], the checkpoint's layout)")
    if k % CHUNK:
        raise ValueError(f"{name}: K={k} must be a multiple of {CHUNK}")
    if ids is not None and (ids.shape != x.shape[:1] or not jnp.issubdtype(ids.dtype, jnp.integer)):
        raise ValueError(f"{name}: ids must be integers of shape [M={x.shape[0]}], got "
                         f"{ids.dtype} {ids.shape}")
    bn, bk = block
    if bn < 1 or bk < 1 or (bk < k and bk % CHUNK):
        raise ValueError(f"{name}: block={block}: block_n >= 1 and block_k a multiple of {CHUNK} "
                         f"(or >= K={k})")
    grid = (math.ceil(n / bn), math.ceil(k / bk))
    lead = () if ids is None else w.shape[:1]
    if tuple(scale.shape) != lead + grid and not (grid == (1, 1) and scale.size == math.prod(lead)):
        raise ValueError(f"{name}: scale {scale.shape} is not {lead + grid} (w {w.shape} in "
                         f"blocks of {block})")
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise TypeError(f"{name}: the scale must be floating (float32; bfloat16 and float16 are "
                        f"widened exactly, float64 rounded to float32), got {scale.dtype}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{name}: M={x.shape[0]} rows (at most {MAX_ROWS})")


def _check_plan(plan) -> None:
    ok = (isinstance(plan, (tuple, list)) and len(plan) == 2
          and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in plan))
    if not ok or plan[0] not in LANES or plan[1] not in KSPLITS:
        raise ValueError(f"sifar_jax.fp8_matvec: plan={plan!r}: a pair (lanes, ksplit) of ints, "
                         f"lanes in {LANES}, ksplit in {KSPLITS}")


def fp8_matvec(x: jax.Array, w: jax.Array, scale: jax.Array, ids: jax.Array | None = None, *,
               block: tuple[int, int] | None = None, impl: str = "auto",
               plan: tuple[int, int] | None = None, pdl: bool = True,
               prefetch: bool = False) -> jax.Array:
    """y[m, n] = sum_k x[m, k] * w[ids[m], n, k] * scale[.., n // block_n, k // block_k].

    x [M, K] float32/bfloat16/float16. w [N, K] float8_e4m3fn (ids None) or [E, N, K] with ids
    [M] (clipped to [0, E)). scale float32 [ceil(N/bn), ceil(K/bk)] ([E, ...] with ids; bfloat16
    and float16 are widened exactly, float64 rounded to float32, other dtypes refused); block
    (bn, bk) defaults to what the scale's shape says (per tensor / per channel). Returns [M, N]
    in x's dtype.

    impl: "auto" runs the kernel on CUDA GPUs and XLA's ops (dequantize and dot) elsewhere;
    "kernel" the kernel on every platform (the CPU handler repeats its order); "xla" XLA's ops.
    plan: (lanes, ksplit) (default fp8_matvec_plan). pdl: launch as a programmatic dependent
    launch; prefetch: ask L2 for the block's weights before waiting for the previous kernel.
    """
    if impl not in IMPLS:
        raise ValueError(f"sifar_jax.fp8_matvec: impl must be one of {IMPLS}, got {impl!r}")
    if block is None:
        block = scale_block(w.shape, scale.shape)
    block = (int(block[0]), int(block[1]))
    _check(x, w, scale, ids, block)
    n, k = w.shape[-2:]
    w3 = w.reshape((-1, n, k))
    grid = (math.ceil(n / block[0]), math.ceil(k / block[1]))
    s3 = scale.astype(jnp.float32).reshape((w3.shape[0],) + grid)
    if plan is not None:  # checked on every impl: a plan XLA's path ignores is still wrong
        _check_plan(plan)
    if impl == "xla":
        return _reference(x, w3, s3, ids, block)
    if plan is None:
        plan = fp8_matvec_plan(x.shape[0], k, n, ids is not None and w3.shape[0] > 1)
    lanes, ksplit = plan
    idx = jnp.zeros(x.shape[:1], jnp.int32) if ids is None else ids.astype(jnp.int32)
    run = lambda: _kernel(x, w3, s3, idx, block, lanes, ksplit, pdl, prefetch)  # noqa: E731
    if impl == "kernel":
        return run()
    if "cuda" not in _ext.PLATFORMS:
        return _reference(x, w3, s3, ids, block)
    return jax.lax.platform_dependent(cuda=run, default=lambda: _reference(x, w3, s3, ids, block))
