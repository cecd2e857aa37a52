"""Placing a parameter tree whose projections are Fp8Weight leaves (fp8_load.py) on the mesh: each
Fp8Weight's q from the family's builders, shard by shard (the einsum layout's chunk along its TP
dim, transposed to q's [*lead, *out, *in]), its scale grid from the host (small), everything
else as checkpoint.load_sharded places it.

The specs of the Fp8Weight leaves are sharding.param_specs' where it takes Fp8Weight leaves
(sharding.fp8_spec); `fp8_specs` below is the same rule for a tree without it: q split where its
einsum weight is, the scale split likewise where its block grid lines up with the shards, else
whole on every rank.
"""

from __future__ import annotations

import inspect
import math

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from . import checkpoint, sharding
from .quant import Fp8Weight


def path_keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def _is_fp8(x) -> bool:
    return isinstance(x, Fp8Weight)


def q_perm(ndim: int, n_in: int, lead: int) -> tuple[int, ...]:
    """q = transpose(einsum weight, q_perm(...)): [*lead, *in, *out] -> [*lead, *out, *in]."""
    return tuple(range(lead)) + tuple(range(lead + n_in, ndim)) + tuple(range(lead, lead + n_in))


def _scale_dim(w: Fp8Weight, qdim: int, tp: int):
    """The scale's dim split like q's qdim, or None (kept whole)."""
    n_out = w.q.ndim - w.n_in
    if qdim < n_out - 1:
        return qdim
    if qdim == n_out - 1:
        size, grid, block, axis = w.q.shape[qdim], w.scale.shape[n_out - 1], w.block[0], n_out - 1
    else:
        size, grid, block = math.prod(w.q.shape[n_out:]), w.scale.shape[-1], w.block[1]
        axis = w.scale.ndim - 1
    local = size // tp
    return axis if grid > 1 and local % block == 0 and grid == tp * (local // block) else None


def fp8_specs(abstract: dict, tp_dims, table, axis_name: str, tp: int) -> dict:
    """PartitionSpecs of a tree with Fp8Weight leaves (the rule of the module docstring)."""
    def spec(path, leaf):
        name = sharding.leaf_name(path)
        if not _is_fp8(leaf):
            return sharding.spec_for(name, len(leaf.shape), tp_dims, axis_name)
        dim = tp_dims.get(name)
        if dim is None or tp == 1:
            return Fp8Weight(P(), P(), leaf.n_in, leaf.block)
        qdim = q_perm(leaf.q.ndim, *table[name]).index(dim)
        sdim = _scale_dim(leaf, qdim, tp)
        one = lambda n, d: P(*[axis_name if i == d else None for i in range(n)])  # noqa: E731
        return Fp8Weight(one(leaf.q.ndim, qdim), one(leaf.scale.ndim, sdim), leaf.n_in, leaf.block)

    return jax.tree_util.tree_map_with_path(spec, abstract, is_leaf=_is_fp8)


def fp8_shardings(family, abstract: dict, mesh, axis_name: str, table) -> dict:
    """NamedShardings of a tree with Fp8Weight leaves: sharding.param_shardings' own where it
    takes them (a `projections` table), else fp8_specs'."""
    if "projections" in inspect.signature(sharding.param_shardings).parameters:
        from .quant import Projection

        projs = {k: Projection(n_in, lead) for k, (n_in, lead) in table.items()}
        return sharding.param_shardings(abstract, mesh, family.tp_dims, axis_name, projs)
    specs = fp8_specs(abstract, family.tp_dims, table, axis_name, mesh.shape[axis_name])
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def _q_builder(build, perm):
    return lambda lo, hi: np.transpose(np.asarray(build(lo, hi)), perm)


def place(family, layout, mesh, axis_name: str, builders: dict, grids: dict, table) -> dict:
    """The tp layout's parameters read through `builders` (family.hf_builders' tree) and placed,
    the paths in `grids` ({path keys: (scale grid, block)}) as Fp8Weight."""
    _, abstract = family.abstract_model(layout.shapes)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    leaves = []
    for path, sds in flat:
        keys = path_keys(path)
        if keys not in grids:
            leaves.append(sds)
            continue
        grid, block = grids[keys]
        n_in, lead = table[sharding.leaf_name(path)]
        perm = q_perm(len(sds.shape), n_in, lead)
        q = jax.ShapeDtypeStruct(tuple(sds.shape[d] for d in perm), jax.numpy.float8_e4m3fn)
        leaves.append(Fp8Weight(q, jax.ShapeDtypeStruct(grid.shape, np.float32), n_in, block))
    fp8_abstract = treedef.unflatten(leaves)
    shardings = treedef.flatten_up_to(fp8_shardings(family, fp8_abstract, mesh, axis_name, table))
    build = treedef.flatten_up_to(builders)
    out = []
    for (path, sds), leaf, sh, b in zip(flat, leaves, shardings, build):
        where, dim = jax.tree_util.keystr(path), family.tp_dims.get(sharding.leaf_name(path))
        if not _is_fp8(leaf):
            out.append(checkpoint.place_array(where, sds, sh, dim, b))
            continue
        grid = grids[path_keys(path)][0]
        perm = q_perm(len(sds.shape), leaf.n_in, table[sharding.leaf_name(path)][1])
        q = checkpoint.place_array(where, leaf.q, sh.q, None if dim is None else perm.index(dim),
                                   _q_builder(b, perm))
        scale = jax.make_array_from_callback(grid.shape, sh.scale, lambda idx, g=grid: g[idx])
        out.append(Fp8Weight(q, scale, leaf.n_in, leaf.block))
    return treedef.unflatten(out)
