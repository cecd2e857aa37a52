"""`sifar_jax.info()` and `python -m sifar_jax.info`: what to paste into a bug report.

The build (backends, CUDA runtime, architectures, the jax it was built
against), the versions installed, the devices JAX sees, for GPUs which ones
this build serves and their peer-access matrix, whether multicast would be
allowed, and the communicators set up so far with the memory they hold.

(A package rather than a module, so that `python -m sifar_jax.info` runs its
`__main__` without importing this twice: `sifar_jax.info` the attribute is the
function.)
"""

from __future__ import annotations

import collections
import os
import platform
import sys

import jax

from .. import _ext, architectures, comm, multicast


def _versions() -> dict:
    import jaxlib

    from .. import __version__  # (set by sifar_jax/__init__.py after it imports this)

    return {"sifar_jax": __version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


def _devices() -> dict:
    devices = jax.devices()
    kinds = collections.Counter((d.platform, d.device_kind) for d in devices)
    return {
        "default_backend": jax.default_backend(),
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "kinds": [{"platform": p, "kind": k, "count": n} for (p, k), n in kinds.items()],
    }


def _local_cuda_gpus() -> list:
    return [d for d in jax.local_devices()
            if d.platform == "gpu" and "cuda" in d.client.platform_version.lower()]


def _gpus(gpus: list) -> list[dict]:
    """Each local CUDA GPU: its compute capability and whether this build runs on it."""
    out = []
    for d in gpus:
        entry = {"id": d.id, "ordinal": d.local_hardware_id, "kind": d.device_kind}
        try:
            entry["compute_capability"] = ".".join(
                map(str, _ext.lib.device_compute_capability(d.local_hardware_id)))
        except RuntimeError as e:
            entry["compute_capability"] = None
            entry["error"] = str(e)
        if "cuda" in _ext.PLATFORMS:
            entry["served"] = architectures.unsupported_gpus([d]) is None
        out.append(entry)
    return out


def _peer_access(gpus: list):
    """[i][j]: GPU i can read GPU j's memory over P2P (cudaDeviceCanAccessPeer);
    a sentence where there is nothing to ask."""
    if not gpus:
        return "n/a (no CUDA GPUs)"
    if "cuda" not in _ext.PLATFORMS:
        return "n/a (this build has no CUDA backend)"
    ordinals = [d.local_hardware_id for d in gpus]
    return {"devices": [d.id for d in gpus],
            "matrix": [[a == b or bool(_ext.lib.cuda_can_access_peer(a, b)) for b in ordinals]
                       for a in ordinals]}


def _multicast(gpus: list) -> dict:
    """The guard's verdict (sifar_jax.multicast): the environment's switches
    and the opt-in; on GPUs also the devices' own answer (a read-only
    attribute query, made only where the environment allows multicast)."""
    env = {v: os.environ[v] for v in (multicast.ENABLE_VAR, *multicast.DISABLING)
           if v in os.environ}
    refusal = multicast.refusal()
    out = {"allowed": refusal is None, "refusal": refusal, "opt_in": multicast.ENABLE_VAR,
           "disabling_switches": dict(multicast.DISABLING), "set_in_environment": env}
    if gpus and refusal is None:
        here = multicast.refusal_here([d.local_hardware_id for d in gpus])
        out["allowed"], out["refusal"] = here is None, here
    return out


def _communicators() -> list[dict]:
    out = []
    for c in comm.communicators():
        per_device = comm.workspace_bytes(c.slot_bytes, c.nranks, c.lanes)
        ndev = sum(len(g) for g in c.groups)
        entry = {"axis": c.axis_name, "platform": c.platform, "devices": [list(g) for g in c.groups],
                 "ranks": c.nranks, "slot_bytes": c.slot_bytes, "lanes": c.lanes,
                 "workspace_bytes_per_device": per_device,
                 "workspace_bytes_total": per_device * ndev}
        if c.processes:
            entry["processes"] = list(c.processes)
        out.append(entry)
    return out


def collect() -> dict:
    """Everything `info` reports, as a dict (no printing)."""
    gpus = _local_cuda_gpus()
    build = architectures.build_info()
    if build.get("cuda_architectures"):
        build["cuda_architectures_serve"] = architectures.describe(build["cuda_architectures"])
    build["cuda_driver_version"] = _ext.lib.cuda_driver_version()
    return {
        "versions": _versions(),
        "build": build,
        "devices": _devices(),
        "gpus": _gpus(gpus),
        "peer_access": _peer_access(gpus),
        "multicast": _multicast(gpus),
        "communicators": _communicators(),
        "fallback_axes": [{"axis": u.axis_name, "ranks": u.nranks, "reason": u.reason}
                          for u in comm.unsupported()],
    }


def _mib(n: int) -> str:
    return f"{n} B ({n / 2**20:.2f} MiB)"


def format_info(d: dict) -> str:
    """The report as text: one section per key of `collect()`."""
    lines = []

    def section(title):
        lines.append(f"{title}:")

    def item(key, value, indent=2):
        lines.append(f"{' ' * indent}{key + ':':<26} {value}")

    section("versions")
    for k, v in d["versions"].items():
        item(k, v)
    section("build")
    for k, v in d["build"].items():
        item(k, (", ".join(map(str, v)) or "none") if isinstance(v, list) else v)
    section("devices")
    dev = d["devices"]
    item("default backend", dev["default_backend"])
    item("process", f"{dev['process_index']} of {dev['process_count']}")
    for k in dev["kinds"]:
        item(f"{k['platform']}", f"{k['count']} x {k['kind']}")
    if d["gpus"]:
        section("gpus")
        for g in d["gpus"]:
            served = {True: "served", False: "NOT served by this build", None: ""}[g.get("served")]
            cc = g["compute_capability"] or g.get("error", "?")
            item(f"GPU {g['id']} (ordinal {g['ordinal']})", f"{g['kind']}, compute capability "
                 f"{cc}{', ' + served if served else ''}")
    section("peer access")
    pa = d["peer_access"]
    if isinstance(pa, str):
        item("matrix", pa)
    else:
        lines.append("  " + " " * 8 + " ".join(f"{i:>4}" for i in pa["devices"]))
        for i, row in zip(pa["devices"], pa["matrix"]):
            lines.append(f"  {i:>6}  " + " ".join(f"{'yes' if v else 'no':>4}" for v in row))
    section("multicast")
    mc = d["multicast"]
    item("allowed", "yes" if mc["allowed"] else f"no ({mc['refusal']})")
    item("opt-in variable", f"{mc['opt_in']}=1")
    item("set in the environment", mc["set_in_environment"] or "none of its variables")
    section("communicators")
    if not d["communicators"]:
        item("none", "(sifar_jax.init(mesh) sets them up)")
    for c in d["communicators"]:
        item(f"axis {c['axis']!r}", f"{c['platform']}, {len(c['devices'])} group(s) of "
             f"{c['ranks']} ranks, devices {c['devices']}")
        item("slot / lanes", f"{c['slot_bytes']} B, {c['lanes']} lanes", indent=4)
        item("workspace per device", _mib(c["workspace_bytes_per_device"]), indent=4)
        item("workspace in all", _mib(c["workspace_bytes_total"]), indent=4)
    if d["fallback_axes"]:
        section("axes handed to lax.psum")
        for u in d["fallback_axes"]:
            item(f"axis {u['axis']!r}", u["reason"])
    return "\n".join(lines)


def info(*, quiet: bool = False, file=None) -> dict:
    """Prints the report (to `file`, default stdout; nothing if quiet) and
    returns it as a dict."""
    d = collect()
    if not quiet:
        print(format_info(d), file=sys.stdout if file is None else file)
    return d
