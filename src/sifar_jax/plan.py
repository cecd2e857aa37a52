"""The plan core: how one call of an op runs, or why sifar cannot serve it.

Every op (`sifar_psum`, `sifar_psum_into`, `psum_add_rmsnorm`,
`benchmarking.psum_repeated`) asks the same questions at trace time: which
communicator serves these axes, with which algorithm, whether the payload
fits the slot. The answer is a `Plan` (the all-reduce runs: the communicators,
the algorithm, the padding and the call chain) or a `Fallback` carrying the
reason it cannot. What an op does with a Fallback follows one rule,
`fallback_or_raise`:

* algorithm="auto" falls back (to lax.psum, warning once with the reason:
  `Fallback.psum`), except where handing the payload to lax.psum is the right
  choice, not a shortcoming: auto's table (sifar_jax.autotable) chose lax.psum
  for the payload's size, the payload is larger than the slot, or init was
  told not to make the product of axes it is reduced over. Those are quiet
  (`Fallback.chosen`): the reason is logged at debug level on the "sifar_jax"
  logger and said by `sifar_jax.allreduce_choice`;
* a named algorithm raises instead, naming it and the reason: nothing the
  user asked for is silently replaced.

(`psum_add_rmsnorm` also falls back for a named algorithm where only the
fusion cannot run: its fallback, the unfused composition, still runs
`sifar_psum` with that algorithm, under this same rule.)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from . import _ext, _jax_compat, algorithms, autotable, comm, multicast, ordering
from ._jax_compat import lax_psum
from .errors import NotInitializedError, UnboundAxisError

LINE = 16  # bytes: the payload is moved in whole 16-byte lines
log = logging.getLogger("sifar_jax")


def _native_dtypes() -> tuple:
    """The dtypes the extension sums natively (it may list them itself)."""
    names = getattr(_ext.lib, "dtypes", None)
    if names is None:
        return (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return tuple(jnp.dtype(n) for n in names())


SUPPORTED_DTYPES = _native_dtypes()


# ------------------------------------------------------------------ the plan --
@dataclasses.dataclass(frozen=True)
class Plan:
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

    @property
    def requested(self) -> str:
        """The algorithm the user asked for ("auto" unless one was named)."""
        return self.algorithm if self.explicit else algorithms.AUTO

    def attrs(self, repeat: int = 1) -> dict:
        """The attributes every all-reduce call carries (ffi/allreduce/plan.h,
        WithAllReduceAttrs)."""
        return dict(
            axis_key=np.int32(self.comms[0].axis_key),
            nranks=np.int32(self.nranks),
            algorithm=np.int32(algorithms.IDS[self.algorithm]),
            repeat=np.int32(repeat),
            chain=np.int32(self.chain),
        )


# ------------------------------------------------------------------ the rule --
# Messages already warned about: each fallback warns once per reason.
warned: set[str] = set()


def warn_once(message: str, stacklevel: int = 1) -> None:
    """warnings.warn(message) the first time only; stacklevel 1 is the caller's line."""
    if message not in warned:
        warned.add(message)
        warnings.warn(message, stacklevel=stacklevel + 1)


@dataclasses.dataclass(frozen=True)
class Fallback:
    """Why sifar does not run this call; the op runs its fallback instead.

    chosen: handing the payload to lax.psum is auto's choice, not a
    shortcoming (the table's choice, a payload past the slot, a product of
    axes init was told not to make): nothing to warn about."""

    reason: str
    chosen: bool = False

    def warn(self, instead: str = "lax.psum", api: str | None = None,
             stacklevel: int = 1) -> None:
        """Warns once per reason that `instead` runs (not for a chosen
        fallback); stacklevel 1 is the caller's line."""
        if self.chosen:
            return
        where = f"sifar_jax.{api}" if api else "sifar_jax"
        warn_once(f"{where}: falling back to {instead}: {self.reason}", stacklevel + 1)

    def psum(self, x, axis_name, *, stacklevel: int = 1, **kwargs):
        """lax.psum(x, axis_name, **kwargs), warning once with the reason
        (stacklevel 1 is the caller's line)."""
        self.warn(stacklevel=stacklevel + 1)
        return lax_psum(x, axis_name, **kwargs)


def fallback_or_raise(reason: str, *, algorithm: str, api: str,
                      error: Exception | None = None) -> Fallback:
    """The one rule for what sifar cannot serve: with algorithm="auto" a
    Fallback carrying the reason; with a named algorithm an error,
    ValueError("sifar_jax.<api>(algorithm=...): <reason>") unless `error`
    says otherwise."""
    if algorithm == algorithms.AUTO:
        return Fallback(reason)
    raise error if error is not None else ValueError(
        f"sifar_jax.{api}(algorithm={algorithm!r}): {reason}")


def unsupported_dtype(dtype, api: str, algorithm: str) -> TypeError:
    names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
    return TypeError(
        f"sifar_jax.{api}(algorithm={algorithm!r}): dtype {dtype} is not supported; "
        f"the sifar algorithms sum {names} (algorithm='auto' hands other types to lax.psum)"
    )


def partially_manual(partitioned: tuple) -> str:
    return (
        f"the enclosing shard_map is not manual over the mesh axes {partitioned}: XLA partitions "
        f"the call over them and would have to replicate it (jax.vmap over a shard_map on an "
        f"explicit mesh, or shard_map(axis_names=...) of some axes only); a shard_map manual "
        f"over every axis of more than one device lets sifar serve it"
    )


def too_large(nbytes: int, plan: Plan) -> str:
    return (
        f"payload of {nbytes} bytes exceeds the {plan.slot}-byte slot "
        f"(raise it with sifar_jax.init(mesh, slot_bytes=...))"
    )


def quiet(reason: str, instead: str = "lax.psum", api: str | None = None) -> Fallback:
    """A fallback that is auto's choice: `instead` runs, the reason is logged at debug level on
    the "sifar_jax" logger, never warned."""
    log.debug("%s: %s: %s", f"sifar_jax.{api}" if api else "sifar_jax", instead, reason)
    return Fallback(reason, chosen=True)


def choose(plan: Plan, nbytes: int, api: str, what: str = "") -> Plan | Fallback:
    """How one payload of `nbytes` (whole lines) runs under `plan`.

    A named algorithm runs it while it fits the slot, else raises. "auto"
    asks the auto table (sifar_jax.autotable) for this size and group size:
    lax.psum, or one of our algorithms while the payload fits the slot; past
    the slot lax.psum (large payloads are lax.psum's to serve). Both are quiet
    fallbacks. With no table for these ranks, sifar while it fits the slot.
    """
    if plan.explicit:
        if nbytes > plan.slot:
            fallback_or_raise(what + too_large(nbytes, plan), algorithm=plan.algorithm, api=api)
        return plan
    pick = autotable.choice(plan.comms[0], plan.nranks, nbytes)
    if pick == autotable.PSUM:
        return quiet(f"the auto table hands {nbytes}-byte payloads over {plan.nranks} ranks "
                     f"to lax.psum")
    if nbytes > plan.slot:
        return quiet(what + too_large(nbytes, plan))
    if pick is not None and pick != plan.algorithm:
        return dataclasses.replace(plan, algorithm=pick)
    return plan


def payload_choice(plan: Plan, size: int, dtype, algorithm: str, api: str) -> Plan | Fallback:
    """How an array of `size` elements of `dtype` runs under `plan` (the rule
    sifar_psum applies to each leaf, and allreduce_choice reports): empty
    arrays and dtypes sifar does not sum go to lax.psum, the rest as
    `choose` says for its padded size."""
    dtype = jnp.dtype(jnp.int32 if jnp.dtype(dtype) == np.bool_ else dtype)
    if size == 0:
        return Fallback("an empty array: nothing to add", chosen=True)
    if dtype not in SUPPORTED_DTYPES:
        return fallback_or_raise(f"dtype {dtype} is not summed natively", algorithm=algorithm,
                                 api=api, error=unsupported_dtype(dtype, api, algorithm))
    return choose(plan, padded_bytes(size, dtype), api)


def padded_bytes(size: int, dtype) -> int:
    """Bytes of `size` elements rounded up to whole 16-byte lines."""
    return -(-size * jnp.dtype(dtype).itemsize // LINE) * LINE


# ---------------------------------------------------------------------- axes --
def axes_of(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _psum_unbound_text(axis_name, fallback: str) -> str:
    """lax.psum's own words for an unbound axis ("Found an unbound axis name:
    x. ..."), so that code matching them matches ours; `fallback` (JAX's
    core text, "unbound axis name: x") if lax.psum says nothing here."""
    try:
        jax.eval_shape(lambda v: lax_psum(v, axis_name), jax.ShapeDtypeStruct((), jnp.float32))
    except NameError as e:
        return str(e)
    except Exception:  # noqa: BLE001 - any other complaint: JAX's core text will do
        pass
    return fallback


def axis_size(axis_name, api: str = "sifar_psum") -> int:
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError as e:
        raise UnboundAxisError(
            f"sifar_jax.{api}: {_psum_unbound_text(axis_name, str(e))} (axis {axis_name!r} is "
            f"not bound here; call it inside jax.shard_map over a mesh that has this axis, or "
            f"jax.vmap(..., axis_name=...))"
        ) from e


def _multicast_refusal(comms) -> str | None:
    """Why these communicators cannot use multicast (None if all can)."""
    for c in comms:
        why = _ext.lib.comm_multicast_refusal(c.comm_id)
        if why:
            return why
    return None


def _pick(algorithm: str, comms) -> str:
    # "auto" only ever picks an algorithm that is correct by construction:
    # sifar (multicast's flag check is the paper's, not exact), or what the
    # auto table chooses per payload (choose: exact algorithms only).
    return algorithms.SIFAR if algorithm == algorithms.AUTO else algorithm


def _comms_for(axes: tuple, nranks: int) -> tuple:
    found = comm.communicators(axes[0]) if len(axes) == 1 else comm.communicators_over(axes)
    return tuple(c for c in found if c.nranks == nranks)


def _why_not(axes: tuple, nranks: int) -> str | None:
    key = axes[0] if len(axes) == 1 else axes
    reasons = [u.reason for u in comm.unsupported(key) if u.nranks == nranks]
    return reasons[0] if reasons else None


def route(axes: tuple, algorithm: str, api: str) -> tuple[Plan | Fallback, tuple]:
    """Which communicator serves a reduction over the mesh axes `axes`, at
    trace time (the axes' sizes are the bound ones).

    Returns (plan, rest): sifar reduces over plan.axes, lax.psum over `rest`;
    a Fallback instead of the plan when sifar serves none of them ("auto";
    a named algorithm raises). The decision is `route_sizes`'.
    """
    sizes = {a: axis_size(a, api) for a in axes}
    partitioned = _jax_compat.partitioned_axes()
    if partitioned:
        return fallback_or_raise(partially_manual(partitioned), algorithm=algorithm,
                                 api=api), axes
    return route_sizes(axes, sizes, algorithm, api)


def _not_initialised(axes: tuple, n: int, api: str) -> NotInitializedError:
    return NotInitializedError(
        f"sifar_jax.{api}: no communicator for axis {axes[0] if len(axes) == 1 else axes!r} "
        f"of size {n}; call sifar_jax.init(mesh) with the mesh you pass to shard_map first")


def route_sizes(axes: tuple, sizes: dict, algorithm: str, api: str
                ) -> tuple[Plan | Fallback, tuple]:
    """route's decision for axes of the given sizes (also what
    sifar_jax.allreduce_choice asks outside a trace). Several axes share one
    communicator where init made it and their devices reach each other
    (always on the CPU); otherwise sifar takes the axes that have their own
    communicator (the NVLink ones) and lax.psum the others."""
    n = math.prod(sizes[a] for a in axes)
    comms = _comms_for(axes, n)
    rest: tuple = ()
    reason = None
    if not comms:
        reason = _why_not(axes, n)
        if reason is None:
            raise _not_initialised(axes, n, api)
        if reason == comm.NOT_MADE:  # the user's choice at init: say what to pass
            text = comm.not_made_text(axes)
            return (quiet(text) if algorithm == algorithms.AUTO else
                    fallback_or_raise(text, algorithm=algorithm, api=api)), axes
        served = tuple(a for a in axes if len(axes) > 1 and _comms_for((a,), sizes[a]))
        for part in ([served] if len(served) > 1 else []) + [(a,) for a in served]:
            comms = _comms_for(part, math.prod(sizes[a] for a in part))
            if comms:
                axes, rest = part, tuple(a for a in axes if a not in part)
                n = math.prod(sizes[a] for a in part)
                break
    if not comms:
        return fallback_or_raise(reason, algorithm=algorithm, api=api), axes

    chosen = _pick(algorithm, comms)
    if chosen == algorithms.MULTICAST:
        multicast.require_enabled()  # the guard: a clear error while multicast is off
        if comms[0].platform != "cuda":
            return (fallback_or_raise("multicast needs NVLink GPUs", algorithm=algorithm, api=api),
                    axes + rest)
        why = _multicast_refusal(comms)
        if why:
            raise multicast.MulticastDisabledError(f"sifar_jax: algorithm 'multicast' refused: {why}")
    return Plan(tuple(comms), chosen, n, tuple(axes), algorithm != algorithms.AUTO), rest


def plan_array(x, axis_name, algorithm: str, api: str) -> Plan | Fallback:
    """One array over one axis (sifar_psum_into, psum_add_rmsnorm,
    benchmarking.psum_repeated): a Plan with its padding and chain, or a
    Fallback (only for "auto": a named algorithm raises)."""
    algorithms.validate(algorithm)
    dtype = jnp.dtype(x.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise unsupported_dtype(dtype, api, algorithm)
    axes = axes_of(axis_name)
    if len(axes) != 1:
        return fallback_or_raise(
            "reducing over several axes at once is not supported here", algorithm=algorithm,
            api=api,
            error=ValueError(f"sifar_jax.{api}(algorithm={algorithm!r}): reduces over one axis only"))
    plan, _ = route(axes, algorithm, api)
    if isinstance(plan, Fallback):
        return plan
    padded = padded_bytes(x.size, dtype)
    plan = choose(plan, padded, api)
    if isinstance(plan, Fallback):
        return plan
    pad = (padded - x.size * dtype.itemsize) // dtype.itemsize
    return dataclasses.replace(plan, pad=pad, chain=ordering.chain_id(x, plan.scope))


def flatten(x, plan: Plan):
    """x as the 1-D payload of whole lines the plan was made for."""
    flat = x.reshape(-1)
    return jnp.pad(flat, (0, plan.pad)) if plan.pad else flat


def unflatten(out, x, plan: Plan):
    """The payload `out` back in x's shape."""
    if plan.pad:
        out = out[: x.size]
    return out.reshape(x.shape)
