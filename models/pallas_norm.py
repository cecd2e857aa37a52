"""The residual add and RMSNorm of a layer's tail as one Pallas (Triton) kernel.

XLA:GPU runs `new = residual + x; rms_norm(new)` at batch 1 as three kernels (the add, the
float32 sum of squares, the scale), ~4.1 us at Llama-8B's hidden 4096 on one H200, 64 times per
step. This is one program per row: the row's residual, partial and gain loaded at once, the same
roundings as models.tp.rms_norm (the sum in float32, the scaled row rounded to the activation
dtype before the gain).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def supported(hidden: int) -> bool:
    """One block per row: Triton's blocks are powers of two."""
    return hidden >= 16 and hidden & (hidden - 1) == 0


@functools.partial(jax.jit, static_argnames=("eps",))
def add_rmsnorm(x: jax.Array, residual: jax.Array, weight: jax.Array, eps: float):
    """(rms_norm(residual + x) * weight, residual + x) for x, residual [..., H] (H a power of
    two), weight [H]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    shape, h = x.shape, x.shape[-1]
    rows = x.reshape(-1, h)
    res = residual.reshape(-1, h)

    def kernel(x_ref, r_ref, w_ref, normed_ref, new_ref):
        new = (r_ref[...].astype(jnp.float32) + x_ref[...].astype(jnp.float32)).astype(x.dtype)
        nf = new.astype(jnp.float32)
        scale = jax.lax.rsqrt(jnp.sum(nf * nf, axis=-1, keepdims=True) / h + eps)
        normed = (nf * scale).astype(x.dtype)
        new_ref[...] = new
        normed_ref[...] = (w_ref[...][None, :] * normed).astype(x.dtype)

    row = pl.BlockSpec((1, h), lambda i: (i, 0))
    normed, new = pl.pallas_call(
        kernel, grid=(rows.shape[0],),
        in_specs=[row, row, pl.BlockSpec((h,), lambda i: (0,))],
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct(rows.shape, x.dtype)] * 2,
        compiler_params=plgpu.CompilerParams(num_warps=8 if h >= 4096 else 4),
        interpret=jax.default_backend() != "gpu",
        name="add_rmsnorm")(rows, res, weight)
    return normed.reshape(shape), new.reshape(shape)
