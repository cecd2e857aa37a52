"""A model's parameters to FP8 and back, and to rows and back: quantize_params turns the
projections of a parameter tree (those in its family's `projections` table: the attention's qkv
and o, an MLP's gate_up and down or an MoE's expert stacks, the LM head) into Fp8Weight
(types.py) per output channel; norms, embeddings and an MoE's router stay as they are. to_rows /
from_rows hold the same projections as RowWeight (bf16 rows) and back.

Every function here takes the FAMILY (a ModelFamily: its `projections` and `tp_dims` tables);
the models.<name> versions that also take a config find its family first (registry.py).

Sharded parameters are quantized where they lie: one jit per weight with the Fp8Weight's
shardings as out_shardings (sharding.fp8_spec), so nothing is gathered; a row-parallel weight
(o, down: the contracted dim split) takes its channels' max over the shards (an all-reduce of
one float per channel). The result equals quantizing the unsharded weight bit for bit.
quantize_one does it to one weight by a jit cached per (projection, shape, sharding), the dense
weight deleted once its Fp8Weight exists: random init (random.py) and quantize_params(donate=True)
quantize so, one weight at a time, never holding the model dense and FP8 at once.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from ..core import sharding
from .types import (Fp8Weight, Projection, RowWeight, dequantize, from_row_weight, is_fp8,
                    is_projection, quantize_fp8, to_row_weight)
from .types import is_quantized  # noqa: F401 - part of this module's API (docs/reference.md)

QUANTIZE = ("fp8",)  # the --quantize / quantize= choices (None: the model's dtype)


def check_quantize(quantize: Optional[str]) -> None:
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"quantize must be None or one of {QUANTIZE}, got {quantize!r}")


def quantize_weight(w, proj: Projection) -> Fp8Weight:
    """One einsum-layout weight [*lead, *in, *out] -> Fp8Weight per output channel (an expert
    stack, lead=1: each expert on its own)."""
    if proj.lead == 0:
        return quantize_fp8(w, proj.n_in)
    if proj.lead != 1:
        raise ValueError(f"quantize: {proj.lead} leading stacked dims (at most 1)")
    one = jax.vmap(lambda we: quantize_fp8(we, proj.n_in))(jnp.asarray(w))
    return Fp8Weight(one.q, one.scale, proj.n_in, one.block)


def dequantize_weight(w: Fp8Weight, proj: Projection, dtype) -> jax.Array:
    """The einsum-layout weight of an Fp8Weight as dtype (q x scale, rounded once)."""
    if proj.lead == 0:
        return dequantize(w, dtype)
    return jax.vmap(lambda q, s: dequantize(Fp8Weight(q, s, w.n_in, w.block), dtype))(
        w.q, w.scale)


def _where_they_lie(fn, ws: list, out_specs):
    """fn(ws) under one jit, its results placed as out_specs(abstract results, mesh) says on the
    mesh of ws' sharded jax.Arrays, or fn(ws) as it is (numpy, abstract values, unsharded)."""
    leaves = [w.q if isinstance(w, Fp8Weight) else w.w if isinstance(w, RowWeight) else w
              for w in ws]
    sh = leaves[0].sharding if leaves and isinstance(leaves[0], jax.Array) and not isinstance(
        leaves[0], jax.core.Tracer) else None
    if not isinstance(sh, NamedSharding):
        return fn(ws)
    specs = out_specs(jax.eval_shape(fn, ws), sh.mesh)
    return jax.jit(fn, out_shardings=jax.tree.map(lambda s: NamedSharding(sh.mesh, s), specs))(ws)


def _map_projections(params: dict, family, pick, fn, out_specs, *,
                     each: Optional[Any] = None) -> dict:
    """params with fn(leaves, names) in place of the leaves `pick(name, leaf)` selects, all in
    one jit where they lie (_where_they_lie); each(old, new): one jit per leaf instead, each(old,
    new) called after each (e.g. deleting old: the peak is then one leaf twice)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_projection)
    names = [sharding.leaf_name(path) for path, _ in flat]
    todo = [i for i, (_, w) in enumerate(flat) if pick(names[i], w)]
    groups = [[i] for i in todo] if each is not None else [todo]
    leaves = [w for _, w in flat]
    for group in groups:
        picked = [names[i] for i in group]
        out = _where_they_lie(lambda ws: fn(ws, picked), [flat[i][1] for i in group],
                              lambda res, mesh: out_specs(res, picked, mesh))
        for i, w in zip(group, out):
            leaves[i] = w
            if each is not None:
                each(flat[i][1], w)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _check_local_k(name: str, w, proj: Projection, axis_name: str) -> None:
    """The FP8 GEMV reads a rank's contracted columns in chunks of 16 (sifar_jax.fp8_matvec):
    a weight whose shard leaves fewer is named now, before any trace."""
    from sifar_jax.fp8_matvec import CHUNK

    sh = getattr(w, "sharding", None)
    sharded = isinstance(sh, NamedSharding)
    contracted = slice(proj.lead, proj.lead + proj.n_in)
    k = math.prod((sh.shard_shape(w.shape) if sharded else tuple(w.shape))[contracted])
    if k % CHUNK:
        tp = sh.mesh.shape.get(axis_name, 1) if sharded else 1
        raise ValueError(f"quantize='fp8': {name!r} has {k} contracted columns per rank at "
                         f"TP={tp} (in dims {tuple(w.shape[contracted])}), "
                         f"not a multiple of {CHUNK}, the FP8 GEMV's unit: use a tensor-parallel "
                         f"size that leaves each rank a multiple of {CHUNK}, or keep the model "
                         f"dense")


@functools.lru_cache(maxsize=None)
def _quantize_jit(proj: Projection, shape: tuple, dtype: str, dim: Optional[int],
                  axis_name: str, mesh) -> Any:
    """quantize_weight of one [shape] dtype weight split along dim (None: replicated) on mesh,
    jitted with its Fp8Weight's shardings (sharding.fp8_spec): compiled once per key."""
    fn = lambda w: quantize_weight(w, proj)  # noqa: E731
    res = jax.eval_shape(fn, jax.ShapeDtypeStruct(shape, dtype))
    spec = sharding.fp8_spec(res, dim, proj, axis_name, mesh.shape[axis_name])
    return jax.jit(fn, out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s), spec))


def quantize_one(name: str, w, family, axis_name: str = "tp", *, donate: bool = False):
    """The weight `w` of parameter `name` as an Fp8Weight per output channel where it lies (a
    jit cached per projection, shape and sharding: a model's repeated shapes compile once), or
    w as it is where `name` is not in the family's projections table. donate: w (a jax.Array)
    deleted once its Fp8Weight exists (the peak: one weight dense and FP8 at once)."""
    proj = family.projections.get(name)
    if proj is None:
        return w
    sh, concrete = getattr(w, "sharding", None), not isinstance(w, jax.core.Tracer)
    q = (_quantize_jit(proj, tuple(w.shape), jnp.dtype(w.dtype).name, family.tp_dims.get(name),
                       axis_name, sh.mesh)(w)
         if isinstance(sh, NamedSharding) and concrete else quantize_weight(w, proj))
    if donate and concrete and isinstance(w, jax.Array):
        jax.block_until_ready(q)
        w.delete()
    return q


def quantize_params(params: dict, family, *, lm_head: bool = True,
                    axis_name: str = "tp", donate: bool = False) -> dict:
    """`params` (dense, as random_params or load_hf_checkpoint make them, sharded or not) with
    every projection of the family's table an Fp8Weight per output channel; the LM head too
    unless lm_head=False. Weights already FP8 stay as they are. donate: one weight at a time
    (quantize_one), each dense weight deleted once quantized (the peak: the params and one
    weight's FP8 more); else all in one jit."""
    proj = family.projections

    def pick(name, w):
        if name not in proj or is_fp8(w):
            return False
        if isinstance(w, RowWeight):
            raise ValueError(f"quantize_params: {name!r} is a RowWeight: from_rows first")
        if w.ndim <= proj[name].lead + proj[name].n_in:
            raise ValueError(f"quantize_params: {name!r} has shape {tuple(w.shape)}, not a "
                             f"{family.name} projection's: are these params of another family?")
        if lm_head or name != "lm_head":
            _check_local_k(name, w, proj[name], axis_name)
            return True
        return False

    def specs(res, names, mesh):
        return [sharding.fp8_spec(w, family.tp_dims.get(n), proj[n], axis_name,
                                  mesh.shape[axis_name]) for w, n in zip(res, names)]

    if donate:  # every weight checked (pick) before the first is quantized and deleted
        flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_projection)
        todo = [pick(sharding.leaf_name(path), w) for path, w in flat]
        return jax.tree_util.tree_unflatten(treedef, [
            quantize_one(sharding.leaf_name(path), w, family, axis_name, donate=True) if do
            else w for (path, w), do in zip(flat, todo)])
    return _map_projections(params, family, pick,
                            lambda ws, names: [quantize_weight(w, proj[n]) for w, n in
                                               zip(ws, names)], specs)


def to_rows(params: dict, family, *, axis_name: str = "tp",
            donate: bool = False) -> dict:
    """`params` (dense, sharded or not) with every projection of the family's table, the LM
    head included, a RowWeight (an MoE's expert stack too, its expert dim kept first: gate_up
    [E, 2, I, H], down [E, H, I]): the same values stored output-major, the [N, K] rows the
    persistent step (DecodeOptions(step="persistent")) streams; the XLA step and prefill read
    the same arrays (tp.project). Weights already RowWeight stay as they are; an Fp8Weight
    raises. donate: one jit per weight, each einsum-layout weight deleted once its rows exist
    (the peak: the params and one weight more)."""
    proj = family.projections

    def pick(name, w):
        if name not in proj or isinstance(w, RowWeight):
            return False
        if is_fp8(w):
            raise ValueError(f"to_rows: {name!r} is an Fp8Weight, already in the kernels' "
                             f"output-major layout")
        if w.ndim <= proj[name].lead + proj[name].n_in:
            raise ValueError(f"to_rows: {name!r} has shape {tuple(w.shape)}, not a "
                             f"{family.name} projection's: are these params of another family?")
        return True

    def specs(res, names, mesh):
        return [sharding.row_spec(w, family.tp_dims.get(n), proj[n], axis_name)
                for w, n in zip(res, names)]

    def delete(old, new):  # donate: each einsum-layout weight goes once its rows exist
        if isinstance(old, jax.Array) and not isinstance(old, jax.core.Tracer):
            jax.block_until_ready(new)
            old.delete()

    return _map_projections(params, family, pick,
                            lambda ws, names: [to_row_weight(w, proj[n].n_in, proj[n].lead)
                                               for w, n in zip(ws, names)], specs,
                            each=delete if donate else None)


def from_rows(params: dict, family, axis_name: str = "tp") -> dict:
    """Every RowWeight of `params` back to its einsum-layout weight, sharded as the family's
    dense parameters are (to_rows' inverse, bit for bit)."""

    def specs(res, names, mesh):
        return [sharding.spec_for(n, len(w.shape), family.tp_dims, axis_name)
                for w, n in zip(res, names)]

    return _map_projections(params, family, lambda name, w: isinstance(w, RowWeight),
                            lambda ws, names: [from_row_weight(w, family.projections[n].lead)
                                               for w, n in zip(ws, names)], specs)


def dequantize_params(params: dict, family, dtype: Any = None, axis_name: str = "tp") -> dict:
    """Every Fp8Weight of `params` back to its einsum-layout weight as dtype (default:
    bfloat16; models.dequantize_params given a config: the config's dtype), sharded as the
    family's dense parameters are."""
    dt = jnp.dtype(dtype or "bfloat16")

    def specs(res, names, mesh):
        return [sharding.spec_for(n, len(w.shape), family.tp_dims, axis_name)
                for w, n in zip(res, names)]

    return _map_projections(
        params, family, lambda name, w: is_fp8(w),
        lambda ws, names: [dequantize_weight(w, family.projections[n], dt) for w, n in
                           zip(ws, names)], specs)
