"""Communicators: `init(mesh)` sets one up for every axis of a mesh.

A communicator for axis `a` holds one group of ranks per line of devices
along `a` (rank = position along the axis = `lax.axis_index(a)`), and on each
device a symmetric workspace (two payload slots plus epoch and signal words).
The FFI handler finds its group and rank from the device it runs on.

A communicator over several axes at once, e.g. ("dp", "tp") (one group per
block of devices spanned by them, rank = `lax.axis_index(("dp", "tp"))`), is
made when sifar_psum first reduces over that tuple (`communicators_over`), and
made again by every later `init` of a mesh that has those axes.

Memory. Each device reserves `workspace_bytes(slot_bytes, nranks, lanes)` per
communicator it belongs to (one per mesh axis): lanes x 2 slots, each with the
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

import dataclasses
import math
import threading
import warnings

import jax
import numpy as np

from . import _ext, _jax_compat, architectures, autotable, distributed

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
_meshes: list = []  # (mesh, slot_bytes, lanes) of every init since the last shutdown
_products: set[tuple[str, ...]] = set()  # axis tuples ever reduced over (kept by shutdown)
_settings = {"skew": (0, 0), "timeout_s": DEFAULT_TIMEOUT_S}


def _axis_key(name: str) -> int:
    if name not in _axis_keys:
        _axis_keys[name] = len(_axis_keys) + 1
    return _axis_keys[name]


def _platform(device) -> str | None:
    if device.platform == "cpu":
        return "cpu"
    if device.platform == "gpu" and "cuda" in device.client.platform_version.lower():
        return "cuda"
    return None


def _groups(mesh, axes) -> list[list]:
    """Device groups along `axes` (a name or a tuple), in rank order: row-major
    over the axes in the order given, like lax.axis_index(axes)."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    where = [mesh.axis_names.index(a) for a in axes]
    devs = np.moveaxis(np.asarray(mesh.devices), where, range(-len(axes), 0))
    size = math.prod(devs.shape[-len(axes):])
    return [list(row) for row in devs.reshape(-1, size)]


def _label(key) -> str:
    return key if isinstance(key, str) else "(" + ", ".join(key) + ")"


def _why_unsupported(groups: list[list], platform: str | None) -> str | None:
    n = len(groups[0])
    if platform is None:
        return f"no sifar_jax handler for platform {groups[0][0].platform!r}"
    if platform not in _ext.PLATFORMS:
        return f"sifar_jax was built without its {platform} backend"
    if n > _ext.lib.max_ranks():
        return f"axis has {n} devices; sifar_jax supports up to {_ext.lib.max_ranks()}"
    if distributed.spans_processes(groups):
        return None  # decided with the other processes (sifar_jax.distributed)
    if platform == "cuda":
        why = architectures.unsupported_gpus([d for g in groups for d in g])
        if why is not None:
            return why
        for g in groups:
            for a in g:
                for b in g:
                    if a is not b and not _ext.lib.cuda_can_access_peer(
                        a.local_hardware_id, b.local_hardware_id
                    ):
                        return f"GPUs {a.id} and {b.id} cannot reach each other over P2P"
    return None


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


def _drop_overlapping(axis: str, devices: set[int]) -> list[Communicator]:
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
            _ext.lib.destroy_comm(c.comm_id)
            dropped.append(c)
    _comms[axis] = keep
    return dropped


def _settings_text(groups, slot_bytes: int, lanes: int) -> str:
    return f"devices {[list(g) for g in groups]}, slot_bytes={slot_bytes}, lanes={lanes}"


def _warn_replaced(axis, old: list[Communicator], groups, slot_bytes: int, lanes: int) -> None:
    """Says at the init that replaces communicators of `axis` what changed:
    code traced before for the old ones must be traced again."""
    was = "; ".join(_settings_text(c.groups, c.slot_bytes, c.lanes) for c in old)
    warnings.warn(
        f"sifar_jax.init: axis {_label(axis)!r} replaces its communicator ({was}) with a new one "
        f"({_settings_text(groups, slot_bytes, lanes)}); functions traced before this init "
        f"were planned for the old one: trace them again (a new jax.jit, or jax.clear_caches())",
        stacklevel=3)


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


def init(mesh, *, slot_bytes: int | None = None, timeout_s: float | None = None,
         lanes: int | None = None, auto_table=None) -> None:
    """Sets up a communicator for every axis of `mesh`. Idempotent.

    Calling it with another mesh that reuses devices under the same axis name,
    or with other settings, replaces their communicators and warns then,
    naming the axis and the old and new settings (functions traced for the old
    ones raise a clear error when they run, until traced again).

    slot_bytes: the largest payload (per all-reduce, per device) served without
      falling back to `lax.psum`; rounded up to 16 bytes. Default 64 KiB; when
      omitted, an axis already set up keeps its slot. Each device reserves
      `workspace_bytes(slot_bytes, nranks, lanes)` per axis (module docstring).
    timeout_s: bound on every wait for a peer (default $SIFAR_TIMEOUT_S or 5 s).
    lanes: independent call chains that may be in flight at once (default 4):
      each lane holds its own epochs and dual slots (memory grows with it).
    auto_table: a file written by `python -m bench.allreduce --write-auto-table`
      (or a sifar_jax.autotable.Table): what algorithm="auto" runs per payload
      size and group size, for the platform it was measured on, in place of
      $SIFAR_AUTO_TABLE and the built-in table (sifar_jax.autotable).
    """
    if auto_table is not None:
        autotable.use(auto_table)
    lanes = _check_lanes(DEFAULT_LANES if lanes is None else lanes, "init")
    keep_slot = slot_bytes is None
    slot_bytes = _round_slot(DEFAULT_SLOT_BYTES if keep_slot else slot_bytes)
    with _lock:
        if timeout_s is not None:
            set_timeout(timeout_s)  # existing communicators too
        _meshes[:] = [e for e in _meshes if e[0] != mesh] + [(mesh, slot_bytes, lanes)]
        products = [p for p in sorted(_products) if set(p) <= set(mesh.axis_names)]
        for axis in [*mesh.axis_names, *products]:
            groups = _groups(mesh, axis)
            if not distributed.spans_processes(groups):
                # Every group lies in one process: each serves its own groups.
                groups = [g for g in groups if g[0].process_index == jax.process_index()]
                if not groups:
                    continue
            ids = tuple(tuple(d.id for d in g) for g in groups)
            platform = _platform(groups[0][0])
            if any(c.groups == ids and (keep_slot or c.slot_bytes == slot_bytes)
                   and c.lanes == lanes for c in _comms.get(axis, [])):
                continue  # already set up: init is idempotent
            replaced = _drop_overlapping(axis, {d for g in ids for d in g})
            if replaced:
                _warn_replaced(axis, replaced, ids, slot_bytes, lanes)
            reason = _why_unsupported(groups, platform)
            shared = None  # (comm id, processes) of an axis spanning processes
            if reason is None and distributed.spans_processes(groups):
                shared = distributed.create_comm(platform, _axis_key(axis), _label(axis),
                                                 groups, slot_bytes, _settings["timeout_s"],
                                                 lanes)
                if shared is None:
                    continue  # no device of this process lies on the axis
                if isinstance(shared, str):  # every process falls back, for the same reason
                    reason, shared = shared, None
            if reason is not None:
                _unsupported.setdefault(axis, []).append(Unsupported(axis, len(groups[0]), reason))
                if reason.startswith(architectures.REASON_PREFIX):  # a GPU this build lacks
                    warnings.warn(f"sifar_jax.init: axis {_label(axis)!r} falls back to lax.psum: "
                                  f"{reason}", stacklevel=2)
                continue
            key = _axis_key(axis)
            comm_id, processes = shared or (_ext.lib.create_comm(
                platform,
                key,
                _label(axis),
                [[distributed.device_ordinal(d) for d in g] for g in groups],
                slot_bytes,
                _settings["timeout_s"],
                lanes,
            ), ())
            if _settings["skew"] != (0, 0):
                _ext.lib.set_skew(comm_id, *_settings["skew"])
            _comms.setdefault(axis, []).append(
                Communicator(axis, key, comm_id, platform, len(groups[0]), slot_bytes, ids, lanes,
                             processes)
            )


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
        _meshes.clear()
        if release_memory:
            _ext.lib.release_pooled_memory()
            distributed.release_pooled()


def communicators(axis_name=None) -> list[Communicator]:
    with _lock:
        if axis_name is None:
            return [c for cs in _comms.values() for c in cs]
        return list(_comms.get(axis_name, []))


def communicators_over(axes: tuple[str, ...]) -> list[Communicator]:
    """Communicators over the product of several axes, made on first use for
    every initialised mesh that has them (and again by each later init)."""
    axes = tuple(axes)
    if len(set(axes)) != len(axes):
        raise ValueError(f"sifar_jax: repeated axis in {axes}")
    with _lock:
        if axes not in _products:
            _products.add(axes)
            for mesh, slot_bytes, lanes in list(_meshes):
                if set(axes) <= set(mesh.axis_names):
                    init(mesh, slot_bytes=slot_bytes, lanes=lanes)
        return communicators(axes)


def unsupported(axis_name=None) -> list[Unsupported]:
    """The axes handed to lax.psum, and why (every axis when axis_name is None)."""
    with _lock:
        if axis_name is None:
            return [u for us in _unsupported.values() for u in us]
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
            _ext.lib.set_skew(c.comm_id, int(max_ns), int(seed))


def set_timeout(seconds: float) -> None:
    with _lock:
        _settings["timeout_s"] = float(seconds)
        for c in communicators():
            _ext.lib.set_timeout(c.comm_id, float(seconds))
