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

Pooling. `shutdown()` keeps a communicator's shared workspaces (its own and
its mappings of the peers') mapped in a process-lifetime pool, keyed by their
layout: an executable compiled before may replay into them (CUDA graphs record
kernel arguments). The next set-up with that key first agrees on reuse:

  pool      each posts the handles of its pooled set for the key ("" if none).
            All the same: each process zeroes its own ranks' workspaces and
            error records, and `ready` keeps every process off the memory
            until all have. Otherwise each process releases what it holds for
            the key (all do it in this same step) and allocates anew.

Releasing a set (`shutdown(release_memory=True)`, a failed agreement, exit):
each process unmaps the peers' workspaces and, on GPUs, posts `closed` and
frees its own only once every process has posted it (freeing CUDA memory a
peer still maps is undefined). A process whose peers do not come within
CLOSE_TIMEOUT_S keeps its workspaces until they do (the next agreement on that
key, or exit, where it frees them anyway).

Launch several processes on one host with `python -m sifar_jax.launch`, and
call `sifar_jax.distributed.initialize()` at the start of the program.
"""

from __future__ import annotations

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

from . import _ext, _jax_compat, architectures
from .errors import SifarError

INIT_TIMEOUT_S = float(os.environ.get("SIFAR_INIT_TIMEOUT_S", "120"))
# Bound on the wait, when shared workspaces are released, for the other
# processes to stop using this process's workspaces.
CLOSE_TIMEOUT_S = float(os.environ.get("SIFAR_CLOSE_TIMEOUT_S", "10"))
# Platforms whose exported memory must outlive the peers' mappings (CUDA IPC:
# the `closed` handshake). A POSIX shared-memory object lives until its last
# mapping goes, so the CPU frees at once; tests add "cpu" to run the handshake.
HANDSHAKE_PLATFORMS = {"cuda"}
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


def _post(base: str, stage: str, value: str) -> None:
    _jax_compat.kv_client().key_value_set(f"{base}/{stage}/{jax.process_index()}", value)


def _collect(base: str, stage: str, processes, timeout_s: float) -> tuple[dict[int, str], int | None]:
    """Every process's value for `stage`, and the first process that did not
    post it within timeout_s (None when all did)."""
    client = _jax_compat.kv_client()
    deadline = time.monotonic() + timeout_s
    out = {}
    for p in processes:
        got = _get(client, f"{base}/{stage}/{p}", deadline - time.monotonic())
        if got is None:
            return out, p
        out[p] = got
    return out, None


def _exchange(base: str, stage: str, processes, value: str, timeout_s: float,
              what: str) -> dict[int, str]:
    """Posts this process's `value` for `stage` and returns every process's.
    Raises SifarError naming the first process that does not post in time."""
    _post(base, stage, value)
    out, missing = _collect(base, stage, processes, timeout_s)
    if missing is not None:
        raise SifarError(
            f"sifar_jax: process {missing} did not reach '{stage}' of {what} within "
            f"{timeout_s:g} s (process {jax.process_index()} waited): did it crash, or call "
            f"sifar_jax.init with another mesh? Every process that owns a device of the "
            f"mesh must call sifar_jax.init(mesh) with the same mesh."
        )
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
@dataclasses.dataclass
class _Shared:
    """The shared workspaces of one communicator in this process."""

    base: str  # key-value prefix of the set-up that made them (their `closed` handshake)
    platform: str
    processes: tuple[int, ...]
    workspaces: object  # the PeerWorkspaces (the communicator holds them too)
    key: tuple  # what makes them reusable: platform, axis key, groups, bytes
    handles: dict[str, str]  # "<group>/<rank>" -> hex handle, every rank of this process's groups
    closed: bool = False  # this process has unmapped the peers' workspaces and said so


_lock = threading.Lock()
_setups: dict[tuple, int] = {}  # (axis, device ids) -> set-ups so far (keys stay unique)
_names = itertools.count()
_shared: dict[int, _Shared] = {}  # comm id -> how it was set up
_pool: dict[tuple, _Shared] = {}  # key -> workspaces no communicator uses (all still mapped)
_closing: list[_Shared] = []  # released, but a peer may still map this process's workspaces
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
    """Once per process: stale objects of dead processes go; at exit (at_exit),
    names this process still publishes go."""
    global _started
    if not _started:
        _started = True
        clean_stale_shared_memory()


def _gpu_ordinal(bus_ids: dict[int, str], device) -> int:
    """The CUDA ordinal, in this process, of a device of any process (-1: not visible)."""
    if device.process_index == jax.process_index():
        return device.local_hardware_id
    return _ext.lib.cuda_device_of_pci_bus_id(bus_ids[device.id])


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
    why = architectures.unsupported_gpus(
        [d for g in mine for d in groups[g] if d.process_index == me])
    if why is not None:  # a GPU this build has no kernels for
        return why
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
                if ob != a.local_hardware_id and not _ext.lib.cuda_can_access_peer(
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
        identity["gpus"] = {d.id: _ext.lib.cuda_pci_bus_id(d.local_hardware_id)
                            for g in mine for d in groups[g] if d.process_index == me}
    infos = {p: json.loads(v) for p, v in exchange("identity", json.dumps(identity)).items()}
    verdicts = exchange("verdict", _why_not_here(platform, groups, mine, infos))
    reasons = [verdicts[p] for p in processes if verdicts[p]]
    if reasons:
        return reasons[0]
    comm_id, shared = _share(platform, axis_key, axis, [groups[g] for g in mine], mine, infos,
                             slot_bytes, timeout_s, lanes, exchange, base, processes)
    with _lock:
        _shared[comm_id] = shared
    return comm_id, processes


def _share(platform, axis_key, axis, my_groups, mine, infos, slot_bytes, timeout_s, lanes,
           exchange, base, processes):
    """Takes this axis's pooled workspaces back if every process agrees, else
    allocates this process's ranks' workspaces and maps the others'; creates
    the communicator; returns (comm id, its _Shared)."""
    me = jax.process_index()
    ordinals = [[device_ordinal(d) if d.process_index == me else -1 for d in g] for g in my_groups]
    owners = [[d.process_index for d in g] for g in my_groups]
    peer_devices = []
    if platform == "cuda":
        bus_ids = {int(k): v for info in infos.values() for k, v in info["gpus"].items()}
        peer_devices = [[_gpu_ordinal(bus_ids, d) for d in g] for g in my_groups]
    nbytes = _ext.lib.workspace_bytes(slot_bytes, len(my_groups[0]), lanes)
    key = (platform, axis_key, *(tuple(map(tuple, x)) for x in (ordinals, owners, peer_devices)),
           nbytes)
    shared = _agree_on_pool(key, exchange)
    if shared is None:
        shared = _open(platform, mine, ordinals, owners, peer_devices, nbytes, exchange, base,
                       processes, key)
    comm_id = None
    try:
        comm_id = _ext.lib.create_comm(platform, axis_key, axis, ordinals, slot_bytes,
                                          timeout_s, lanes, peers=shared.workspaces)
        # Every process has mapped every workspace and initialised (zeroed) its
        # own: only now may a kernel write a peer's.
        exchange("ready", "1")
    except BaseException:
        if comm_id is not None:
            _ext.lib.destroy_comm(comm_id)
        _keep(shared, [])  # still mapped everywhere: the next agreement decides
        raise
    finally:
        shared.workspaces.unpublish()  # mapped everywhere (or given up): the names can go
    return comm_id, shared


def _open(platform, mine, ordinals, owners, peer_devices, nbytes, exchange, base, processes, key):
    """Fresh workspaces: this process's ranks' exported, the others' mapped."""
    me = jax.process_index()
    prefix = f"/{SHM_PREFIX}{os.getuid()}.{os.getpid()}.{next(_names)}"
    ws = _ext.lib.open_peer_workspaces(platform, ordinals, owners, peer_devices, nbytes, prefix)
    try:
        handles = {f"{mine[i]}/{r}": h.hex() for i, r, h in ws.handles()}
        posted = {p: json.loads(v) for p, v in exchange("handles", json.dumps(handles)).items()}
        table = {f"{g}/{r}": posted[owner][f"{g}/{r}"]
                 for i, g in enumerate(mine) for r, owner in enumerate(owners[i])}
        for i, g in enumerate(mine):
            for r, owner in enumerate(owners[i]):
                if owner != me:
                    ws.map_peer(i, r, bytes.fromhex(table[f"{g}/{r}"]))
    except BaseException:
        ws.unpublish()
        raise
    return _Shared(base, platform, processes, ws, key, table)


def _agree_on_pool(key, exchange) -> _Shared | None:
    """The pooled workspaces for `key` if every process holds the same set;
    otherwise every process releases its sets for `key` (all in this step)
    and None."""
    with _lock:
        mine = _pool.pop(key, None)
        stale = [s for s in _closing if s.key == key]
        _closing[:] = [s for s in _closing if s.key != key]
    try:
        if mine is not None:
            mine.workspaces.synchronize()  # no old executable of ours still runs on them
        posted = exchange("pool", json.dumps({"base": mine.base, "handles": mine.handles})
                          if mine is not None else "")
        sets = [json.loads(v) for v in posted.values() if v]
        merged: dict[str, str] = {}
        same = (len(sets) == len(posted) and len({s["base"] for s in sets}) == 1
                and all(merged.setdefault(k, h) == h for s in sets for k, h in s["handles"].items()))
        if same:
            mine.workspaces.reset()  # zeroed before `ready`: no peer writes into it yet
    except BaseException:
        _keep(mine, stale)  # nothing decided: still mapped, the next agreement decides
        raise
    if same:
        _keep(None, stale)  # no peer releases those now: keep them for later
        return mine
    _release(([mine] if mine is not None else []) + stale, CLOSE_TIMEOUT_S)
    return None


def _keep(pooled: _Shared | None, closing: list[_Shared]) -> None:
    with _lock:
        if pooled is not None:
            _pool[pooled.key] = pooled
        _closing.extend(closing)


# --------------------------------------------------------------- releasing --
def _close(s: _Shared) -> None:
    """This process is done with `s`: its devices idle, the peers' workspaces
    unmapped; with the handshake, it tells the others."""
    s.workspaces.unmap_peers()
    if s.platform in HANDSHAKE_PLATFORMS and not s.closed:
        _post(s.base, "closed", "1")
        s.closed = True


def _release(sets: list[_Shared], timeout_s: float, *, at_exit: bool = False) -> None:
    """Closes every set first (the peers wait for that), then frees each once
    every process has closed it; keeps, in _closing, those a peer has not
    closed within timeout_s (at exit: frees them anyway)."""
    for s in sets:
        _close(s)
    deadline = time.monotonic() + timeout_s
    for s in sets:
        missing = None
        if s.platform in HANDSHAKE_PLATFORMS:
            _, missing = _collect(s.base, "closed", s.processes,
                                  max(0.0, deadline - time.monotonic()))
        if missing is not None and not at_exit:
            warnings.warn(
                f"sifar_jax: process {missing} has not released the shared workspaces of "
                f"{s.base} within {timeout_s:g} s: process {jax.process_index()} keeps its own "
                f"until it does (the next sifar_jax.init of that axis, or exit). Call "
                f"sifar_jax.shutdown(release_memory=True) in every process.", stacklevel=3)
            with _lock:
                _closing.append(s)
            continue
        if missing is not None:
            warnings.warn(f"sifar_jax: process {missing} did not release the shared workspaces "
                          f"of {s.base} before exit; freeing them anyway", stacklevel=2)
        s.workspaces.free()


def before_destroy(comm_ids) -> None:
    """Call before destroying communicators (every process does, in the same
    order): their shared workspaces go to the pool, still mapped, so that an
    executable compiled before stays safe to run (module docstring)."""
    with _lock:
        for cid in comm_ids:
            s = _shared.pop(cid, None)
            if s is not None:
                # No pooled set has this key: the set-up of a key takes its
                # pooled set (reuse) or releases it.
                _pool[s.key] = s


def release_pooled() -> None:
    """shutdown(release_memory=True), in every process: frees the pooled
    shared workspaces (with the `closed` handshake)."""
    _release(_take_all(), CLOSE_TIMEOUT_S)


def _take_all() -> list[_Shared]:
    """Empties the pool and the sets waiting for a peer; returns them."""
    with _lock:
        sets = [*_pool.values(), *_closing]
        _pool.clear()
        _closing.clear()
    return sets


def at_exit() -> None:
    """At interpreter exit, once the computations have finished (sifar_jax.comm's
    exit hook calls it after waiting for them): frees what the pool still holds
    (the peers exit too: bounded waits), then removes the names this process
    still publishes. Nothing to do in a process that never shared a workspace."""
    if not _started:
        return
    sets = _take_all()
    try:
        if _jax_compat.kv_client() is not None:
            _release(sets, CLOSE_TIMEOUT_S, at_exit=True)
    except Exception as e:  # noqa: BLE001 - the store may be gone already
        warnings.warn(f"sifar_jax: the release handshake at exit failed: {e}", stacklevel=1)
    finally:
        for s in sets:
            s.workspaces.free()  # idempotent
        _ext.lib.unpublish_all()


def shared_memory_state() -> dict:
    """For tests and diagnostics: the handle tables ("<group>/<rank>" -> hex
    handle) of the shared workspaces of live communicators (by comm id), of
    the pool, and of released sets still waiting for a peer."""
    with _lock:
        return {"live": {cid: dict(s.handles) for cid, s in _shared.items()},
                "pooled": [dict(s.handles) for s in _pool.values()],
                "closing": [dict(s.handles) for s in _closing]}
