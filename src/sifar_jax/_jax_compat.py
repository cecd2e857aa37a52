"""Every use of JAX internals, in one place (as mpi4jax keeps its own).

sifar-jax supports jax 0.10.x (CI, PyPI) and 0.11.x (the GPU hosts). Each item
below says what it reaches for, why no public API does it, and which versions
it was checked against; when JAX moves one, only this file changes.
"""

from __future__ import annotations

import jax

# Defining a primitive (checked 0.10.2, 0.11.x). `jax.extend.core.Primitive`
# and the rule tables in `jax.interpreters.{ad,batching,mlir}` are the
# documented extension points; they are re-exported here so that the rest of
# the package imports JAX's extension surface from one module.
from jax.extend.core import Effect, Primitive  # noqa: F401
from jax.interpreters import ad, batching, mlir  # noqa: F401


def _original_psum():
    """JAX's own psum function, whatever `jax.lax.psum` names now.

    sifar_jax's internals call this, never `jax.lax.psum` looked up at call
    time: a user's `jax.lax.psum = sifar_jax.sifar_psum` (or
    sifar_jax.replace_psum) would otherwise make sifar call itself.
    `jax._src.lax.parallel.psum` is where `jax.lax.psum` comes from (0.10.2,
    0.11.x); if it moves, the public name as it was when sifar_jax was imported.
    """
    try:
        from jax._src.lax import parallel

        return parallel.psum
    except (ImportError, AttributeError):  # moved in a later JAX
        return jax.lax.psum


lax_psum = _original_psum()


def trace_of(x):
    """The trace a tracer belongs to, or None for a concrete value.

    `Tracer._trace` (JAX's stackless core, jax >= 0.4.36; checked 0.10.2 and
    0.11.x): no public accessor tells which jaxpr a value is being traced into,
    and sifar_jax.ordering chains the all-reduces of one jaxpr by it.
    """
    return getattr(x, "_trace", None)


def varying_axes(aval) -> frozenset:
    """The manual mesh axes a value varies over under shard_map(check_vma=True).

    jax >= 0.10 spells it `aval.manual_axis_type.varying` (`.vma` was removed
    in 0.10.0); older releases had `aval.vma`. Empty with check_vma=False.
    """
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def with_varying(aval, axes):
    """`aval` with its varying axes replaced by `axes`: the type rule of our
    all-reduce primitive (lax.psum's: the input's axes minus the reduced ones).
    `ShapedArray.update(manual_axis_type=...)` is how JAX's own psum builds its
    output type (0.10.2, 0.11.x); `update(vma=...)` before 0.10."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return aval.update(manual_axis_type=mat.update(varying=frozenset(axes)))
    return aval.update(vma=frozenset(axes))


def same_varying(*arrays) -> list:
    """The operands cast to one varying-axes type, their union (an FFI call requires it under
    check_vma; JAX may or may not insert these casts itself)."""
    vmas = [varying_axes(jax.typeof(a)) for a in arrays]
    union = frozenset().union(*vmas)
    return [a if v == union else jax.lax.pcast(a, tuple(sorted(union - v)), to="varying")
            for a, v in zip(arrays, vmas)]


def psum_type(aval, axes):
    """lax.psum's result type for a value of type `aval` reduced over `axes`:
    neither varying nor unreduced over them any more (an unreduced value's
    sum is lax.psum's `unreduced_psum`; reduced axes stay). The type rule of
    our all-reduce primitive. `ManualAxisType.update` with `unreduced` exists
    from 0.10 (checked 0.10.2, 0.11.x); 0.11 also carries `unreduced_kind`,
    which must be None once nothing is unreduced (as its unreduced_psum sets
    it); before 0.10 only `vma` existed."""
    axes = frozenset(axes)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is None:
        return aval.update(vma=frozenset(getattr(aval, "vma", ())) - axes)
    changes = dict(varying=frozenset(mat.varying) - axes)
    unreduced = frozenset(getattr(mat, "unreduced", ()))
    if unreduced & axes:
        changes["unreduced"] = unreduced - axes
        if not changes["unreduced"] and hasattr(mat, "unreduced_kind"):
            changes["unreduced_kind"] = None
    return aval.update(manual_axis_type=mat.update(**changes))


def axis_state(aval) -> tuple:
    """(varying, unreduced, reduced) manual axes of a type: what lax.psum's
    result type depends on beyond shape and dtype (unreduced/reduced exist
    from jax 0.10; empty before)."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is None:
        return (frozenset(getattr(aval, "vma", ())), frozenset(), frozenset())
    return (frozenset(mat.varying), frozenset(getattr(mat, "unreduced", ())),
            frozenset(getattr(mat, "reduced", ())))


def partitioned_axes() -> tuple:
    """Mesh axes of more than one device that are not manual here: inside a
    shard_map that is manual over only some of its mesh's axes (axis_names=,
    or jax.vmap over a shard_map on an explicit mesh), XLA partitions the body
    over these, and would have to replicate a custom call across them. Public
    API (`get_abstract_mesh`, 0.10.2 and 0.11.x)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    manual = frozenset(mesh.manual_axes)
    return tuple(a for a in mesh.axis_names if a not in manual and mesh.shape[a] > 1)


def manual_axes() -> frozenset:
    """Mesh axes that are manual here, i.e. bound by an enclosing shard_map
    (public API; a vmap axis name is not among them)."""
    return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def zero_tangent(primal):
    """A symbolic zero tangent for `primal` (`ShapedArray.to_tangent_aval`,
    0.10.2 and 0.11.x: float0 for integer values)."""
    return ad.Zero(jax.typeof(primal).to_tangent_aval())


class _AllReduceEffect(Effect):
    """The side effect of an all-reduce that must run even when its result
    is unused (sifar_jax declares it on XLA:CPU, where a failed all-reduce
    must still surface)."""

    def __str__(self):
        return "SifarAllReduce"


ALLREDUCE_EFFECT = _AllReduceEffect()


def _allow_effect() -> None:
    """Lets the effect appear where lax.psum can: lowered, in control flow,
    inside custom_jvp/custom_vjp and jax.checkpoint (remat may recompute an
    all-reduce: every rank recomputes the same ones). The tables in
    `jax._src.effects` are the only way to say so (0.10.2, 0.11.x);
    jax.debug.callback's effect is registered the same way. ffi_call's own
    effect is not allowed under remat, which is why sifar_jax has its own."""
    from jax._src import effects

    for table in (
        effects.lowerable_effects,
        effects.control_flow_allowed_effects,
        effects.custom_derivatives_allowed_effects,
        effects.remat_allowed_effects,
    ):
        table.add_type(_AllReduceEffect)


_allow_effect()

# vmap's marker for "this operand has no batch dimension": None in every JAX
# release (`jax._src.interpreters.batching.not_mapped`, not re-exported).
NOT_MAPPED = None


def forget_runtime_tokens() -> None:
    """Drops the runtime tokens JAX keeps for side-effecting computations.

    `jax._src.dispatch.runtime_tokens` (0.10.2, 0.11.x): after a side-effecting
    computation failed, every later `jax.effects_barrier()` re-raises its
    (already reported) error. sifar_jax.comm forgets it on shutdown()/init().
    """
    from jax._src import dispatch

    tokens = dispatch.runtime_tokens
    for tok in [*tokens.current_tokens.values(), *tokens.output_runtime_tokens.values()]:
        try:
            tok.block_until_ready()
        except Exception:  # noqa: BLE001 - the failing call already raised it
            pass
    tokens.clear()


def kv_client():
    """jax.distributed's key-value client, or None where it is not running.

    `jax._src.distributed.global_state.client` (0.10.2, 0.11.x): jax.distributed
    exposes no public accessor for its store; sifar_jax.distributed agrees on
    communicators spanning processes through it.
    """
    try:
        from jax._src import distributed as jax_distributed

        return jax_distributed.global_state.client
    except (ImportError, AttributeError):  # moved in a later JAX: no spanning communicators
        return None


def explicit_spec(x) -> tuple | None:
    """x's PartitionSpec as its type carries it over Explicit mesh axes
    (`aval.sharding`, public through jax.typeof in 0.10.2 and 0.11.x), padded
    to x's rank; None where the type says nothing (auto axes)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is None or mesh is None or getattr(mesh, "empty", True):
        return None
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    if not any(t == explicit for t in getattr(mesh, "axis_types", ())):
        return None
    return tuple(spec) + (None,) * (x.ndim - len(spec))
