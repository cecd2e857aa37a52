"""`sifar_psum`: the drop-in `lax.psum` inside `shard_map`.

The all-reduce is one JAX primitive, `sifar_allreduce`, over a flat payload of
whole 16-byte lines (one payload per dtype, the leaves of a pytree
concatenated). The primitive carries lax.psum's type and calculus:

* type: the result varies over the input's varying axes minus the reduced
  ones, exactly as lax.psum's (so shard_map(check_vma=True) refuses a wrong
  out_specs at trace time);
* jvp: the primal by sifar, the tangent by lax.psum; transpose: lax.psum's
  own transpose (grad, vjp, linear_transpose and higher orders are psum's);
* vmap: an elementwise sum batches by summing the stacked payload.

Whatever sifar cannot serve goes to lax.psum: with algorithm="auto" after a
one-time warning naming the reason, with a named algorithm as an error.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from . import _ext, _jax_compat, algorithms, comm, multicast, ordering
from ._jax_compat import ad, batching, mlir
from .errors import NotInitializedError, UnboundAxisError


def _native_dtypes() -> tuple:
    """The dtypes the extension sums natively (it may list them itself)."""
    names = getattr(_ext._sifar, "dtypes", None)
    if names is None:
        return (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return tuple(jnp.dtype(n) for n in names())


SUPPORTED_DTYPES = _native_dtypes()
_LINE = 16  # bytes: the payload is moved in 16-byte lines
_warned: set[str] = set()
_USER = 4  # warnings from _psum: _fallback <- _psum <- sifar_psum <- the user's line


def _fallback(x, axis_name, reason: str, *, stacklevel: int = 3, **kwargs):
    """lax.psum, warning once per reason (at the caller's caller: the user's line)."""
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"sifar_jax: falling back to lax.psum: {reason}", stacklevel=stacklevel)
    return jax.lax.psum(x, axis_name, **kwargs)


def _unsupported_dtype(dtype, api: str, algorithm: str) -> TypeError:
    names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
    return TypeError(
        f"sifar_jax.{api}(algorithm={algorithm!r}): dtype {dtype} is not supported; "
        f"the sifar algorithms sum {names} (algorithm='auto' hands other types to lax.psum)"
    )


# ---------------------------------------------------------------------- axes --
def _axes(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _axis_size(axis_name, api: str = "sifar_psum") -> int:
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError as e:
        raise UnboundAxisError(
            f"sifar_jax.{api}: axis {axis_name!r} is not bound here; call it inside "
            f"jax.shard_map over a mesh that has this axis (or jax.vmap(..., axis_name=...))"
        ) from e


# ---------------------------------------------------------------------- plan --
@dataclasses.dataclass(frozen=True)
class _Plan:
    """How the all-reduces of one call run: communicators, algorithm, axes.

    Hashable: it is a parameter of the sifar_allreduce primitive."""

    comms: tuple
    algorithm: str
    nranks: int
    axes: tuple = ()  # the mesh axes reduced over (one communicator spans them)
    explicit: bool = True  # a named algorithm: raise where "auto" falls back
    pad: int = 0  # elements appended to reach whole 16-byte lines (single arrays)
    chain: int = 0  # the jaxpr's call chain (sifar_jax.ordering), set where it is bound

    @property
    def platform(self) -> str:
        return self.comms[0].platform

    @property
    def scope(self) -> int:
        """Chain ids are counted per communicator (sifar_jax.ordering)."""
        return int(self.comms[0].axis_key)

    @property
    def slot(self) -> int:
        return min(c.slot_bytes for c in self.comms)

    def attrs(self, repeat: int = 1) -> dict:
        return dict(
            axis_key=np.int32(self.comms[0].axis_key),
            nranks=np.int32(self.nranks),
            algorithm=np.int32(algorithms.IDS[self.algorithm]),
            repeat=np.int32(repeat),
            chain=np.int32(self.chain),
        )


def _multicast_refusal(comms) -> str | None:
    """Why these communicators cannot use multicast (None if all can)."""
    for c in comms:
        why = _ext._sifar.comm_multicast_refusal(c.comm_id)
        if why:
            return why
    return None


def _pick(algorithm: str, comms) -> str:
    # "auto" only ever picks an algorithm that is correct by construction:
    # sifar (multicast's flag check is the paper's, not exact).
    return algorithms.SIFAR if algorithm == algorithms.AUTO else algorithm


def _comms_for(axes: tuple, nranks: int) -> tuple:
    found = comm.communicators(axes[0]) if len(axes) == 1 else comm.communicators_over(axes)
    return tuple(c for c in found if c.nranks == nranks)


def _why_not(axes: tuple, nranks: int) -> str | None:
    key = axes[0] if len(axes) == 1 else axes
    reasons = [u.reason for u in comm.unsupported(key) if u.nranks == nranks]
    return reasons[0] if reasons else None


def _route(axes: tuple, algorithm: str, api: str):
    """Which communicator serves a reduction over the mesh axes `axes`.

    Returns (plan, rest, reason): sifar reduces over plan.axes, lax.psum over
    `rest`; plan is None (with the reason) when sifar serves none of them.
    Several axes share one communicator where their devices reach each other
    (always on the CPU); otherwise sifar takes the axes that have their own
    communicator (the NVLink ones) and lax.psum the others.
    """
    sizes = {a: _axis_size(a, api) for a in axes}
    n = math.prod(sizes.values())
    comms = _comms_for(axes, n)
    rest: tuple = ()
    reason = None
    if not comms:
        reason = _why_not(axes, n)
        if reason is None:
            raise NotInitializedError(
                f"sifar_jax.{api}: no communicator for axis {axes[0] if len(axes) == 1 else axes!r}"
                f" of size {n}; call sifar_jax.init(mesh) with the mesh you pass to shard_map first"
            )
        served = tuple(a for a in axes if len(axes) > 1 and _comms_for((a,), sizes[a]))
        for part in ([served] if len(served) > 1 else []) + [(a,) for a in served]:
            comms = _comms_for(part, math.prod(sizes[a] for a in part))
            if comms:
                axes, rest = part, tuple(a for a in axes if a not in part)
                n = math.prod(sizes[a] for a in part)
                break
    if not comms:
        if algorithm != algorithms.AUTO:
            raise ValueError(f"sifar_jax.{api}(algorithm={algorithm!r}): {reason}")
        return None, axes, reason

    chosen = _pick(algorithm, comms)
    if chosen == algorithms.MULTICAST:
        multicast.require_enabled()  # the guard: a clear error while multicast is off
        if comms[0].platform != "cuda":
            if algorithm != algorithms.AUTO:
                raise ValueError(f"sifar_jax.{api}(algorithm={algorithm!r}): multicast needs NVLink GPUs")
            return None, axes + rest, "multicast needs NVLink GPUs"
        why = _multicast_refusal(comms)
        if why:
            raise multicast.MulticastDisabledError(f"sifar_jax: algorithm 'multicast' refused: {why}")
    plan = _Plan(tuple(comms), chosen, n, tuple(axes), algorithm != algorithms.AUTO)
    return plan, rest, reason


def _too_large(nbytes: int, plan: _Plan) -> str:
    return (
        f"payload of {nbytes} bytes exceeds the {plan.slot}-byte slot "
        f"(raise it with sifar_jax.init(mesh, slot_bytes=...))"
    )


def _padded_bytes(size: int, dtype) -> int:
    return -(-size * jnp.dtype(dtype).itemsize // _LINE) * _LINE


def _plan(x, axis_name, algorithm: str, api: str):
    """One array over one axis (sifar_psum_into): a _Plan with its padding, or
    a string: why "auto" falls back."""
    algorithms.validate(algorithm)
    dtype = jnp.dtype(x.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise _unsupported_dtype(dtype, api, algorithm)
    axes = _axes(axis_name)
    if len(axes) != 1:
        if algorithm != algorithms.AUTO:
            raise ValueError(f"sifar_jax.{api}(algorithm={algorithm!r}): reduces over one axis only")
        return "reducing over several axes at once is not supported here"
    plan, rest, reason = _route(axes, algorithm, api)
    if plan is None:
        return reason
    padded = _padded_bytes(x.size, dtype)
    if padded > plan.slot:
        if plan.explicit:
            raise ValueError(f"sifar_jax.{api}(algorithm={algorithm!r}): {_too_large(padded, plan)}")
        return _too_large(padded, plan)
    pad = (padded - x.size * dtype.itemsize) // dtype.itemsize
    return dataclasses.replace(plan, pad=pad, chain=ordering.chain_id(x, plan.scope))


def _flat(x, plan: _Plan):
    flat = x.reshape(-1)
    return jnp.pad(flat, (0, plan.pad)) if plan.pad else flat


def _unflat(out, x, plan: _Plan):
    if plan.pad:
        out = out[: x.size]
    return out.reshape(x.shape)


# ----------------------------------------------------------------- primitive --
allreduce_p = _jax_compat.Primitive("sifar_allreduce")


def _allreduce(payload, plan: _Plan, repeat: int = 1):
    """One all-reduce of a 1-D payload of whole lines, chained after the
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
    vma = _jax_compat.varying_axes(payload) - set(plan.axes)
    # On XLA:CPU the call is side-effecting: it is kept even when its result is
    # unused, so a failed all-reduce still surfaces.
    effects = {_jax_compat.ALLREDUCE_EFFECT} if plan.platform == "cpu" else set()
    return _jax_compat.with_varying(payload, vma), effects


def _lowering(ctx, payload, *order, plan, repeat):
    # The ordering operands are passed along and never read by the handler.
    rule = jax.ffi.ffi_lowering(_ext.TARGETS.allreduce, has_side_effect=plan.platform == "cpu")
    return rule(ctx, payload, *order, **plan.attrs(repeat))


def _impl(*args, plan, repeat):
    return jax.jit(functools.partial(allreduce_p.bind, plan=plan, repeat=repeat))(*args)


def _jvp(primals, tangents, *, plan, repeat):
    """Linear: the primal by sifar, the tangent by lax.psum (whose transpose
    and higher derivatives are then JAX's own)."""
    out = _allreduce(primals[0], plan, repeat)
    t = tangents[0]
    if type(t) is ad.Zero:
        return out, _jax_compat.zero_tangent(out)
    return out, jax.lax.psum(t, plan.axes)


def _transpose(ct, payload, *order, plan, repeat):
    """lax.psum's transpose, over the same input type."""
    assert ad.is_undefined_primal(payload)
    if type(ct) is ad.Zero:
        return [ad.Zero(payload.aval)] + [None] * len(order)
    psum = functools.partial(jax.lax.psum, axis_name=plan.axes)
    (ct_in,) = jax.linear_transpose(psum, payload.aval)(ct)
    return [ct_in] + [None] * len(order)


def _batch(args, dims, *, plan, repeat):
    """vmap: the sum is elementwise, so all-reduce the stacked payloads as one."""
    payload = args[0]
    if dims[0] is _jax_compat.NOT_MAPPED:
        return _allreduce(payload, plan, repeat), _jax_compat.NOT_MAPPED
    stacked = jnp.moveaxis(payload, dims[0], 0)
    flat = stacked.reshape(-1)
    nbytes = flat.size * flat.dtype.itemsize
    if nbytes > plan.slot:
        why = "vmapped " + _too_large(nbytes, plan)
        if plan.explicit:
            raise ValueError(f"sifar_jax.sifar_psum(algorithm={plan.algorithm!r}): {why}")
        out = _fallback(flat, plan.axes, why)
    else:
        out = _allreduce(flat, plan, repeat)
    return out.reshape(stacked.shape), 0


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
        if groups and _padded_bytes(total + size, dtype) <= slot:
            groups[-1].append(i)
            total += size
        else:
            groups.append([i])
            total = size
    return groups


def _reduce_payload(leaves: list, plan: _Plan, rest: tuple) -> list:
    """All-reduces leaves of one dtype and type as one payload; returns them."""
    dtype = leaves[0].dtype
    flats = [leaf.reshape(-1) for leaf in leaves]
    payload = flats[0] if len(flats) == 1 else jnp.concatenate(flats)
    pad = (_padded_bytes(payload.size, dtype) // dtype.itemsize) - payload.size
    if pad:
        payload = jnp.pad(payload, (0, pad))
    out = _allreduce(payload, plan)
    if rest:  # axes whose devices sifar cannot reach
        out = jax.lax.psum(out, rest)
    if not pad and len(leaves) == 1:
        return [out.reshape(leaves[0].shape)]
    outs, start = [], 0
    for leaf in leaves:
        outs.append(out[start : start + leaf.size].reshape(leaf.shape))
        start += leaf.size
    return outs


def _same_type(got_aval, want) -> bool:
    return (
        jnp.dtype(got_aval.dtype) == jnp.dtype(want.dtype)
        and bool(got_aval.weak_type) == bool(want.weak_type)
        and _jax_compat.varying_axes(got_aval) == _jax_compat.varying_axes(want)
    )


def _sort_leaves(leaves, want, mesh_axes, plan: _Plan, algorithm: str, api: str):
    """Which leaves sifar sums, grouped into payloads by dtype and type, and
    which go to lax.psum (with the reason to warn about, None for none).
    Rewrites `leaves` in place: bool as int32, weak types as lax.psum's."""
    auto = algorithm == algorithms.AUTO
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
        vma = _jax_compat.varying_axes(aval)
        nbytes = _padded_bytes(leaf.size, leaf.dtype)
        if leaf.size == 0:
            to_psum[i] = None  # nothing to add; lax.psum gives the exact empty result
        elif jnp.dtype(leaf.dtype) not in SUPPORTED_DTYPES:
            if not auto:
                raise _unsupported_dtype(leaf.dtype, api, algorithm)
            to_psum[i] = f"dtype {leaf.dtype} is not summed natively"
        elif not _same_type(_jax_compat.with_varying(aval, vma - set(mesh_axes)), want[i]):
            to_psum[i] = f"lax.psum types {aval} differently"  # e.g. a type JAX added later
        elif nbytes > plan.slot:
            if not auto:
                raise ValueError(f"sifar_jax.{api}(algorithm={algorithm!r}): {_too_large(nbytes, plan)}")
            to_psum[i] = _too_large(nbytes, plan)
        else:
            payloads.setdefault((jnp.dtype(leaf.dtype), aval.weak_type, vma), []).append(i)
    return payloads, to_psum


def _psum(x, axis_name, *, axis_index_groups, algorithm: str, api: str):
    algorithms.validate(algorithm)
    axes = _axes(axis_name)
    for a in axes:
        _axis_size(a, api)  # an unbound name: UnboundAxisError (a NameError)
    if axis_index_groups is not None:
        if algorithm != algorithms.AUTO:
            raise ValueError(
                f"sifar_jax.{api}(algorithm={algorithm!r}): axis_index_groups is served by "
                f"lax.psum only; use algorithm='auto'"
            )
        return _fallback(x, axis_name, "axis_index_groups", stacklevel=_USER,
                         axis_index_groups=axis_index_groups)

    leaves, tree = jax.tree.flatten(x)
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        # Constants: lax.psum returns size * x at trace time; nothing to communicate.
        return jax.lax.psum(x, axis_name)
    # Mesh axes of one device need no communication either: lax.psum sums
    # them (XLA drops an all-reduce of one participant), like vmap axes.
    manual = _jax_compat.manual_axes()
    mesh_axes = tuple(a for a in axes if a in manual and _axis_size(a, api) > 1)
    others = tuple(a for a in axes if a not in mesh_axes)
    if not mesh_axes or len(set(axes)) != len(axes):
        # vmap axes only: a local sum, no communication. A repeated axis:
        # lax.psum's own error (it raises when lowered).
        return jax.lax.psum(x, axis_name)
    # lax.psum's own result type for every leaf; raises lax.psum's errors.
    want = jax.eval_shape(functools.partial(jax.lax.psum, axis_name=axes), leaves)
    if others:  # vmap axes, one-device axes: lax.psum, without communication
        leaves = tree.flatten_up_to(jax.lax.psum(x, others))

    plan, rest, reason = _route(mesh_axes, algorithm, api)
    if plan is None:
        return tree.unflatten(_fallback(leaves, mesh_axes, reason, stacklevel=_USER))
    payloads, to_psum = _sort_leaves(leaves, want, mesh_axes, plan, algorithm, api)

    outs: list = [None] * len(leaves)
    for (dtype, _, _), idx in payloads.items():
        for group in _pack([leaves[i].size for i in idx], dtype, plan.slot):
            members = [idx[g] for g in group]
            sums = _reduce_payload([leaves[i] for i in members], plan, rest)
            for i, out in zip(members, sums):
                outs[i] = out
    if to_psum:
        late = sorted(to_psum)
        reasons = "; ".join(sorted({r for r in to_psum.values() if r}))
        parts = [leaves[i] for i in late]
        sums = (_fallback(parts, mesh_axes, reasons, stacklevel=_USER) if reasons
                else jax.lax.psum(parts, mesh_axes))
        for i, out in zip(late, sums):
            outs[i] = out
    return tree.unflatten(outs)


def sifar_psum(x, axis_name, *, axis_index_groups=None, algorithm: str = algorithms.AUTO):
    """All-reduce (sum) like `lax.psum(x, axis_name)`, by SiFAR where it can.

    Use inside `jax.shard_map` (under `jax.jit`) after `sifar_jax.init(mesh)`.

    Equal to lax.psum: the result's structure, shapes, dtypes, weak types and
    varying axes (check_vma); its derivatives (jvp, grad, vjp,
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
    `axis_index_groups`; vmap axis names and constants (no communication) go
    to lax.psum silently. A named algorithm raises instead of falling back.
    """
    return _psum(x, axis_name, axis_index_groups=axis_index_groups, algorithm=algorithm,
                 api="sifar_psum")
