"""`psum_add_rmsnorm_matmul`: the fused all-reduce + add + RMSNorm and the
matmul that reads its normalised row, in one GPU launch.

In batch-1 decoding the matmul after a layer's all-reduce (the next layer's
QKV projection, the MLP's gate/up projection) is bound by reading its weight.
Launched apart, that reading starts only once the all-reduce has heard from
every peer; in one launch the matmul's blocks start loading the weight at
once and wait for the normalised row while those loads are in flight, so the
all-reduce's wait hides behind the weight streaming (ffi/cuda_fused_matmul.cuh).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _ext, _jax_compat, algorithms, ordering, psum
from .fused import _check_operands, _layout_refusal, _same_varying, _unfused, _warn_once, \
    psum_add_rmsnorm

_API = "psum_add_rmsnorm_matmul"


def _matmul(normed, matrix):
    """normed @ matrix over the hidden dimension, fp32 accumulation rounded once
    to normed's dtype (what XLA's dot of two bfloat16 arrays returns)."""
    m2 = matrix.reshape(matrix.shape[0], -1)
    y = jnp.dot(normed, m2, preferred_element_type=jnp.float32).astype(normed.dtype)
    return y.reshape(*normed.shape[:-1], *matrix.shape[1:])


def _check_matrix(x, matrix) -> None:
    if not hasattr(matrix, "dtype"):
        raise TypeError(f"sifar_jax.{_API}: matrix must be an array, got {type(matrix).__name__}")
    if matrix.ndim < 2 or matrix.shape[0] != x.shape[-1]:
        raise ValueError(f"sifar_jax.{_API}: matrix must be [hidden, ...] with hidden = "
                         f"{x.shape[-1]} (x's last dimension), got shape {matrix.shape}")
    if jnp.dtype(matrix.dtype) != jnp.dtype(x.dtype):
        raise TypeError(f"sifar_jax.{_API}: matrix has dtype {matrix.dtype}, x has {x.dtype}; "
                        f"they must be equal")


def _kernel_refusal(x, matrix) -> str | None:
    """Why the one-launch kernel cannot run this call (None: it can)."""
    if x.size != x.shape[-1]:
        return f"the kernel takes one row (batch-1 decoding); x has {x.size // x.shape[-1]} rows"
    per16 = 16 // jnp.dtype(x.dtype).itemsize
    cols = matrix.size // matrix.shape[0]
    if cols % per16:
        return f"the matrix has {cols} columns, not a multiple of {per16} (16 bytes)"
    return _layout_refusal(x)


def psum_add_rmsnorm_matmul(x, residual, weight, matrix, axis_name, *, eps: float,
                            algorithm: str = algorithms.AUTO):
    """`psum_add_rmsnorm(x, residual, weight, axis_name, eps=eps)`, then the
    normalised row times `matrix`, in one call. Returns (y, new_residual):

      new_residual  as psum_add_rmsnorm's (bit-identical to the unfused sum)
      y             normed @ matrix (matrix [hidden, ...], flattened to
                    [hidden, cols] and y shaped x.shape[:-1] + matrix.shape[1:]),
                    fp32 accumulation rounded once to x's dtype, as XLA's dot;
                    the kernel's fixed summation order (the same bits on every
                    run) is not XLA's, so y may differ from `normed @ matrix`
                    in XLA by an ulp of the accumulation in some elements.

    matrix is typically this rank's shard of the next projection (column-
    parallel: it varies over axis_name). One launch on GPUs when x is one row
    (batch-1 decoding) and the matrix's columns are whole 16-byte lines;
    otherwise psum_add_rmsnorm and XLA's dot, warning once with the reason.
    The CPU runs the same order (ffi/cpu_fused.cc).
    """
    x, residual, weight = jnp.asarray(x), jnp.asarray(residual), jnp.asarray(weight)
    _check_operands(x, residual, weight)
    _check_matrix(x, matrix)
    algorithms.validate(algorithm)

    def composed():
        normed, new_residual = psum_add_rmsnorm(x, residual, weight, axis_name, eps=eps,
                                                algorithm=algorithm, prefetch=matrix)
        return _matmul(normed, matrix), new_residual

    if x.size == 0 or algorithm not in (algorithms.AUTO, algorithms.SIFAR):
        return composed()  # psum_add_rmsnorm says why, once
    why = _kernel_refusal(x, matrix)
    if why is not None:
        _warn_once(why)
        return composed()
    plan = psum._plan(x, axis_name, algorithm, _API)
    if isinstance(plan, str):
        _warn_once(plan)
        return composed()
    assert plan.algorithm == algorithms.SIFAR and plan.pad == 0, plan

    flat, res, m2 = x.reshape(-1), residual.reshape(-1), matrix.reshape(matrix.shape[0], -1)

    def reference(flat, res, weight, m2):  # the results' types under check_vma
        normed, new_residual = _unfused(flat, res, weight, 1.0,
                                        lambda v: jax.lax.psum(v, axis_name))
        return normed, new_residual, jnp.dot(normed, m2)

    like = jax.typeof(flat)
    result_types = [_jax_compat.with_varying(like.update(shape=t.shape), _jax_compat.varying_axes(t))
                    for t in jax.eval_shape(reference, flat, res, weight, m2)]
    call = jax.ffi.ffi_call(_ext.TARGET_FUSED_MATMUL, result_types,
                            has_side_effect=(plan.platform == "cpu"))
    flat, res, weight, m2, *after = _same_varying(flat, res, weight, m2, *ordering.operands(flat))
    _normed, new_residual, y = call(flat, res, weight, m2, *after, **plan.attrs(),
                                    eps=np.float32(eps))
    ordering.remember(flat, new_residual)
    return y.reshape(*x.shape[:-1], *matrix.shape[1:]), new_residual.reshape(x.shape)
