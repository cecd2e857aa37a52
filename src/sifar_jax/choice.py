"""`allreduce_choice`: which all-reduce a payload will get, asked outside a trace.

Models size their buffers and pick their code paths by whether an all-reduce
runs on sifar (a prefill past the slot, say, goes to lax.psum). This asks the
same decision code `sifar_psum` runs at trace time (sifar_jax.plan:
`route_sizes`, then `payload_choice`), on the communicators `init` made, so
no caller re-derives the slot rule.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from . import algorithms, comm
from .errors import NotInitializedError
from .plan import Fallback, axes_of, padded_bytes, payload_choice, route_sizes

_API = "allreduce_choice"


@dataclasses.dataclass(frozen=True)
class AllReduceChoice:
    """What `sifar_psum(x, axis_name, algorithm=...)` runs for one array.

    sifar: True when sifar runs it (`algorithm` says which), False for lax.psum
      (`reason` says why).
    axes: the axes sifar reduces over; psum_axes: those lax.psum reduces over
      (all of them when sifar does not run; axes of one device are in neither).
    nbytes: the payload as sifar moves it (whole 16-byte lines); slot_bytes:
      the communicator's slot (None without one).
    raises: sifar_psum raises `reason` at trace time instead of running
      lax.psum (a named algorithm that cannot run, an axis not initialised).
    """

    sifar: bool
    algorithm: str | None
    reason: str | None
    axes: tuple = ()
    psum_axes: tuple = ()
    nbytes: int = 0
    slot_bytes: int | None = None
    raises: bool = False

    def __str__(self) -> str:
        if self.sifar:
            return f"sifar ({self.algorithm}) over {self.axes}"
        return f"lax.psum: {self.reason}"


def _sizes(axes: tuple, mesh) -> dict:
    """Each axis's size: the mesh's, or that of the communicators init made
    for it (NotInitializedError where there are none)."""
    if mesh is not None:
        missing = [a for a in axes if a not in mesh.axis_names]
        if missing:
            raise ValueError(f"sifar_jax.{_API}: the mesh has no axis {missing[0]!r}")
        return {a: int(mesh.shape[a]) for a in axes}
    sizes = {}
    for a in axes:
        found = {c.nranks for c in comm.communicators(a)} | {u.nranks for u in comm.unsupported(a)}
        if not found:
            raise NotInitializedError(f"sifar_jax.{_API}: axis {a!r} is not initialised; call "
                                      f"sifar_jax.init(mesh) with a mesh that has it")
        if len(found) > 1:
            raise ValueError(f"sifar_jax.{_API}: axis {a!r} has communicators of sizes "
                             f"{sorted(found)} (several meshes); pass mesh=")
        sizes[a] = found.pop()
    return sizes


def allreduce_choice(shape, dtype, axis_name, *, algorithm: str = algorithms.AUTO,
                     mesh=None) -> AllReduceChoice:
    """Which all-reduce `sifar_psum` gives an array of `shape` and `dtype` over
    `axis_name` (a mesh axis or a tuple of them), with `algorithm`: sifar and
    which algorithm, or lax.psum and why. Call it after `sifar_jax.init`,
    outside a trace; `mesh` (optional) gives the axes' sizes where several
    initialised meshes share an axis name. A function traced before a later
    init keeps what it was traced with.
    """
    algorithms.validate(algorithm)
    axes = axes_of(axis_name)
    size = math.prod(int(d) for d in shape)
    dtype = jnp.dtype(dtype)
    try:
        sizes = _sizes(axes, mesh)
    except NotInitializedError as e:
        return AllReduceChoice(False, None, str(e), psum_axes=axes, raises=True)
    big = tuple(a for a in axes if sizes[a] > 1)
    if not big:
        return AllReduceChoice(False, None, "every axis has one device: nothing to communicate")
    try:
        plan, rest = route_sizes(big, sizes, algorithm, _API)
        if isinstance(plan, Fallback):
            return AllReduceChoice(False, None, plan.reason, psum_axes=big)
        nbytes = padded_bytes(size, jnp.int32 if dtype == jnp.bool_ else dtype)
        chosen = payload_choice(plan, size, dtype, algorithm, _API)
    except (ValueError, TypeError, NotInitializedError) as e:  # what sifar_psum raises
        return AllReduceChoice(False, None, str(e), psum_axes=big, raises=True)
    if isinstance(chosen, Fallback):
        return AllReduceChoice(False, None, chosen.reason, psum_axes=big, nbytes=nbytes,
                               slot_bytes=plan.slot)
    return AllReduceChoice(True, chosen.algorithm, None, tuple(chosen.axes), tuple(rest),
                           nbytes, plan.slot)
