"""`psum_add_rmsnorm`: the all-reduce, the residual add and RMSNorm in one call.

A tensor-parallel decoder layer ends with `residual + psum(partial)` followed by
the next RMSNorm. Fused, the all-reduce's epilogue adds the residual and
normalises while the row is still in registers (on GPUs, a row spread over a
thread-block cluster), so the two elementwise kernels after every all-reduce
disappear. It is an all-reduce call of the same communicator as `sifar_psum`
(the same epochs, slots, chain tags and ordering), only with another epilogue.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _ext, _jax_compat, algorithms, ordering, psum
from ._jax_compat import lax_psum
from .plan import Fallback, Plan, plan_array, quiet, too_large, warn_once

__all__ = ["psum_add_rmsnorm"]  # the fused ops (sifar_jax exports them)

FLOAT_DTYPES = tuple(jnp.dtype(n) for n in ("float32", "bfloat16", "float16"))
# How much of `prefetch` goes to L2 by default: about what the GPU's memory
# moves while a fused call waits for its peers (a few microseconds), well
# under an H100/H200's 50 MB L2 (chosen by a sweep on 2x H200).
DEFAULT_PREFETCH_BYTES = 16 << 20
_API = "psum_add_rmsnorm"
# What runs where the fused kernel cannot (Fallback.warn names it).
UNFUSED = "the unfused composition (sifar_psum, add, RMSNorm)"


def rms_norm(x, weight, eps: float):
    """models.llama.RMSNorm's formula: float32 statistics, the scaled value
    rounded to x's dtype, then multiplied by the weight in that dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def _unfused(x, residual, weight, eps, allreduce):
    new_residual = residual + allreduce(x)
    # The norm sees the rounded sum, as the fused kernel does: without the
    # barrier XLA may feed it the unrounded float32 sum (its excess-precision
    # rewrite), and the fallback would differ from the fused call.
    return rms_norm(jax.lax.optimization_barrier(new_residual), weight, eps), new_residual


def _check_operands(x, residual, weight) -> None:
    """User errors, raised at trace time whatever the algorithm."""
    if x.ndim < 1:
        raise ValueError(f"sifar_jax.{_API}: x must have a hidden dimension, got shape {x.shape}")
    if residual.shape != x.shape:
        raise ValueError(
            f"sifar_jax.{_API}: residual has shape {residual.shape}, x has {x.shape}; "
            f"they must be equal"
        )
    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"sifar_jax.{_API}: weight must have shape {x.shape[-1:]} (the hidden size), "
            f"got {weight.shape}"
        )
    dtypes = {jnp.dtype(a.dtype) for a in (x, residual, weight)}
    if len(dtypes) != 1:
        raise TypeError(
            f"sifar_jax.{_API}: x, residual and weight must have one dtype, got "
            f"{x.dtype}, {residual.dtype} and {weight.dtype}"
        )
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(
            f"sifar_jax.{_API}: dtype {x.dtype} is not supported; use one of "
            f"{', '.join(d.name for d in FLOAT_DTYPES)}"
        )


def _layout_refusal(x) -> str | None:
    """Why the fused kernel cannot hold x's rows (ffi/fused/fused.h, FusedRowBlocks)."""
    row_bytes = x.shape[-1] * jnp.dtype(x.dtype).itemsize
    if _ext.lib.fused_row_blocks(row_bytes) > 0:
        return None
    limit = int(_ext.lib.fused_max_row_bytes())
    return (
        f"a row of {x.shape[-1]} {jnp.dtype(x.dtype).name} elements ({row_bytes} bytes) is not a "
        f"layout the fused kernel supports (whole 16-byte lines, at most {limit // 1024} KB once "
        f"padded to a power of two of 8-byte lines)"
    )


def fused_payload_bytes(x) -> int:
    """The payload the fused kernel moves for x: every row padded to its share
    (ffi/fused/fused.h, FusedPaddedRowBytes: a power of two of 8-byte lines)."""
    row_bytes = x.shape[-1] * jnp.dtype(x.dtype).itemsize
    rows = math.prod(x.shape[:-1])
    return rows * int(_ext.lib.fused_padded_row_bytes(row_bytes))


def _result_types(x, residual, weight, axis_name, flat):
    """(normed, new_residual) as flat arrays typed exactly as `residual +
    lax.psum(x)` and its norm would be: invariant over axis_name unless the
    residual or the weight vary over it."""
    def composed(x, residual, weight):
        return _unfused(x, residual, weight, 1.0, lambda v: lax_psum(v, axis_name))

    like = jax.typeof(flat)
    return [_jax_compat.with_varying(like, _jax_compat.varying_axes(t))
            for t in jax.eval_shape(composed, x, residual, weight)]


def _check_prefetch(prefetch, prefetch_bytes) -> None:
    if prefetch_bytes is not None and (not isinstance(prefetch_bytes, (int, np.integer))
                                       or isinstance(prefetch_bytes, bool) or prefetch_bytes < 0):
        raise ValueError(f"sifar_jax.{_API}: prefetch_bytes must be a non-negative int, got "
                         f"{prefetch_bytes!r}")
    if prefetch is not None and not hasattr(prefetch, "dtype"):
        raise TypeError(f"sifar_jax.{_API}: prefetch must be an array (the weight the next "
                        f"operation reads), got {type(prefetch).__name__}")


def prefetch_operand(prefetch, prefetch_bytes, like) -> tuple[list, int]:
    """([the operand], bytes) to prefetch, or ([], 0): prefetch_bytes (default
    DEFAULT_PREFETCH_BYTES) clamped to the operand's size, rounded down to 16
    bytes (the bulk prefetch's unit). Typed with like's varying axes."""
    if prefetch_bytes is None:
        prefetch_bytes = DEFAULT_PREFETCH_BYTES
    if prefetch is None or prefetch_bytes == 0:
        return [], 0
    prefetch = jnp.asarray(prefetch)
    nbytes = min(int(prefetch_bytes), prefetch.size * jnp.dtype(prefetch.dtype).itemsize) // 16 * 16
    if nbytes == 0:
        return [], 0
    # Cast to the call's varying axes, never widening them (that would change
    # the results' type): an operand varying over other axes is left out.
    vma = _jax_compat.varying_axes(jax.typeof(prefetch))
    union = _jax_compat.varying_axes(jax.typeof(like))
    if not vma <= union:
        warn_once(f"sifar_jax.{_API}: prefetch varies over {sorted(vma - union)}, which x, "
                  f"residual and weight do not; not prefetched", stacklevel=3)
        return [], 0
    if vma != union:
        prefetch = jax.lax.pcast(prefetch, tuple(sorted(union - vma)), to="varying")
    return [prefetch], nbytes


def _plan(x, axis_name, algorithm: str) -> Plan | Fallback:
    """The fused call's plan, or why the fused kernel cannot run it: another
    algorithm, rows it cannot lay out, or sifar_psum's own reasons (a named
    algorithm raises for those, as sifar_psum does)."""
    if algorithm not in (algorithms.AUTO, algorithms.SIFAR):
        return Fallback(f"the fused kernel runs the sifar algorithm, not {algorithm!r}")
    why = _layout_refusal(x)
    if why is not None:
        return Fallback(why)
    plan = plan_array(x, axis_name, algorithm, _API)
    if isinstance(plan, Fallback):
        return plan
    nbytes = fused_payload_bytes(x)
    if nbytes > plan.slot:  # only the fusion cannot run: sifar_psum can (quiet under "auto")
        why = f"rows padded to whole powers of two of lines: {too_large(nbytes, plan)}"
        return Fallback(why) if plan.explicit else quiet(why, instead=UNFUSED, api=_API)
    # The fused kernel is the sifar all-reduce (whatever auto's table would
    # pick for the plain all-reduce of this size).
    return dataclasses.replace(plan, algorithm=algorithms.SIFAR)


def psum_add_rmsnorm(x, residual, weight, axis_name, *, eps: float,
                     algorithm: str = algorithms.AUTO, prefetch=None,
                     prefetch_bytes: int | None = None):
    """`residual + sifar_psum(x, axis_name)`, then RMSNorm of that, in one call.

    x: this rank's partial, [..., hidden]; residual: the same shape and dtype
    (bfloat16, float16 or float32); weight: the norm's [hidden] weight.
    Returns (normed, new_residual):

      new_residual = residual + sifar_psum(x)   bit-identical to the unfused sum
                                                (the rank-order fp32 all-reduce
                                                rounded once, then the add
                                                rounded once)
      normed       = weight * (xf * rsqrt(mean(xf * xf, -1) + eps)).astype(dtype)
                     with xf = float32(new_residual): models.llama.RMSNorm's
                     rounding points. The fp32 sum of squares has its own
                     fixed order (the same bits on every rank), so y may
                     round the other way than in XLA's norm in rare elements
                     (an ulp of y). XLA compiling the unfused model may also
                     feed its norm the unrounded float32 sum (excess
                     precision), which this call does not.

    prefetch (optional): an array the next operation reads, typically the
    next matmul's weight shard. On GPUs the kernel asks the copy engine to
    bring its first `prefetch_bytes` (default DEFAULT_PREFETCH_BYTES, clamped
    to its size) into L2 while the all-reduce waits for its peers, so that
    matmul reads them from L2, not HBM: the wait does useful work. It is never
    read by the call and changes no result; the CPU ignores it, and so does
    the unfused fallback.

    Both are typed like `residual + lax.psum(x, axis_name)` under
    `shard_map(check_vma=True)`. Where the fused kernel cannot run (algorithm
    other than "auto"/"sifar", a payload larger than the slot, rows the kernel
    cannot lay out, no communicator) it computes the unfused composition with
    `sifar_psum(x, axis_name, algorithm=algorithm)`, warning once with the
    reason; sifar_psum's own rules (fallback to lax.psum for "auto") apply.
    """
    x, residual, weight = jnp.asarray(x), jnp.asarray(residual), jnp.asarray(weight)
    _check_operands(x, residual, weight)
    algorithms.validate(algorithm)
    _check_prefetch(prefetch, prefetch_bytes)
    unfused = functools.partial(
        _unfused, x, residual, weight, eps,
        lambda v: psum.sifar_psum(v, axis_name, algorithm=algorithm))
    if x.size == 0:
        return unfused()
    plan = _plan(x, axis_name, algorithm)
    if isinstance(plan, Fallback):
        plan.warn(instead=UNFUSED, api=_API, stacklevel=2)
        return unfused()
    assert plan.algorithm == algorithms.SIFAR and plan.pad == 0, plan

    flat, res = x.reshape(-1), residual.reshape(-1)
    call = jax.ffi.ffi_call(
        _ext.TARGETS.psum_add_rmsnorm,
        _result_types(x, residual, weight, axis_name, flat),
        # As sifar_psum: XLA:CPU keeps the call even when its results are
        # unused, so a failed all-reduce still surfaces.
        has_side_effect=(plan.platform == "cpu"),
    )
    flat, res, weight, *after = _jax_compat.same_varying(flat, res, weight,
                                                         *ordering.operands(flat))
    target, nbytes = prefetch_operand(prefetch, prefetch_bytes, flat)
    operands = [flat, res, weight, *target, *after]
    normed, new_residual = call(*operands, **plan.attrs(), eps=np.float32(eps),
                                prefetch_bytes=np.int64(nbytes))
    ordering.remember(flat, new_residual)
    return normed.reshape(x.shape), new_residual.reshape(x.shape)
