"""Communicators: `init(mesh)` sets one up for every axis of a mesh.

A communicator for axis `a` holds one group of ranks per line of devices
along `a` (rank = position along the axis = `lax.axis_index(a)`), and on each
device a symmetric workspace (two payload slots plus epoch and signal words).
The FFI handler finds its group and rank from the device it runs on.

A communicator over several axes at once, e.g. ("dp", "tp") (one group per
block of devices spanned by them, ranks in the mesh's axis order), is made by
`init` too: for every product of the mesh's axes of more than one device by
default, or for those given as `init(mesh, products=[...])`. Nothing is made
while a function is traced (that would allocate, and across processes
exchange keys, in the middle of a trace).

Memory. Each device reserves `workspace_bytes(slot_bytes, nranks, lanes)` per
communicator it belongs to (one per mesh axis and product of axes): lanes x 2 slots, each with the
plain payload, twoshot's reduced piece and the epoch-tagged words (twice the
payload per rank), so about lanes x (4 + 4 x nranks) x slot_bytes plus 128 KiB
of call trace: 3.1 MiB for 2 ranks and 9.1 MiB for 8 ranks at the default
64 KiB slot and 4 lanes.

Life cycle. `shutdown()` waits until nothing runs on any device of any
communicator, then returns the workspaces to a process-wide pool instead of
freeing them: an executable compiled before may hold their addresses (XLA
records kernel arguments into CUDA graphs) and may run again, so that memory
must stay valid. `init()` for the same axis, devices and slot size takes the
pooled memory back (zeroed, so every rank restarts its epochs together);
another slot size allocates anew. The pool therefore holds at most one
workspace per (axis, devices, slot size) ever used (more only if several
communicators of one axis lived at once). `shutdown(release_memory=True)`
frees the pool: only do that when no executable compiled before will run
again (re-trace and recompile everything that uses sifar_jax). Communicators
spanning processes pool their shared workspaces the same way, and take them
back when every process agrees (sifar_jax/distributed.py, "Pooling").
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import math
import threading
import warnings

import jax

from . import _ext, _jax_compat, algorithms, architectures, autotable, distributed
from .device_groups import groups as _groups
from .device_groups import platform as _platform
from .device_groups import why_unsupported as _why_unsupported

from .defaults import DEFAULT_LANES, DEFAULT_SLOT_BYTES, DEFAULT_TIMEOUT_S  # noqa: F401


@dataclasses.dataclass(frozen=True)
class Communicator:
    axis_name: str | tuple[str, ...]  # a tuple: one communicator over several axes
    axis_key: int
    comm_id: int
    platform: str  # "cpu" or "cuda"
    nranks: int
    slot_bytes: int
    groups: tuple[tuple[int, ...], ...]  # device ids, rank order
    lanes: int = DEFAULT_LANES
    # The processes whose devices it spans; () when they are all this process's
    # (sifar_jax.distributed).
    processes: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """An axis sifar_psum cannot serve; "auto" falls back to lax.psum."""

    axis_name: str | tuple[str, ...]
    nranks: int
    reason: str


_lock = threading.RLock()
_axis_keys: dict[str, int] = {}
_comms: dict[str, list[Communicator]] = {}
_unsupported: dict[str, list[Unsupported]] = {}
# {algorithm: [calls, retries, timeouts]} of communicators a re-init replaced.
_retired: dict[str, list[int]] = {}
# The shapes ((axis, size), ...) of the meshes init set up since the last shutdown.
_mesh_shapes: set[tuple] = set()
_settings = {"skew": (0, 0), "timeout_s": DEFAULT_TIMEOUT_S}


def _axis_key(name: str) -> int:
    if name not in _axis_keys:
        _axis_keys[name] = len(_axis_keys) + 1
    return _axis_keys[name]


def _label(key) -> str:
    return key if isinstance(key, str) else "(" + ", ".join(key) + ")"


def wait_for_effects() -> None:
    """Waits for computations that may still use the communicators.

    On XLA:CPU sifar_psum is side-effecting, and JAX keeps the runtime token of
    a failed side-effecting computation: every later effects_barrier re-raises
    that (already reported) error. Forget it, so shutdown() and init() work
    after a failure.
    """
    try:
        jax.effects_barrier()
    except Exception:  # noqa: BLE001 - the failing call already raised it
        try:
            _jax_compat.forget_runtime_tokens()
        except Exception:  # noqa: BLE001 - private API moved: nothing more to do
            pass


def _failure_reported(error: Exception) -> bool:
    """Whether a computation's error is a communicator's failure, which the failing call
    raised and sifar_jax.check() reports (a communicator records it)."""
    return "sifar_jax" in str(error) and any(
        _ext.lib.comm_failure(c.comm_id) for c in communicators())


def _at_exit() -> None:
    """At interpreter exit, before JAX's own exit hooks (registered at `import jax`, before
    this module's, so they run after it): waits for the computations still running, then
    frees what sifar_jax.distributed holds (shared workspaces must outlive the computations
    that use them; its release handshake needs jax.distributed, which JAX's hook shuts down).

    A communicator's failure was raised by the failing call and is reported by check(); JAX
    keeps the failed computation's runtime token and its exit hooks would raise it again, as
    two 'Exception ignored in atexit callback' tracebacks. That token is forgotten here, as
    shutdown() does; any other failed computation's is left to JAX to report."""
    try:
        jax.effects_barrier()
    except Exception as e:  # noqa: BLE001 - a computation's error, raised to its caller before
        if _failure_reported(e):
            try:
                _jax_compat.forget_runtime_tokens()
            except Exception:  # noqa: BLE001 - private API moved: JAX reports it as before
                pass
    distributed.at_exit()


atexit.register(_at_exit)


def _retire(c: Communicator) -> None:
    """Keeps the counts of a communicator about to be destroyed by a re-init,
    so that stats() totals survive it (shutdown() starts them again)."""
    for rank in _ext.lib.comm_stats(c.comm_id):
        for name, i in algorithms.IDS.items():
            row = _retired.setdefault(name, [0] * len(rank[i]))
            for f, v in enumerate(rank[i]):
                row[f] += int(v)


def retired_counts() -> dict:
    """{algorithm: [calls, retries, timeouts]} of communicators re-inits replaced."""
    with _lock:
        return {name: list(row) for name, row in _retired.items()}


def _drop_overlapping(axis, devices: set[int]) -> list[Communicator]:
    """A device serves one communicator per axis name: a new mesh that reuses
    devices under the same axis name replaces the communicators it overlaps.
    Returns those it destroyed."""
    keep, dropped = [], []
    for c in _comms.get(axis, []):
        if devices.isdisjoint(d for g in c.groups for d in g):
            keep.append(c)
        else:
            wait_for_effects()
            distributed.before_destroy([c.comm_id])
            _retire(c)
            _ext.lib.destroy_comm(c.comm_id)
            dropped.append(c)
    _comms[axis] = keep
    return dropped


def _settings_text(groups, slot_bytes: int, lanes: int) -> str:
    return f"devices {[list(g) for g in groups]}, slot_bytes={slot_bytes}, lanes={lanes}"


def _warn_replaced(replaced: list) -> None:
    """Says once, in one line, at the init that replaces communicators, which
    axes and what changed: code traced before for the old ones must be traced
    again. `replaced`: (axis, old communicators, new groups, slot, lanes)."""
    parts = []
    for axis, old, groups, slot_bytes, lanes in replaced:
        was = "; ".join(_settings_text(c.groups, c.slot_bytes, c.lanes) for c in old)
        parts.append(f"axis {_label(axis)!r} replaces its communicator ({was}) with a new one "
                     f"({_settings_text(groups, slot_bytes, lanes)})")
    warnings.warn(
        f"sifar_jax.init: {'; '.join(parts)}; functions traced before this init were planned for "
        f"the old ones: trace them again (a new jax.jit, or jax.clear_caches())", stacklevel=3)


def _round_slot(slot_bytes: int) -> int:
    slot_bytes = -(-int(slot_bytes) // 16) * 16
    if slot_bytes <= 0:
        raise ValueError("sifar_jax: slot_bytes must be positive")
    return slot_bytes


def _check_lanes(lanes: int, api: str) -> int:
    if not 1 <= int(lanes) <= 64:
        raise ValueError(f"sifar_jax.{api}: lanes must be 1..64")
    return int(lanes)


def workspace_bytes(slot_bytes: int = DEFAULT_SLOT_BYTES, nranks: int = 2,
                    lanes: int = DEFAULT_LANES) -> int:
    """Device memory each rank of one communicator reserves: for `slot_bytes`
    (rounded up to 16 bytes as init does), an axis of `nranks` devices and
    `lanes` lanes (the arguments of init)."""
    if not 1 <= int(nranks) <= _ext.lib.max_ranks():
        raise ValueError(f"sifar_jax.workspace_bytes: nranks must be 1..{_ext.lib.max_ranks()}")
    return int(_ext.lib.workspace_bytes(_round_slot(slot_bytes), int(nranks),
                                           _check_lanes(lanes, "workspace_bytes")))


# ------------------------------------------------------------------ products --
NOT_MADE = "init made no communicator over this product of axes"


def product_key(axes) -> tuple[str, ...]:
    """A product of axes as init keys it: as named (its ranks are row-major
    over the axes in that order, like lax.axis_index(axes))."""
    return tuple(axes)


def _big_axes(mesh) -> list[str]:
    return [a for a in mesh.axis_names if mesh.shape[a] > 1]


# Up to this many axes of more than one device, init makes every ordering of
# every product by default (2 axes: 2 communicators; 3 axes: 12); past it only
# the mesh's own order (the orderings grow factorially).
ALL_ORDERINGS_UP_TO = 3


def _all_products(mesh, orderings: bool | None = None) -> list[tuple[str, ...]]:
    big = _big_axes(mesh)
    if orderings is None:
        orderings = len(big) <= ALL_ORDERINGS_UP_TO
    pick = itertools.permutations if orderings else itertools.combinations
    return [c for k in range(2, len(big) + 1) for c in pick(big, k)]


def products_for(mesh, products) -> list[tuple[str, ...]]:
    """The products of axes init makes communicators over: by default every
    product of two or more axes of more than one device, in every order (the
    mesh's order only past ALL_ORDERINGS_UP_TO such axes), or those named
    (size-1 axes dropped: they add nothing to a sum)."""
    if products is None:
        return _all_products(mesh)
    out = []
    for p in products:
        p = (p,) if isinstance(p, str) else tuple(p)
        bad = [a for a in p if a not in mesh.axis_names]
        if bad or len(set(p)) != len(p):
            raise ValueError(f"sifar_jax.init: products: {p!r} must name distinct axes of the "
                             f"mesh {tuple(mesh.axis_names)}")
        key = tuple(a for a in p if mesh.shape[a] > 1)
        if len(key) > 1 and key not in out:
            out.append(key)
    return out


def _note_not_made(mesh, made: list) -> None:
    """Records, for unsupported(), each product of this mesh's axes init did not make."""
    for key in _all_products(mesh, orderings=True):
        if key in made:
            _unsupported[key] = [u for u in _unsupported.get(key, []) if u.reason != NOT_MADE]
            continue
        n = math.prod(mesh.shape[a] for a in key)
        u = Unsupported(key, n, NOT_MADE)
        if u not in _unsupported.get(key, []):
            _unsupported.setdefault(key, []).append(u)


def not_made_text(axes, algorithm: str | None = None) -> str:
    want = list(axes)
    return (f"{NOT_MADE} {tuple(axes)!r}: pass it to init, e.g. sifar_jax.init(mesh, "
            f"products=[{tuple(want)!r}]) (init makes every product by default)")


# ---------------------------------------------------------------------- init --
def _axis_groups(mesh, axis):
    """The device groups of `axis` this process sets up (None: none of its own)."""
    groups = _groups(mesh, axis)
    if not distributed.spans_processes(groups):
        # Every group lies in one process: each serves its own groups.
        groups = [g for g in groups if g[0].process_index == jax.process_index()]
    return groups or None


def _init_axis(mesh, axis, slot_bytes: int, keep_slot: bool, lanes: int) -> tuple | None:
    """Sets up the communicator of one axis (or product of axes); returns what
    it replaced, (axis, old, groups, slot, lanes), or None."""
    groups = _axis_groups(mesh, axis)
    if groups is None:
        return None
    ids = tuple(tuple(d.id for d in g) for g in groups)
    platform = _platform(groups[0][0])
    if any(c.groups == ids and (keep_slot or c.slot_bytes == slot_bytes)
           and c.lanes == lanes for c in _comms.get(axis, [])):
        return None  # already set up: init is idempotent
    old = _drop_overlapping(axis, {d for g in ids for d in g})
    replaced = (axis, old, ids, slot_bytes, lanes) if old and len(ids[0]) > 1 else None
    reason = _why_unsupported(groups, platform)
    shared = None  # (comm id, processes) of an axis spanning processes
    if reason is None and distributed.spans_processes(groups):
        shared = distributed.create_comm(platform, _axis_key(axis), _label(axis), groups,
                                         slot_bytes, _settings["timeout_s"], lanes)
        if shared is None:
            return replaced  # no device of this process lies on the axis
        if isinstance(shared, str):  # every process falls back, for the same reason
            reason, shared = shared, None
    if reason is not None:
        u = Unsupported(axis, len(groups[0]), reason)
        if u not in _unsupported.get(axis, []):
            _unsupported.setdefault(axis, []).append(u)
        if reason.startswith(architectures.REASON_PREFIX):  # a GPU this build lacks
            warnings.warn(f"sifar_jax.init: axis {_label(axis)!r} falls back to lax.psum: "
                          f"{reason}", stacklevel=3)
        return replaced
    key = _axis_key(axis)
    comm_id, processes = shared or (_ext.lib.create_comm(
        platform, key, _label(axis), [[distributed.device_ordinal(d) for d in g] for g in groups],
        slot_bytes, _settings["timeout_s"], lanes), ())
    if _settings["skew"] != (0, 0):
        _ext.lib.testing.set_skew(comm_id, *_settings["skew"])
    _comms.setdefault(axis, []).append(
        Communicator(axis, key, comm_id, platform, len(groups[0]), slot_bytes, ids, lanes,
                     processes))
    return replaced


def init(mesh, *, slot_bytes: int | None = None, timeout_s: float | None = None,
         lanes: int | None = None, auto_table=None, products=None) -> None:
    """Sets up a communicator for every axis of `mesh`, and for products of
    its axes (reductions over several axes at once). Idempotent.

    Calling it with another mesh that reuses devices under the same axis name,
    or with other settings, replaces their communicators and says so in one
    warning line naming the axes and the old and new settings (functions
    traced for the old ones raise a clear error when they run, until traced
    again). stats() keeps the replaced communicators' counts.

    slot_bytes: the largest payload (per all-reduce, per device) served without
      falling back to `lax.psum`; rounded up to 16 bytes. Default 64 KiB; when
      omitted, an axis already set up keeps its slot. Each device reserves
      `workspace_bytes(slot_bytes, nranks, lanes)` per communicator (module docstring).
    timeout_s: bound on every wait for a peer (default $SIFAR_TIMEOUT_S or 5 s).
    lanes: independent call chains that may be in flight at once (default 4):
      each lane holds its own epochs and dual slots (memory grows with it).
    auto_table: a file written by `python -m bench.allreduce --write-auto-table`
      (or a sifar_jax.autotable.Table): what algorithm="auto" runs per payload
      size and group size, for the platform it was measured on, in place of
      $SIFAR_AUTO_TABLE and the built-in table (sifar_jax.autotable).
    products: the tuples of axes that sifar_psum may reduce over at once, e.g.
      [("dp", "tp")]; None (the default) makes every combination of two or more
      axes of more than one device (a 2-axis mesh: one; 3 axes: four), () none.
      Communicators are only made here, never while a function is traced: a
      reduction over a product init did not make raises for a named algorithm
      (saying what to pass here) and goes to lax.psum under "auto" (the reason
      in unsupported()).
    """
    if auto_table is not None:
        autotable.use(auto_table)
    lanes = _check_lanes(DEFAULT_LANES if lanes is None else lanes, "init")
    keep_slot = slot_bytes is None
    slot_bytes = _round_slot(DEFAULT_SLOT_BYTES if keep_slot else slot_bytes)
    made = products_for(mesh, products)
    with _lock:
        if timeout_s is not None:
            set_timeout(timeout_s)  # existing communicators too
        _note_not_made(mesh, made)
        _mesh_shapes.add(tuple((a, int(mesh.shape[a])) for a in mesh.axis_names))
        replaced = []
        for axis in [*mesh.axis_names, *made]:  # a loop: the warnings' stack levels hold
            r = _init_axis(mesh, axis, slot_bytes, keep_slot, lanes)
            if r is not None:
                replaced.append(r)
        if replaced:
            _warn_replaced(replaced)


def shutdown(release_memory: bool = False) -> None:
    """Destroys every communicator; returns once nothing runs on their devices.

    Their workspaces go back to the pool (module docstring), so executables
    compiled before stay safe to run. release_memory=True also frees the pool:
    only when no executable compiled before will run again.
    """
    with _lock:
        wait_for_effects()
        distributed.before_destroy([c.comm_id for cs in _comms.values() for c in cs])
        _ext.lib.destroy_all()
        _comms.clear()
        _unsupported.clear()
        _retired.clear()
        _mesh_shapes.clear()
        if release_memory:
            _ext.lib.release_pooled_memory()
            distributed.release_pooled()


def communicators(axis_name=None) -> list[Communicator]:
    with _lock:
        if axis_name is None:
            return [c for cs in _comms.values() for c in cs]
        if isinstance(axis_name, (tuple, list)) and len(axis_name) > 1:
            axis_name = product_key(axis_name)
        elif isinstance(axis_name, (tuple, list)):
            axis_name = axis_name[0]
        return list(_comms.get(axis_name, []))


def communicators_over(axes: tuple[str, ...]) -> list[Communicator]:
    """Communicators over the product of several axes (in this order), as init
    made them: never made here (a trace must not allocate or exchange keys)."""
    axes = tuple(axes)
    if len(set(axes)) != len(axes):
        raise ValueError(f"sifar_jax: repeated axis in {axes}")
    with _lock:
        return communicators(product_key(axes))


def initialised_mesh(shape: tuple) -> bool:
    """Whether init set up a mesh of this shape ((axis, size), ... in order)."""
    with _lock:
        return tuple(shape) in _mesh_shapes


def unsupported(axis_name=None) -> list[Unsupported]:
    """The axes handed to lax.psum, and why (every axis when axis_name is None)."""
    with _lock:
        if axis_name is None:
            return [u for us in _unsupported.values() for u in us]
        if isinstance(axis_name, (tuple, list)) and len(axis_name) > 1:
            axis_name = product_key(axis_name)
        elif isinstance(axis_name, (tuple, list)):
            axis_name = axis_name[0]
        return list(_unsupported.get(axis_name, []))


def skew() -> tuple[int, int]:
    """The injected skew (max_ns, seed) every communicator gets (testing.inject_skew)."""
    with _lock:
        return _settings["skew"]


def timeout_s() -> float:
    """The bound on every wait for a peer, in seconds (init's timeout_s, testing.timeout)."""
    with _lock:
        return _settings["timeout_s"]


def set_skew(max_ns: int, seed: int) -> None:
    with _lock:
        _settings["skew"] = (int(max_ns), int(seed))
        for c in communicators():
            _ext.lib.testing.set_skew(c.comm_id, int(max_ns), int(seed))


def set_timeout(seconds: float) -> None:
    with _lock:
        _settings["timeout_s"] = float(seconds)
        for c in communicators():
            _ext.lib.set_timeout(c.comm_id, float(seconds))
