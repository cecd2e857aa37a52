"""Communicators: `init(mesh)` sets one up for every axis of a mesh.

A communicator for axis `a` holds one group of ranks per line of devices
along `a` (rank = position along the axis = `lax.axis_index(a)`), and on each
device a symmetric workspace (two payload slots plus epoch and signal words).
The FFI handler finds its group and rank from the device it runs on.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import jax
import numpy as np

from . import _ext, distributed

DEFAULT_SLOT_BYTES = 64 * 1024
# Lanes per communicator: independent call chains (a scan body and its caller,
# executables run from several threads) that may be in flight at once without
# sharing epochs or slots (docs/design.md, "Ordering").
DEFAULT_LANES = 4
DEFAULT_TIMEOUT_S = float(os.environ.get("SIFAR_TIMEOUT_S", "5.0"))


@dataclasses.dataclass(frozen=True)
class Communicator:
    axis_name: str
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

    axis_name: str
    nranks: int
    reason: str


_lock = threading.RLock()
_axis_keys: dict[str, int] = {}
_comms: dict[str, list[Communicator]] = {}
_unsupported: dict[str, list[Unsupported]] = {}
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


def _groups(mesh, axis: str) -> list[list]:
    devs = np.moveaxis(np.asarray(mesh.devices), mesh.axis_names.index(axis), -1)
    return [list(row) for row in devs.reshape(-1, devs.shape[-1])]


def _why_unsupported(groups: list[list], platform: str | None) -> str | None:
    n = len(groups[0])
    if platform is None:
        return f"no sifar_jax handler for platform {groups[0][0].platform!r}"
    if platform not in _ext.register():
        return f"sifar_jax was built without its {platform} backend"
    if n > _ext._sifar.max_ranks():
        return f"axis has {n} devices; sifar_jax supports up to {_ext._sifar.max_ranks()}"
    if distributed.spans_processes(groups):
        return None  # decided with the other processes (sifar_jax.distributed)
    if platform == "cuda":
        for g in groups:
            for a in g:
                for b in g:
                    if a is not b and not _ext._sifar.cuda_can_access_peer(
                        a.local_hardware_id, b.local_hardware_id
                    ):
                        return f"GPUs {a.id} and {b.id} cannot reach each other over P2P"
    return None


def _wait_for_effects() -> None:
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
            from jax._src import dispatch

            tokens = dispatch.runtime_tokens
            for tok in [*tokens.current_tokens.values(), *tokens.output_runtime_tokens.values()]:
                try:
                    tok.block_until_ready()
                except Exception:  # noqa: BLE001
                    pass
            tokens.clear()
        except Exception:  # noqa: BLE001 - private API moved: nothing more to do
            pass


def _drop_overlapping(axis: str, devices: set[int]) -> None:
    """A device serves one communicator per axis name: a new mesh that reuses
    devices under the same axis name replaces the communicators it overlaps."""
    keep = []
    for c in _comms.get(axis, []):
        if devices.isdisjoint(d for g in c.groups for d in g):
            keep.append(c)
        else:
            _wait_for_effects()
            distributed.before_destroy([c.comm_id])
            _ext._sifar.destroy_comm(c.comm_id)
    _comms[axis] = keep


def init(mesh, *, slot_bytes: int | None = None, timeout_s: float | None = None,
         lanes: int | None = None) -> None:
    """Sets up a communicator for every axis of `mesh`. Idempotent.

    Calling it with another mesh that reuses devices under the same axis name
    replaces their communicators (functions traced for the old mesh then raise
    a clear error until re-traced).

    slot_bytes: the largest payload (per all-reduce, per device) served without
      falling back to `lax.psum`; rounded up to 16 bytes. Default 64 KiB; when
      omitted, an axis already set up keeps its slot.
    timeout_s: bound on every wait for a peer (default $SIFAR_TIMEOUT_S or 5 s).
    lanes: independent call chains that may be in flight at once (default 4):
      each lane holds its own epochs and dual slots (memory grows with it).
    """
    lanes = DEFAULT_LANES if lanes is None else int(lanes)
    if not 1 <= lanes <= 64:
        raise ValueError("sifar_jax.init: lanes must be 1..64")
    keep_slot = slot_bytes is None
    slot_bytes = -(-int(DEFAULT_SLOT_BYTES if keep_slot else slot_bytes) // 16) * 16
    if slot_bytes <= 0:
        raise ValueError("sifar_jax.init: slot_bytes must be positive")
    with _lock:
        if timeout_s is not None:
            set_timeout(timeout_s)  # existing communicators too
        for axis in mesh.axis_names:
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
            _drop_overlapping(axis, {d for g in ids for d in g})
            reason = _why_unsupported(groups, platform)
            shared = None  # (comm id, processes) of an axis spanning processes
            if reason is None and distributed.spans_processes(groups):
                shared = distributed.create_comm(platform, _axis_key(axis), axis, groups,
                                                 slot_bytes, _settings["timeout_s"], lanes)
                if shared is None:
                    continue  # no device of this process lies on the axis
                if isinstance(shared, str):  # every process falls back, for the same reason
                    reason, shared = shared, None
            if reason is not None:
                _unsupported.setdefault(axis, []).append(Unsupported(axis, len(groups[0]), reason))
                continue
            key = _axis_key(axis)
            comm_id, processes = shared or (_ext._sifar.create_comm(
                platform,
                key,
                axis,
                [[distributed.device_ordinal(d) for d in g] for g in groups],
                slot_bytes,
                _settings["timeout_s"],
                lanes,
            ), ())
            if _settings["skew"] != (0, 0):
                _ext._sifar.set_skew(comm_id, *_settings["skew"])
            _comms.setdefault(axis, []).append(
                Communicator(axis, key, comm_id, platform, len(groups[0]), slot_bytes, ids, lanes,
                             processes)
            )


def shutdown() -> None:
    """Frees every communicator. Do not call while computations using them run."""
    with _lock:
        _wait_for_effects()
        distributed.before_destroy([c.comm_id for cs in _comms.values() for c in cs])
        _ext._sifar.destroy_all()
        _comms.clear()
        _unsupported.clear()


def communicators(axis_name: str | None = None) -> list[Communicator]:
    with _lock:
        if axis_name is None:
            return [c for cs in _comms.values() for c in cs]
        return list(_comms.get(axis_name, []))


def unsupported(axis_name: str) -> list[Unsupported]:
    with _lock:
        return list(_unsupported.get(axis_name, []))


def set_skew(max_ns: int, seed: int) -> None:
    with _lock:
        _settings["skew"] = (int(max_ns), int(seed))
        for c in communicators():
            _ext._sifar.set_skew(c.comm_id, int(max_ns), int(seed))


def set_timeout(seconds: float) -> None:
    with _lock:
        _settings["timeout_s"] = float(seconds)
        for c in communicators():
            _ext._sifar.set_timeout(c.comm_id, float(seconds))
