"""Placing a parameter tree whose projections are Fp8Weight leaves (fp8_load.py) on the mesh: each
Fp8Weight's q from the family's builders, shard by shard (the einsum layout's chunk along its TP
dim, transposed to q's [*lead, *out, *in]), its scale grid from the host (it is small), both as
the family's param_shardings say for Fp8Weight leaves (sharding.fp8_spec); everything else as
checkpoint.load_sharded places it.
"""

from __future__ import annotations

import jax
import numpy as np

from ..core.sharding import leaf_name
from . import checkpoint
from .types import Fp8Weight


def path_keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def _q_builder(build, perm):
    return lambda lo, hi: np.transpose(np.asarray(build(lo, hi)), perm)


def fp8_abstract(family, abstract: dict, grids: dict) -> dict:
    """The dense abstract tree with the paths in `grids` as Fp8Weights of ShapeDtypeStructs."""
    def one(path, sds):
        if path_keys(path) not in grids:
            return sds
        grid, block = grids[path_keys(path)]
        proj = family.projections[leaf_name(path)]
        perm = proj.q_perm(len(sds.shape))
        q = jax.ShapeDtypeStruct(tuple(sds.shape[d] for d in perm), jax.numpy.float8_e4m3fn)
        return Fp8Weight(q, jax.ShapeDtypeStruct(grid.shape, np.float32), proj.n_in, block)

    return jax.tree_util.tree_map_with_path(one, abstract)


def place(family, layout, mesh, axis_name: str, builders: dict, grids: dict) -> dict:
    """The tp layout's parameters read through `builders` (family.loader.hf_builders' tree) and
    placed, the paths in `grids` ({path keys: (scale grid, block)}) as Fp8Weight."""
    _, abstract = family.abstract_model(layout.shapes)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    leaves = treedef.flatten_up_to(fp8_abstract(family, abstract, grids))
    shardings = treedef.flatten_up_to(family.param_shardings(
        layout, mesh, axis_name, params=treedef.unflatten(leaves)))
    out = []
    for (path, sds), leaf, sh, build in zip(flat, leaves, shardings,
                                            treedef.flatten_up_to(builders)):
        where, dim = jax.tree_util.keystr(path), family.tp_dims.get(leaf_name(path))
        if not isinstance(leaf, Fp8Weight):
            out.append(checkpoint.place_array(where, sds, sh, dim, build))
            continue
        grid = grids[path_keys(path)][0]
        perm = family.projections[leaf_name(path)].q_perm(len(sds.shape))
        q = checkpoint.place_array(where, leaf.q, sh.q, None if dim is None else perm.index(dim),
                                   _q_builder(build, perm))
        scale = jax.make_array_from_callback(grid.shape, sh.scale, lambda idx, g=grid: g[idx])
        out.append(Fp8Weight(q, scale, leaf.n_in, leaf.block))
    return treedef.unflatten(out)
