"""Row-parallel projections for auto-sharded programs (jit + named shardings).

Most JAX LLM code has no shard_map of its own: it runs under `jax.jit` with
named shardings, and XLA inserts the all-reduce after each row-parallel
matmul, where no `psum` call exists for sifar to replace. `row_parallel(x, w)`
is that matmul with the all-reduce made explicit: a change at that call site
only (`x @ w` -> `sifar_jax.row_parallel(x, w)`). Inside, a shard_map over the
tensor-parallel axis multiplies this rank's slices (x's last dimension and w's
first, split over the axis) and sums the partial products with `sifar_psum`;
XLA reshards the operands first where they are not split that way.

Other mesh axes. Axes of one device need nothing. Explicit axes
(`jax.sharding.AxisType.Explicit`, under `jax.sharding.set_mesh`) keep the
operands' own shardings: the shard_map is manual over every axis, with x's
and w's specs as their types say. Other auto axes of more than one device are
left to the compiler (shard_map manual over the tp axis only): XLA would have
to replicate a custom call across them, so sifar_psum hands the sum to
lax.psum there (with its one-time warning; sifar_jax.unsupported's rules).

Both functions compose with jax.grad: row_parallel as sifar_psum does (the
transpose is lax.psum's); row_parallel_add_rmsnorm through a custom VJP whose
backward pass is the unfused composition's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import _jax_compat, algorithms, plan
from ._jax_compat import lax_psum
from .fused import psum_add_rmsnorm, rms_norm
from .psum import sifar_psum


def _mesh(mesh):
    if mesh is not None:
        return mesh
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError("sifar_jax.row_parallel: no mesh: pass mesh=, or call it under "
                         "jax.sharding.set_mesh(mesh)")
    return mesh


def _specs(x, w, axis, mesh):
    """(x's spec, w's spec, the product's spec, the axes the shard_map is manual over)."""
    axes = plan.axes_of(axis)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"sifar_jax.row_parallel: the mesh has no axis {missing[0]!r} "
                         f"(its axes: {tuple(mesh.axis_names)})")
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"sifar_jax.row_parallel: x [..., K] and w [K, N] expected, got "
                         f"{x.shape} and {w.shape}")
    others = [a for a in mesh.axis_names if a not in axes and mesh.shape[a] > 1]
    lead_x, out_w = [None] * (x.ndim - 1), None
    manual = None  # every axis
    sx, sw = _jax_compat.explicit_spec(x), _jax_compat.explicit_spec(w)
    if sx is not None and sw is not None:  # explicit axes: the types' own shardings
        lead_x, out_w = list(sx[:-1]), sw[1]
    elif others:
        manual = frozenset(axes)  # auto axes: left to the compiler
    return (P(*lead_x, axis), P(axis, out_w), P(*lead_x, out_w), manual)


def _shard_map(body, mesh, in_specs, out_specs, manual):
    kw = {} if manual is None else {"axis_names": manual}
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw)


def row_parallel(x, w, axis="tp", *, mesh=None, algorithm: str = algorithms.AUTO):
    """`x @ w` for a row-parallel projection, its all-reduce over `axis` on SiFAR.

    x: [..., K] and w: [K, N], K split over the mesh axis `axis` (a name, or a
    tuple of names: K split over their product; XLA reshards the operands to
    that where they are not). Returns the reduced product [..., N],
    replicated over `axis`, equal to `x @ w` up to the sum's rounding (sifar
    adds the partial products in rank order in float32 and rounds once).
    mesh: the mesh (default: the one set with jax.sharding.set_mesh). Call it
    inside jax.jit after sifar_jax.init(mesh). algorithm: as sifar_psum's.
    """
    x, w = jnp.asarray(x), jnp.asarray(w)
    reduce = functools.partial(sifar_psum, algorithm=algorithm)
    return _project(x, w, axis, _mesh(mesh), reduce)


def _project(x, w, axis: str, mesh, reduce):
    sx, sw, out, manual = _specs(x, w, axis, mesh)

    def body(xl, wl):
        return reduce(jnp.matmul(xl, wl), axis)

    return _shard_map(body, mesh, (sx, sw), out, manual)(x, w)


def _fused_forward(axis, eps, algorithm, mesh, x, w, residual, weight):
    sx, sw, out, manual = _specs(x, w, axis, mesh)

    def body(xl, wl, r, g):
        return psum_add_rmsnorm(jnp.matmul(xl, wl), r, g, axis, eps=eps, algorithm=algorithm)

    return _shard_map(body, mesh, (sx, sw, out, P(out[-1])), (out, out), manual)(
        x, w, residual, weight)


def _unfused(axis, eps, mesh, x, w, residual, weight):
    """The composition the fused call computes, by lax.psum (its backward pass)."""
    new_residual = residual + _project(x, w, axis, mesh, lax_psum)
    return rms_norm(new_residual, weight, eps), new_residual


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fused(axis, eps, algorithm, mesh, x, w, residual, weight):
    return _fused_forward(axis, eps, algorithm, mesh, x, w, residual, weight)


def _fused_fwd(axis, eps, algorithm, mesh, x, w, residual, weight):
    out = _fused_forward(axis, eps, algorithm, mesh, x, w, residual, weight)
    return out, (x, w, residual, weight)


def _fused_bwd(axis, eps, algorithm, mesh, saved, cts):
    _, vjp = jax.vjp(functools.partial(_unfused, axis, eps, mesh), *saved)
    return vjp(cts)


_fused.defvjp(_fused_fwd, _fused_bwd)


def row_parallel_add_rmsnorm(x, w, residual, weight, axis="tp", *, eps: float,
                             mesh=None, algorithm: str = algorithms.AUTO):
    """`residual + row_parallel(x, w)` and the RMSNorm of that, in one call.

    Returns (normed, new_residual) as `sifar_jax.psum_add_rmsnorm` computes them
    (its rounding points; the fused kernel where it can run, the unfused
    composition where not), for x [..., K] and w [K, N] split over `axis` as in
    row_parallel, residual [..., N] and the norm's weight [N] replicated over it.
    """
    x, w = jnp.asarray(x), jnp.asarray(w)
    residual, weight = jnp.asarray(residual), jnp.asarray(weight)
    return _fused(axis, float(eps), algorithm, _mesh(mesh), x, w, residual, weight)
