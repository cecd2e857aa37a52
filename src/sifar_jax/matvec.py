"""`matvec`: a decoding step's batch-1 matrix-vector products, y[m] = x[m] @ w[ids[m]].

At batch 1 a decoder's projections multiply one row by a weight, and an MoE layer multiplies a
few rows each by one chosen expert's weight. XLA:GPU streams such weights below the memory's
speed (a one-row dot becomes a multiply + reduce fusion, or a GEMM tuned for more rows), and
the MoE form first copies the chosen experts' slices (a gather) before its dots. `matvec` reads
every weight byte once, where it lies, in a split-K streaming kernel of our own
(ffi/matvec/): one call for a dense projection (`ids=None`) or for all of an MoE layer's chosen
experts. Measured on one H200 (docs/performance.md): an MoE layer's experts ~1.6x faster than
gathering them for XLA's dots; a dense projection slower than XLA's own dot (2.3 against 3.0
TB/s), so the Llama decoder keeps XLA's and the Qwen3-MoE decoder uses this.

Sums are float32 with one rounding to x's dtype at the end, in a fixed order (the CPU handler
runs the same order: the same bits on both backends). Not differentiable (a decoding kernel).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _ext, _jax_compat

__all__ = ["matvec", "matvec_plan"]

DTYPES = tuple(jnp.dtype(n) for n in ("float32", "bfloat16", "float16"))
IMPLS = ("auto", "kernel", "xla")
# ffi/matvec/matvec.h's work split: blocks of THREADS threads in row groups of `lanes` threads,
# each thread one 16-byte vector of a weight row.
THREADS = 256
VEC_BYTES = 16
LANES = (256, 128, 64, 32)  # widest first: longer contiguous reads of each weight row
# Blocks a call aims for: enough to keep an H100/H200's 132 SMs streaming.
TARGET_BLOCKS = 4 * 132
MIN_ROWS_PER_GROUP = 16  # rows each row group of a split reads at least (loads in flight)
# The splits' float32 partial sums are written and read once: at most this share of the weight.
MAX_PARTIAL_SHARE = 0.03


def matvec_plan(m: int, k: int, n: int, itemsize: int,
                target_blocks: int | None = None) -> tuple[int, int]:
    """(lanes, splits) of the kernel's grid for x [m, k] @ w [k, n]: the widest row group whose
    tiles divide n and whose grid reaches target_blocks blocks (None: TARGET_BLOCKS, read
    when called), and the split of K that reaches it, within MIN_ROWS_PER_GROUP rows per group
    and MAX_PARTIAL_SHARE of the weight's bytes in partial sums."""
    target = TARGET_BLOCKS if target_blocks is None else target_blocks
    vecs = max(1, n // (VEC_BYTES // itemsize))  # 16-byte vectors per weight row
    max_share = max(1, int(MAX_PARTIAL_SHARE * k * itemsize / 4))
    best = None
    for lanes in LANES:
        if vecs % lanes and lanes != LANES[-1]:
            continue  # a partly empty tile: leave it to narrower groups
        tiles = math.ceil(vecs / lanes)
        groups = THREADS // lanes
        most = max(1, min(k // (groups * MIN_ROWS_PER_GROUP), max_share, 65535))
        splits = max(1, min(most, math.ceil(target / (tiles * m))))
        blocks = tiles * m * splits
        if blocks >= target:
            return lanes, splits
        if best is None or blocks > best[0]:
            best = (blocks, lanes, splits)
    return best[1], best[2]


def _reference(x, w3, ids):
    """The same product with XLA's ops (float32 sums, one rounding), w3 [E, K, N] -> [M, N]."""
    if ids is None:
        return jnp.dot(x, w3[0], preferred_element_type=jnp.float32).astype(x.dtype)
    ws = jnp.take(w3, ids, axis=0, mode="clip")
    return jnp.einsum("mk,mkn->mn", x, ws, preferred_element_type=jnp.float32).astype(x.dtype)


def _kernel(x, w3, ids, lanes: int, splits: int):
    m, n = x.shape[0], w3.shape[2]
    # Under shard_map the operands get one varying type and the results that type.
    x, w3, ids = _jax_compat.same_varying(x, w3, ids)
    like = jax.typeof(x)
    ws_shape = (m, splits, n) if splits > 1 else (1,)
    call = jax.ffi.ffi_call(
        _ext.TARGETS.matvec,
        (like.update(shape=(m, n)), like.update(shape=ws_shape, dtype=jnp.dtype(jnp.float32))),
    )
    y, _ = call(x, w3, ids, splits=np.int64(splits), lanes=np.int64(lanes))
    return y


def _check(x, w, ids):
    if x.ndim != 2:
        raise ValueError(f"sifar_jax.matvec: x must be [M, K], got shape {x.shape}")
    lead = 0 if ids is None else 1
    if w.ndim < lead + 2:
        raise ValueError(f"sifar_jax.matvec: w must be [{'E, ' if lead else ''}K, N, ...], "
                         f"got shape {w.shape}")
    if w.shape[lead] != x.shape[1]:
        hint = ("; a stack of weights [E, K, N] needs ids" if ids is None and w.ndim >= 3
                and w.shape[1] == x.shape[1] else "")
        raise ValueError(f"sifar_jax.matvec: x [M, K={x.shape[1]}] does not match w's K "
                         f"{w.shape[lead]} (w shape {w.shape}){hint}")
    if ids is not None:
        if ids.shape != x.shape[:1] or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"sifar_jax.matvec: ids must be integers of shape [M={x.shape[0]}], "
                             f"got {ids.dtype} {ids.shape}")
    if jnp.dtype(x.dtype) != jnp.dtype(w.dtype):
        raise TypeError(f"sifar_jax.matvec: x and w must have one dtype, got {x.dtype} and "
                        f"{w.dtype}")


def _kernel_refusal(x, n: int) -> str | None:
    dt = jnp.dtype(x.dtype)
    if dt not in DTYPES:
        return f"dtype {dt} (the kernel runs {', '.join(d.name for d in DTYPES)})"
    if n % (VEC_BYTES // dt.itemsize):
        return f"N={n} is not a multiple of {VEC_BYTES // dt.itemsize} elements (16 bytes)"
    if x.shape[0] > 65535:
        return f"M={x.shape[0]} rows (at most 65535)"
    return None


def matvec(x: jax.Array, w: jax.Array, ids: jax.Array | None = None, *, impl: str = "auto",
           plan: tuple[int, int] | None = None) -> jax.Array:
    """y[m] = x[m] @ w[ids[m]] with float32 sums, rounded once to x's dtype.

    x: [M, K] (M small: a decoding step's rows). w: [K, N...] when ids is None (one weight, a
    dense projection), else [E, K, N...] (a stack: an MoE layer's experts) and ids [M] picks
    each row's matrix (clipped to [0, E)). Trailing dims of w after N are flattened and come
    back in y: y has shape [M, N...].

    impl: "auto" runs the kernel on CUDA GPUs and XLA's ops elsewhere; "kernel" runs the kernel
    on every platform (the CPU handler runs its summation order; raises where it cannot run);
    "xla" always XLA's ops. plan: the kernel's (lanes, splits) (default matvec_plan).
    """
    if impl not in IMPLS:
        raise ValueError(f"sifar_jax.matvec: impl must be one of {IMPLS}, got {impl!r}")
    _check(x, w, ids)
    lead = 0 if ids is None else 1
    out_dims = w.shape[lead + 1:]
    n = math.prod(out_dims)
    w3 = w.reshape((1 if ids is None else w.shape[0], x.shape[1], n))
    why = _kernel_refusal(x, n)
    if impl == "xla" or (why is not None and impl == "auto"):
        return _reference(x, w3, ids).reshape(x.shape[:1] + out_dims)
    if why is not None:
        raise TypeError(f"sifar_jax.matvec: the kernel cannot run {why}; use impl='auto'")
    if plan is None:
        plan = matvec_plan(x.shape[0], x.shape[1], n, jnp.dtype(x.dtype).itemsize)
    lanes, splits = plan
    if lanes not in LANES or not 1 <= splits <= min(x.shape[1], 65535):
        raise ValueError(f"sifar_jax.matvec: plan={plan}: lanes must be one of {LANES} and "
                         f"splits in [1, K={x.shape[1]}]")
    idx = (jnp.zeros(x.shape[:1], jnp.int32) if ids is None else ids.astype(jnp.int32))
    if impl == "kernel":
        y = _kernel(x, w3, idx, lanes, splits)
    elif "cuda" not in _ext.PLATFORMS:  # a build without the CUDA backend
        y = _reference(x, w3, ids)
    else:  # the platform is known only when lowering
        y = jax.lax.platform_dependent(cuda=lambda: _kernel(x, w3, idx, lanes, splits),
                                       default=lambda: _reference(x, w3, ids))
    return y.reshape(x.shape[:1] + out_dims)
