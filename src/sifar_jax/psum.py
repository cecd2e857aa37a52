"""`sifar_psum`: the drop-in `lax.psum` inside `shard_map`.

The all-reduce is one JAX primitive, `sifar_allreduce`, over one payload per
dtype (a single array as it is, the leaves of a pytree concatenated). Its
lowering flattens and zero-pads the payload to whole 16-byte lines for the FFI
call and slices the result back, so that a jaxpr holds the all-reduce alone,
where lax.psum's holds psum (and its transpose is psum's transpose alone). The
primitive carries lax.psum's type and calculus:

* type: the result varies over the input's varying axes minus the reduced
  ones, exactly as lax.psum's (so shard_map(check_vma=True) refuses a wrong
  out_specs at trace time);
* jvp: the primal by sifar, the tangent by lax.psum; transpose: lax.psum's
  own transpose (grad, vjp, linear_transpose and higher orders are psum's);
* vmap: an elementwise sum batches by summing the stacked payload.

Whatever sifar cannot serve goes to lax.psum: with algorithm="auto" after a
one-time warning naming the reason, with a named algorithm as an error (the
rule of sifar_jax.plan, which also decides which communicator serves a call).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from . import _ext, _jax_compat, algorithms, ordering, size_one
from ._jax_compat import lax_psum
from .plan import (Fallback, Plan, axes_of, axis_size, choose, fallback_or_raise, padded_bytes,
                   payload_choice, route)

ad, batching, mlir = _jax_compat.ad, _jax_compat.batching, _jax_compat.mlir


# ----------------------------------------------------------------- primitive --
allreduce_p = _jax_compat.Primitive("sifar_allreduce")


def allreduce(payload, plan: Plan, repeat: int = 1):
    """One all-reduce of a payload (any shape), chained after the
    previous all-reduce of the jaxpr it is traced into (sifar_jax.ordering).

    The transformation rules below bind through here again, one level down,
    so the call that lands in a jaxpr takes that jaxpr's ordering operand and
    chain, not those of a transient jvp or vmap trace."""
    plan = dataclasses.replace(plan, chain=ordering.chain_id(payload, plan.scope))
    out = allreduce_p.bind(payload, *ordering.operands(payload), plan=plan, repeat=repeat)
    ordering.remember(payload, out)
    return out


def _abstract_eval(payload, *order, plan, repeat):
    del order, repeat
    # On XLA:CPU the call is side-effecting: it is kept even when its result is
    # unused, so a failed all-reduce still surfaces.
    effects = {_jax_compat.ALLREDUCE_EFFECT} if plan.platform == "cpu" else set()
    return _jax_compat.psum_type(payload, plan.axes), effects


def _i64s(values) -> ir.DenseI64ArrayAttr:
    return ir.DenseI64ArrayAttr.get([int(v) for v in values])


def _tensor_type(value, shape) -> ir.RankedTensorType:
    """A tensor type of `shape` with `value`'s element type."""
    return ir.RankedTensorType.get(list(shape), ir.RankedTensorType(value.type).element_type)


def _lowering(ctx, payload, *order, plan, repeat):
    """The FFI call on a 1-D payload of whole 16-byte lines: any other shape is
    flattened and zero-padded here and the result sliced back (in the HLO, not
    in the jaxpr). The ordering operands are passed along and never read."""
    rule = jax.ffi.ffi_lowering(_ext.TARGETS.allreduce, has_side_effect=plan.platform == "cpu")
    aval_in, aval_out = ctx.avals_in[0], ctx.avals_out[0]
    size = math.prod(aval_in.shape)
    lines = padded_bytes(size, aval_in.dtype) // jnp.dtype(aval_in.dtype).itemsize
    if tuple(aval_in.shape) == (lines,):
        return rule(ctx, payload, *order, **plan.attrs(repeat))
    flat = hlo.reshape(_tensor_type(payload, (size,)), payload)
    if lines != size:
        zero = mlir.ir_constant(np.zeros((), aval_in.dtype))
        flat = hlo.pad(flat, zero, _i64s([0]), _i64s([lines - size]), _i64s([0]))
    lined = ctx.replace(avals_in=[aval_in.update(shape=(lines,)), *ctx.avals_in[1:]],
                        avals_out=[aval_out.update(shape=(lines,))])
    (out,) = rule(lined, flat, *order, **plan.attrs(repeat))
    if lines != size:
        out = hlo.slice(out, _i64s([0]), _i64s([size]), _i64s([1]))
    return [hlo.reshape(_tensor_type(out, aval_out.shape), out)]


def _impl(*args, plan, repeat):
    return jax.jit(functools.partial(allreduce_p.bind, plan=plan, repeat=repeat))(*args)


def _jvp(primals, tangents, *, plan, repeat):
    """Linear: the primal by sifar, the tangent by lax.psum (whose transpose
    and higher derivatives are then JAX's own)."""
    out = allreduce(primals[0], plan, repeat)
    t = tangents[0]
    if type(t) is ad.Zero:
        return out, _jax_compat.zero_tangent(out)
    return out, lax_psum(t, plan.axes)


def _transpose(ct, payload, *order, plan, repeat):
    """lax.psum's transpose, over the same input type."""
    assert ad.is_undefined_primal(payload)
    if type(ct) is ad.Zero:
        return [ad.Zero(payload.aval)] + [None] * len(order)
    psum = functools.partial(lax_psum, axis_name=plan.axes)
    (ct_in,) = jax.linear_transpose(psum, payload.aval)(ct)
    return [ct_in] + [None] * len(order)


def _batch(args, dims, *, plan, repeat):
    """vmap: the sum is elementwise, so all-reduce the stacked payloads as one."""
    payload = args[0]
    if dims[0] is _jax_compat.NOT_MAPPED:
        return allreduce(payload, plan, repeat), _jax_compat.NOT_MAPPED
    stacked = jnp.moveaxis(payload, dims[0], 0)
    nbytes = padded_bytes(stacked.size, stacked.dtype)
    chosen = choose(plan, nbytes, "sifar_psum", what="vmapped ")
    if isinstance(chosen, Fallback):
        return chosen.psum(stacked, plan.axes, stacklevel=2), 0
    return allreduce(stacked, chosen, repeat), 0


allreduce_p.def_effectful_abstract_eval(_abstract_eval)
allreduce_p.def_impl(_impl)
mlir.register_lowering(allreduce_p, _lowering)
ad.primitive_jvps[allreduce_p] = _jvp
ad.primitive_transposes[allreduce_p] = _transpose
batching.primitive_batchers[allreduce_p] = _batch


# ------------------------------------------------------------------- payloads --
def _pack(sizes: list[int], dtype, slot: int) -> list[list[int]]:
    """Consecutive leaves share a payload while it fits the slot."""
    groups: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if groups and padded_bytes(total + size, dtype) <= slot:
            groups[-1].append(i)
            total += size
        else:
            groups.append([i])
            total = size
    return groups


def _reduce_payload(leaves: list, plan: Plan, rest: tuple) -> list:
    """All-reduces leaves of one dtype and type as one payload; returns them."""
    if len(leaves) == 1:  # as it is: the lowering flattens and pads it
        out = allreduce(leaves[0], plan)
        return [lax_psum(out, rest) if rest else out]
    payload = jnp.concatenate([leaf.reshape(-1) for leaf in leaves])
    out = allreduce(payload, plan)
    if rest:  # axes whose devices sifar cannot reach
        out = lax_psum(out, rest)
    outs, start = [], 0
    for leaf in leaves:
        outs.append(out[start : start + leaf.size].reshape(leaf.shape))
        start += leaf.size
    return outs


def _same_type(got_aval, want) -> bool:
    return (
        jnp.dtype(got_aval.dtype) == jnp.dtype(want.dtype)
        and bool(got_aval.weak_type) == bool(want.weak_type)
        and _jax_compat.axis_state(got_aval) == _jax_compat.axis_state(want)
    )


def _sort_leaves(leaves, want, mesh_axes, plan: Plan, algorithm: str, api: str):
    """Which leaves sifar sums, grouped into payloads by dtype and type, and
    which go to lax.psum (with the reason to warn about, None for none).
    Rewrites `leaves` in place: bool as int32, weak types as lax.psum's."""
    payloads: dict[tuple, list[int]] = {}
    to_psum: dict[int, str | None] = {}
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, jax.core.Tracer):
            to_psum[i] = None  # a constant among traced leaves: typed as lax.psum types it
            continue
        if leaf.dtype == np.bool_:
            leaf = leaf.astype(jnp.int32)  # lax.psum counts
        if jax.typeof(leaf).weak_type and not want[i].weak_type:
            leaf = jax.lax.convert_element_type(leaf, leaf.dtype)  # lax.psum drops it
        leaves[i] = leaf
        aval = jax.typeof(leaf)
        # The rule allreduce_choice reports: empty, dtype, slot, auto's table.
        chosen = payload_choice(plan, leaf.size, leaf.dtype, algorithm, api)
        if isinstance(chosen, Fallback):
            to_psum[i] = None if chosen.chosen else chosen.reason
        elif not _same_type(_jax_compat.psum_type(aval, mesh_axes), want[i]):
            to_psum[i] = f"lax.psum types {aval} differently"  # e.g. a type JAX added later
        else:
            # One payload per dtype and type (varying/unreduced axes): the
            # primitive types its result from its one operand.
            key = (jnp.dtype(leaf.dtype), aval.weak_type, _jax_compat.axis_state(aval))
            payloads.setdefault(key, []).append(i)
    return payloads, to_psum


# Fallback warnings point at the user's line: _psum <- sifar_psum <- the user.
_USER = 3


def _split_axes(axes: tuple, api: str) -> tuple[tuple, tuple, tuple]:
    """(mesh axes of more than one device, mesh axes of one device, vmap axes)."""
    manual = _jax_compat.manual_axes()
    sizes = {a: axis_size(a, api) for a in axes}  # an unbound name: UnboundAxisError
    big = tuple(a for a in axes if a in manual and sizes[a] > 1)
    ones = tuple(a for a in axes if a in manual and sizes[a] == 1)
    return big, ones, tuple(a for a in axes if a not in manual)


def _reduce_leaves(leaves, want, mesh_axes, ones, algorithm: str, api: str) -> list:
    """Every leaf summed over mesh_axes + ones: by sifar where the plan serves
    it (the axes of one device only change the type: no communication, one
    rounding), else by lax.psum."""
    axes = mesh_axes + ones
    plan, rest = route(mesh_axes, algorithm, api)
    if isinstance(plan, Fallback):
        return plan.psum(leaves, axes, stacklevel=_USER + 1)
    plan = dataclasses.replace(plan, axes=plan.axes + ones)
    payloads, to_psum = _sort_leaves(leaves, want, axes, plan, algorithm, api)
    outs: list = [None] * len(leaves)
    for (dtype, _, _), idx in payloads.items():
        for group in _pack([leaves[i].size for i in idx], dtype, plan.slot):
            members = [idx[g] for g in group]
            chosen = choose(plan, padded_bytes(sum(leaves[i].size for i in members), dtype), api)
            if isinstance(chosen, Fallback):  # auto's choice: lax.psum at this size, no warning
                to_psum.update(dict.fromkeys(members))
                continue
            sums = _reduce_payload([leaves[i] for i in members], chosen, rest)
            for i, out in zip(members, sums):
                outs[i] = out
    if to_psum:
        late = sorted(to_psum)
        reasons = "; ".join(sorted({r for r in to_psum.values() if r}))
        parts = [leaves[i] for i in late]
        sums = (Fallback(reasons).psum(parts, axes, stacklevel=_USER + 1) if reasons
                else lax_psum(parts, axes))
        for i, out in zip(late, sums):
            outs[i] = out
    return outs


def _psum(x, axis_name, *, axis_index_groups, algorithm: str, api: str):
    algorithms.validate(algorithm)
    axes = axes_of(axis_name)
    mesh_axes, ones, vmapped = _split_axes(axes, api)
    if axis_index_groups is not None:
        fallback = fallback_or_raise("axis_index_groups", algorithm=algorithm, api=api, error=ValueError(
            f"sifar_jax.{api}(algorithm={algorithm!r}): axis_index_groups is served by "
            f"lax.psum only; use algorithm='auto'"))
        return fallback.psum(x, axis_name, stacklevel=_USER, axis_index_groups=axis_index_groups)

    leaves, tree = jax.tree.flatten(x)
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves) or len(set(axes)) != len(axes):
        # Constants: lax.psum returns size * x at trace time; nothing to communicate.
        # A repeated axis: lax.psum's own error (it raises when lowered).
        return lax_psum(x, axis_name)
    if not mesh_axes and not ones:
        return lax_psum(x, axis_name)  # vmap axes only: a local sum, no communication
    # lax.psum's own result type for every leaf; raises lax.psum's errors.
    want = jax.eval_shape(functools.partial(lax_psum, axis_name=axes), leaves)
    if vmapped:  # vmap axes: lax.psum, a local sum without communication
        leaves = tree.flatten_up_to(lax_psum(x, vmapped))
    if not mesh_axes:  # mesh axes of one device only: the type changes, nothing moves
        return tree.unflatten([size_one.psum(leaf, ones) if isinstance(leaf, jax.core.Tracer)
                               else lax_psum(leaf, ones) for leaf in leaves])
    return tree.unflatten(_reduce_leaves(leaves, want, mesh_axes, ones, algorithm, api))


def sifar_psum(x, axis_name, *, axis_index_groups=None, algorithm: str = algorithms.AUTO):
    """All-reduce (sum) like `lax.psum(x, axis_name)`, by SiFAR where it can.

    Use inside `jax.shard_map` (under `jax.jit`) after `sifar_jax.init(mesh)`.

    Equal to lax.psum: the result's structure, shapes, dtypes, weak types,
    varying and unreduced axes (check_vma, explicit sharding); its derivatives (jvp, grad, vjp,
    linear_transpose, higher orders: the tangent and the transpose are
    lax.psum's); vmap inside or around shard_map; the errors (an unbound axis
    raises `sifar_jax.UnboundAxisError`, a NameError).

    Sums by sifar: the dtypes in `SUPPORTED_DTYPES` (float32, bfloat16,
    float16, int32, uint32 as the extension lists them) over one or several
    mesh axes; bool counts as int32, like lax.psum. A pytree goes in as few all-reduces as possible:
    one payload per dtype (leaves concatenated, split back). Every rank gets a
    bit-identical result: partials are added in rank order in float32 and
    rounded once, so the sum can differ from lax.psum's by rounding.

    Hands to lax.psum (with algorithm="auto", warning once with the reason):
    other dtypes, payloads past the slot, axes that sifar_jax cannot serve,
    `axis_index_groups`, a shard_map manual over only some mesh axes (XLA
    would replicate the call over the others: jax.vmap over a shard_map on an
    explicit mesh); vmap axis names and constants (no communication) go to
    lax.psum silently, and so do payloads the auto table gives to lax.psum
    (sifar_jax.autotable: a choice by size). A named algorithm raises instead
    of falling back. An operand unreduced over the axes (explicit sharding)
    is summed by sifar and typed as lax.psum types it.
    """
    return _psum(x, axis_name, axis_index_groups=axis_index_groups, algorithm=algorithm,
                 api="sifar_psum")
