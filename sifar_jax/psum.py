"""`sifar_psum`: the drop-in `lax.psum` for one mesh axis inside `shard_map`."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from . import _ext, algorithms, comm, multicast, ordering
from .errors import NotInitializedError

SUPPORTED_DTYPES = tuple(jnp.dtype(n) for n in _ext._sifar.dtypes())
_LINE = 16  # bytes: the payload is moved in 16-byte lines
_warned: set[str] = set()


def _fallback(x, axis_name, reason: str):
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"sifar_jax: falling back to lax.psum: {reason}", stacklevel=3)
    return jax.lax.psum(x, axis_name)


def _axis_size(axis_name) -> int:
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError as e:
        raise ValueError(
            f"sifar_jax.sifar_psum: axis {axis_name!r} is not bound here; call it inside "
            f"jax.shard_map over a mesh that has this axis"
        ) from e


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


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one call runs: which communicators, algorithm and padding."""

    comms: list
    algorithm: str
    nranks: int
    pad: int  # elements appended to reach whole 16-byte lines
    chain: int  # the jaxpr's call chain (sifar_jax.ordering)

    @property
    def platform(self) -> str:
        return self.comms[0].platform

    def attrs(self, repeat: int = 1) -> dict:
        return dict(
            axis_key=np.int32(self.comms[0].axis_key),
            nranks=np.int32(self.nranks),
            algorithm=np.int32(algorithms.IDS[self.algorithm]),
            repeat=np.int32(repeat),
            chain=np.int32(self.chain),
        )


def _plan(x, axis_name, algorithm: str, api: str):
    """Trace-time checks. Returns a _Plan, or a string: why "auto" falls back."""
    algorithms.validate(algorithm)
    dtype = jnp.dtype(x.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"sifar_jax.{api}: dtype {dtype} is not supported; use one of "
            f"{', '.join(d.name for d in SUPPORTED_DTYPES)} (or lax.psum for other types)"
        )
    explicit = algorithm != algorithms.AUTO

    def cannot(reason: str):
        if explicit:
            raise ValueError(f"sifar_jax.{api}(algorithm={algorithm!r}): {reason}")
        return reason

    if isinstance(axis_name, (tuple, list)):
        if len(axis_name) != 1:
            return cannot("reducing over several axes at once is not supported")
        axis_name = axis_name[0]
    n = _axis_size(axis_name)

    comms = [c for c in comm.communicators(axis_name) if c.nranks == n]
    if not comms:
        unsupported = [u for u in comm.unsupported(axis_name) if u.nranks == n]
        if unsupported:
            return cannot(unsupported[0].reason)
        raise NotInitializedError(
            f"sifar_jax.{api}: no communicator for axis {axis_name!r} of size {n}; "
            f"call sifar_jax.init(mesh) with the mesh you pass to shard_map first"
        )
    chosen = _pick(algorithm, comms)
    if chosen == algorithms.MULTICAST:
        multicast.require_enabled()  # the guard: a clear error while multicast is off
        if comms[0].platform != "cuda":
            return cannot("multicast needs NVLink GPUs")
        why = _multicast_refusal(comms)
        if why:
            raise multicast.MulticastDisabledError(f"sifar_jax: algorithm 'multicast' refused: {why}")

    nbytes = x.size * dtype.itemsize
    padded = -(-nbytes // _LINE) * _LINE
    slot = min(c.slot_bytes for c in comms)
    if padded > slot:
        return cannot(
            f"payload of {padded} bytes exceeds the {slot}-byte slot "
            f"(raise it with sifar_jax.init(mesh, slot_bytes=...))"
        )
    return _Plan(comms, chosen, n, (padded - nbytes) // dtype.itemsize, ordering.chain_id(x))


def _flat(x, plan: _Plan):
    flat = x.reshape(-1)
    return jnp.pad(flat, (0, plan.pad)) if plan.pad else flat


def _unflat(out, x, plan: _Plan):
    if plan.pad:
        out = out[: x.size]
    return out.reshape(x.shape)


def sifar_psum(x, axis_name, *, algorithm: str = algorithms.AUTO, _repeat: int = 1):
    """All-reduce (sum) of `x` over the mesh axis `axis_name`, like `lax.psum`.

    Use inside `jax.shard_map` under `jax.jit`, after `sifar_jax.init(mesh)`.
    Every rank gets a bit-identical result: partials are added in rank order
    in float32 and rounded once. Supports float32, bfloat16 and float16 of any
    shape. With algorithm="auto" it falls back to `lax.psum` (warning once with
    the reason) where it cannot run; an explicitly named algorithm raises.

    `_repeat` (benchmarks only): run that many all-reduces of `x` back to back
    inside one handler call / kernel launch, the paper's kernel-level method.
    """
    x = jnp.asarray(x)
    plan = _plan(x, axis_name, algorithm, "sifar_psum")
    if isinstance(plan, str):
        return _fallback(x, axis_name, plan)
    if x.size == 0:
        return x
    flat = _flat(x, plan)
    call = jax.ffi.ffi_call(
        _ext.TARGET,
        jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        # Keeps the call when its result is unused on XLA:CPU, where a failed
        # all-reduce must still surface; ordering comes from sifar_jax.ordering.
        has_side_effect=(plan.platform == "cpu"),
    )
    out = call(flat, *ordering.operands(flat), **plan.attrs(_repeat))
    ordering.remember(flat, out)
    return _unflat(out, x, plan)
