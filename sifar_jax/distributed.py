"""Communicators over devices of several processes (one process per GPU).

`sifar_jax.init(mesh)` is called by every process with the same global mesh.
For an axis whose groups hold devices of several processes, the processes
that own its devices agree, through jax.distributed's key-value store, on
whether sifar can serve it:

  identity  each posts its host (hostname + boot id) and, on GPUs, the PCI
            bus id of each of its devices on the axis;
  verdict   each posts why it cannot take part ("" if it can): another host,
            a GPU it cannot see or reach over P2P. Any reason makes every
            process fall back to lax.psum with the same reason, so they all
            run the same collectives.

Then each process allocates the workspaces of its own ranks where the others
can map them (POSIX shared memory on the CPU, CUDA IPC on GPUs), posts their
handles, maps the other processes' ranks, creates its communicator and waits
until every process has done so (`ready`); only then are the shared-memory
names removed, so nothing outlives the processes. A process that never
arrives at a stage makes the others raise, naming it.

Launch several processes on one host with `python -m sifar_jax.launch`, and
call `sifar_jax.distributed.initialize()` at the start of the program.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import itertools
import json
import os
import socket
import threading
import time
import warnings

import jax

from . import _ext, _jax_compat
from .errors import SifarError

INIT_TIMEOUT_S = float(os.environ.get("SIFAR_INIT_TIMEOUT_S", "120"))
# Bound on the wait, at shutdown, for the other processes to stop using this
# process's GPU workspaces (CUDA only: shared memory on the CPU is freed by
# the kernel once its last mapping goes).
CLOSE_TIMEOUT_S = float(os.environ.get("SIFAR_CLOSE_TIMEOUT_S", "10"))
SHM_DIR = "/dev/shm"
SHM_PREFIX = "sifar_jax."  # shared-memory object names: sifar_jax.<uid>.<pid>.<n>.g<g>.r<r>


def initialize() -> bool:
    """Starts jax.distributed in a process started by `python -m sifar_jax.launch`.

    Call it first thing, before any JAX computation. Returns False (and does
    nothing) in a process the launcher did not start, so one program runs
    either way.
    """
    from . import launch  # here: `python -m sifar_jax.launch` must not find it imported

    if launch.ENV_PROCESS_ID not in os.environ:
        return False
    ids = os.environ.get(launch.ENV_LOCAL_DEVICE_IDS, "")
    jax.distributed.initialize(
        coordinator_address=os.environ[launch.ENV_COORDINATOR],
        num_processes=int(os.environ[launch.ENV_NUM_PROCESSES]),
        process_id=int(os.environ[launch.ENV_PROCESS_ID]),
        local_device_ids=[int(i) for i in ids.split(",")] if ids else None,
    )
    return True


# ------------------------------------------------------------------- stages --
def _get(client, key: str, timeout_s: float) -> str | None:
    try:
        return client.blocking_key_value_get(key, max(1, int(timeout_s * 1000)))
    except Exception as e:  # noqa: BLE001 - jax raises JaxRuntimeError(DEADLINE_EXCEEDED)
        if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e):
            return None
        raise


def _exchange(base: str, stage: str, processes, value: str, timeout_s: float,
              what: str) -> dict[int, str]:
    """Posts this process's `value` for `stage` and returns every process's.
    Raises SifarError naming the first process that does not post in time."""
    client = _jax_compat.kv_client()
    me = jax.process_index()
    client.key_value_set(f"{base}/{stage}/{me}", value)
    deadline = time.monotonic() + timeout_s
    out = {}
    for p in processes:
        got = _get(client, f"{base}/{stage}/{p}", deadline - time.monotonic())
        if got is None:
            raise SifarError(
                f"sifar_jax: process {p} did not reach '{stage}' of {what} within "
                f"{timeout_s:g} s (process {me} waited): did it crash, or call "
                f"sifar_jax.init with another mesh? Every process that owns a device of the "
                f"mesh must call sifar_jax.init(mesh) with the same mesh."
            )
        out[p] = got
    return out


def host_id() -> str:
    """Names this machine the same way in every process on it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


# ------------------------------------------------------------ shared memory --
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _shm_objects() -> list[tuple[str, int, int]]:
    """(name, owner uid, creator pid) of every sifar_jax shared-memory object."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    out = []
    for name in names:
        parts = name.split(".")  # sifar_jax.<uid>.<pid>.<n>.g<g>.r<r>
        if name.startswith(SHM_PREFIX) and len(parts) >= 4 and parts[1].isdigit() and parts[2].isdigit():
            out.append((name, int(parts[1]), int(parts[2])))
    return out


def clean_stale_shared_memory() -> list[str]:
    """Removes this user's sifar_jax shared-memory objects whose creating
    process is gone (it died between creating and unlinking them). Returns
    their names."""
    removed = []
    for name, owner, pid in _shm_objects():
        if owner != os.getuid() or pid == os.getpid() or _pid_alive(pid):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def leftover_shared_memory(pids) -> list[str]:
    """The sifar_jax shared-memory objects created by any of `pids` (tests)."""
    pids = set(pids)
    return [name for name, _, pid in _shm_objects() if pid in pids]


# ------------------------------------------------------------ communicators --
@dataclasses.dataclass(frozen=True)
class _Shared:
    base: str  # key-value prefix of its set-up
    platform: str
    processes: tuple[int, ...]
    workspaces: object  # the PeerWorkspaces (the communicator holds them too)


_lock = threading.Lock()
_setups: dict[tuple, int] = {}  # (axis, device ids) -> set-ups so far (keys stay unique)
_names = itertools.count()
_shared: dict[int, _Shared] = {}  # comm id -> how it was set up
_started = False


def device_ordinal(device) -> int:
    """The ordinal the FFI handler of `device` is called with: XLA:CPU passes
    the global device id (process i's devices are numbered from i * 2048),
    XLA:GPU the CUDA ordinal."""
    return device.id if device.platform == "cpu" else device.local_hardware_id


def spans_processes(groups) -> bool:
    """Some group holds devices of several processes."""
    return any(len({d.process_index for d in g}) > 1 for g in groups)


def _start() -> None:
    """Once per process: stale objects of dead processes go; at exit, names
    this process still publishes go."""
    global _started
    if not _started:
        _started = True
        clean_stale_shared_memory()
        atexit.register(_ext._sifar.unpublish_all)


def _gpu_ordinal(bus_ids: dict[int, str], device) -> int:
    """The CUDA ordinal, in this process, of a device of any process (-1: not visible)."""
    if device.process_index == jax.process_index():
        return device.local_hardware_id
    return _ext._sifar.cuda_device_of_pci_bus_id(bus_ids[device.id])


def _why_not_here(platform: str, groups, mine, infos: dict[int, dict]) -> str:
    """Why this process cannot share these groups' workspaces ("" if it can)."""
    me = jax.process_index()
    hosts = {p: info["host"] for p, info in infos.items()}
    other = [p for p, h in hosts.items() if h != hosts[me]]
    if other:
        return (f"the axis spans hosts (process {me} on {hosts[me].split('/')[0]}, process "
                f"{other[0]} on {hosts[other[0]].split('/')[0]}): lax.psum (NCCL) serves it")
    if platform != "cuda":
        return ""
    bus_ids = {int(k): v for info in infos.values() for k, v in info["gpus"].items()}
    for g in mine:
        for a in groups[g]:
            if a.process_index != me:
                continue
            for b in groups[g]:
                if b.process_index == me:
                    continue
                ob = _gpu_ordinal(bus_ids, b)
                if ob < 0:
                    return (f"GPU {bus_ids[b.id]} of process {b.process_index} is not visible "
                            f"to process {me}")
                if ob != a.local_hardware_id and not _ext._sifar.cuda_can_access_peer(
                        a.local_hardware_id, ob):
                    return f"GPUs {a.id} and {b.id} cannot reach each other over P2P"
    return ""


def create_comm(platform: str, axis_key: int, axis: str, groups, slot_bytes: int,
                timeout_s: float, lanes: int):
    """Sets up the communicator of an axis spanning processes, together with
    the other processes. Returns (comm id, processes), a reason to fall back
    to lax.psum (the same in every process), or None when no device of this
    process lies on the axis."""
    me = jax.process_index()
    mine = [g for g, devs in enumerate(groups) if any(d.process_index == me for d in devs)]
    if not mine:
        return None
    if _jax_compat.kv_client() is None:
        return "the axis spans several processes, but jax.distributed is not running"
    _start()
    processes = tuple(sorted({d.process_index for g in groups for d in g}))
    ids = tuple(tuple(d.id for d in g) for g in groups)
    with _lock:
        n = _setups[(axis, ids)] = _setups.get((axis, ids), 0) + 1
    base = f"sifar_jax/{axis}/{hashlib.sha1(repr(ids).encode()).hexdigest()[:12]}/{n}"

    def exchange(stage: str, value: str) -> dict[int, str]:
        return _exchange(base, stage, processes, value, INIT_TIMEOUT_S,
                         f"the set-up of axis {axis!r}")

    identity = {"host": host_id(), "gpus": {}}
    if platform == "cuda":
        identity["gpus"] = {d.id: _ext._sifar.cuda_pci_bus_id(d.local_hardware_id)
                            for g in mine for d in groups[g] if d.process_index == me}
    infos = {p: json.loads(v) for p, v in exchange("identity", json.dumps(identity)).items()}
    verdicts = exchange("verdict", _why_not_here(platform, groups, mine, infos))
    reasons = [verdicts[p] for p in processes if verdicts[p]]
    if reasons:
        return reasons[0]
    comm_id, ws = _share(platform, axis_key, axis, [groups[g] for g in mine], mine, infos,
                         slot_bytes, timeout_s, lanes, exchange)
    with _lock:
        _shared[comm_id] = _Shared(base, platform, processes, ws)
    return comm_id, processes


def _share(platform, axis_key, axis, my_groups, mine, infos, slot_bytes, timeout_s, lanes,
           exchange):
    """Allocates this process's ranks' workspaces, maps the others', creates the
    communicator; returns (comm id, the PeerWorkspaces)."""
    me = jax.process_index()
    ordinals = [[device_ordinal(d) if d.process_index == me else -1 for d in g] for g in my_groups]
    owners = [[d.process_index for d in g] for g in my_groups]
    peer_devices = []
    if platform == "cuda":
        bus_ids = {int(k): v for info in infos.values() for k, v in info["gpus"].items()}
        peer_devices = [[_gpu_ordinal(bus_ids, d) for d in g] for g in my_groups]
    nbytes = _ext._sifar.workspace_bytes(slot_bytes, len(my_groups[0]), lanes)
    prefix = f"/{SHM_PREFIX}{os.getuid()}.{os.getpid()}.{next(_names)}"
    ws = _ext._sifar.open_peer_workspaces(platform, ordinals, owners, peer_devices, nbytes, prefix)
    comm_id = None
    try:
        handles = {f"{mine[i]}/{r}": h.hex() for i, r, h in ws.handles()}
        posted = {p: json.loads(v) for p, v in exchange("handles", json.dumps(handles)).items()}
        for i, g in enumerate(mine):
            for r, owner in enumerate(owners[i]):
                if owner != me:
                    ws.map_peer(i, r, bytes.fromhex(posted[owner][f"{g}/{r}"]))
        comm_id = _ext._sifar.create_comm(platform, axis_key, axis, ordinals, slot_bytes,
                                          timeout_s, lanes, peers=ws)
        # Every process has mapped every workspace and initialised its own.
        exchange("ready", "1")
    except BaseException:
        if comm_id is not None:
            _ext._sifar.destroy_comm(comm_id)
        raise
    finally:
        ws.unpublish()  # mapped everywhere (or given up): the names can go
    return comm_id, ws


def before_destroy(comm_ids) -> None:
    """Call before destroying communicators (every process does, in the same
    order). GPU workspaces are freed by their owner: each process waits for
    its devices and unmaps the others' workspaces, then waits until every
    process has (bounded: a dead process is given up on after
    CLOSE_TIMEOUT_S, with a warning)."""
    for cid in comm_ids:
        with _lock:
            s = _shared.pop(cid, None)
        if s is None or s.platform != "cuda":
            continue
        s.workspaces.unmap_peers()
        try:
            _exchange(s.base, "closed", s.processes, "1", CLOSE_TIMEOUT_S,
                      "the shutdown of a communicator")
        except SifarError as e:
            warnings.warn(f"{e}; freeing this process's workspaces anyway", stacklevel=3)
