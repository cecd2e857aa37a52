"""`replace_psum()`: existing `jax.lax.psum` calls run as `sifar_psum`.

Inside the context (or a function it decorates) `jax.lax.psum` is a function
that sends every call sifar can serve to `sifar_psum`, and every other call to
JAX's own psum, unchanged:

* served: a psum of traced values inside `shard_map` (manual over every mesh
  axis of more than one device) over axes of a mesh `sifar_jax.init` set up,
  for the leaves whose dtype sifar sums (SUPPORTED_DTYPES), where sifar_psum
  with algorithm="auto" would not fall back anyway;
* JAX's own: pmap and vmap axes, axes of a mesh init did not set up,
  `lax.psum(1, axis)` and any other constant (the axis-size idiom), other
  dtypes, `axis_index_groups`, partially manual shard_maps; and `pmean`,
  `psum_scatter` and the other collectives, which call JAX's psum directly.

What is replaced is the attribute `jax.lax.psum`, so the calls it reaches are
those that look it up when they run (`jax.lax.psum(...)`, `lax.psum(...)` with
`from jax import lax`: how third-party modules write it). A name bound before
entering with `from jax.lax import psum` keeps JAX's function. Intercepting
lower down (psum's primitive) was considered and not chosen: the same
primitive is bound by pmean, by psum's own transpose and by other JAX
internals, whose semantics must not change, and a primitive carries no record
of which public function bound it.

Tracing. The choice is made while a function is traced: a function traced
anew inside the context (a new jax.jit, or after jax.clear_caches()) uses
sifar; one traced after leaving does not; a cached trace keeps what it was
traced with, inside or outside. To see what happened, each replacing call is
logged at debug level on the "sifar_jax" logger (one line: where, axes, what
ran) and counted on the context object (`.sifar`, `.lax_psum`, `.calls`).

Which mesh: a trace sees the mesh's axis names and sizes, not its devices, so
a call is served when init set up a mesh of that shape. A mesh of the same
shape on other devices that init did not set up fails when it runs, with
sifar's error naming init (set every mesh up you trace under the context).

The replacement is process-wide while any context is open (other threads see
it too); contexts nest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading

import jax

from . import _jax_compat, algorithms, comm, plan
from ._jax_compat import lax_psum
from .errors import NotInitializedError

_lock = threading.RLock()
_open: list["replace_psum"] = []  # the contexts now open, innermost last
_HERE = os.path.dirname(os.path.abspath(__file__))
_JAX = os.path.dirname(os.path.abspath(jax.__file__))


@dataclasses.dataclass(frozen=True)
class ReplacedCall:
    """One jax.lax.psum call traced inside replace_psum."""

    where: str  # file:line of the caller
    axes: tuple
    ran: str  # "sifar_psum" or "lax.psum"
    reason: str | None = None  # why lax.psum (None for sifar_psum)


def _caller() -> str:
    """The first frame outside sifar_jax and jax: the line that called psum."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(_HERE) or path.startswith(_JAX) or "contextlib" in path):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _why_not_sifar(leaves, axes: tuple) -> str | None:
    """Why this call keeps JAX's psum (None: sifar_psum serves it)."""
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        return "constants (no communication)"
    mesh = jax.sharding.get_abstract_mesh()
    manual = _jax_compat.manual_axes()
    if mesh.empty or any(a not in manual for a in axes):
        return "not a shard_map mesh axis (vmap, or no mesh)"
    if not comm.initialised_mesh(tuple((a, int(mesh.shape[a])) for a in mesh.axis_names)):
        return "sifar_jax.init did not set this mesh up (pmap axes, other meshes)"
    if _jax_compat.partitioned_axes():
        return "the shard_map is manual over only some mesh axes"
    if len(set(axes)) != len(axes):
        return "a repeated axis (lax.psum's own error)"
    sizes = {a: int(mesh.shape[a]) for a in axes}
    big = tuple(a for a in axes if sizes[a] > 1)
    if not big:
        return None  # axes of one device: sifar_psum moves nothing
    try:
        chosen, _ = plan.route_sizes(big, sizes, algorithms.AUTO, "replace_psum")
    except NotInitializedError as e:
        return str(e)
    return chosen.reason if isinstance(chosen, plan.Fallback) else None


def _served(leaf) -> bool:
    return (isinstance(leaf, jax.core.Tracer)
            and jax.numpy.dtype(leaf.dtype) in plan.SUPPORTED_DTYPES and leaf.size > 0)


def _record(call: ReplacedCall) -> None:
    plan.log.debug("sifar_jax.replace_psum: psum over %s at %s -> %s%s", call.axes, call.where,
                   call.ran, f" ({call.reason})" if call.reason else "")
    with _lock:
        for ctx in _open:
            ctx.calls.append(call)


def psum(x, axis_name, *, axis_index_groups=None, **kwargs):
    """jax.lax.psum as replace_psum installs it: sifar_psum where it serves
    the call, JAX's own psum otherwise (module docstring). Keywords a later
    JAX may add go to JAX's psum, untouched."""
    from .psum import sifar_psum

    axes = plan.axes_of(axis_name)
    leaves, tree = jax.tree.flatten(x)
    reason = ("axis_index_groups" if axis_index_groups is not None
              else f"keywords {sorted(kwargs)}" if kwargs else _why_not_sifar(leaves, axes))
    served = [i for i, leaf in enumerate(leaves) if _served(leaf)] if reason is None else []
    if not served:
        _record(ReplacedCall(_caller(), axes, "lax.psum", reason or "dtypes sifar does not sum"))
        return lax_psum(x, axis_name, axis_index_groups=axis_index_groups, **kwargs)
    _record(ReplacedCall(_caller(), axes, "sifar_psum"))
    outs = list(leaves)
    for i, out in zip(served, sifar_psum([leaves[i] for i in served], axis_name)):
        outs[i] = out
    rest = [i for i in range(len(leaves)) if i not in served]
    if rest:
        for i, out in zip(rest, lax_psum([leaves[i] for i in rest], axis_name)):
            outs[i] = out
    return tree.unflatten(outs)


class replace_psum(contextlib.ContextDecorator):
    """Within it, `jax.lax.psum` runs as `sifar_psum` wherever sifar serves the
    call (module docstring). Use as `with sifar_jax.replace_psum() as r:` or
    as a decorator `@sifar_jax.replace_psum()`. After the block, `r.sifar` and
    `r.lax_psum` count the psum calls traced inside it that each ran, and
    `r.calls` lists them (where, axes, what ran, why)."""

    def __init__(self):
        self.calls: list[ReplacedCall] = []

    @property
    def sifar(self) -> int:
        return sum(c.ran == "sifar_psum" for c in self.calls)

    @property
    def lax_psum(self) -> int:
        return sum(c.ran == "lax.psum" for c in self.calls)

    def __enter__(self):
        with _lock:
            if not _open:
                _saved.append(jax.lax.psum)
                jax.lax.psum = psum
            _open.append(self)
        return self

    def __exit__(self, *exc):
        with _lock:
            _open.remove(self)
            if not _open:
                jax.lax.psum = _saved.pop()
        return False


_saved: list = []  # what jax.lax.psum was before the outermost context opened
