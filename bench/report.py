"""What every benchmark writes: where (results paths), the JSON, markdown and terminal tables,
the name of the hardware (host tag: '2xH200', 'cpu-2core') and the header of machine, versions
and date. The CPU rule: a run on XLA:CPU prints and writes no timing figure (its JSON keeps the
raw numbers, each record flagged CPU_FLAG: they say nothing about a GPU)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path

from bench import common

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
LOCAL_OUT = DEFAULT_OUT / "local"
CPU_FLAG = "cpu_timings_not_a_speed_figure"  # true in a CPU run's JSON: raw numbers, no result


def cpu_flagged(records: Iterable[dict], cpu: bool) -> list[dict]:
    """The records, each marked {CPU_FLAG: True} on a CPU run."""
    return [dict(r, **{CPU_FLAG: True}) if cpu else r for r in records]


# ----------------------------------------------------------------- host tag --
def _short_gpu_name(kind: str) -> str:
    """'NVIDIA H200' -> 'H200', 'NVIDIA H100 80GB HBM3' -> 'H100'."""
    name = re.sub(r"^(NVIDIA|Tesla)\s+", "", kind.strip(), flags=re.I)
    name = name.split()[0] if name else "gpu"
    return re.sub(r"[^A-Za-z0-9_.-]", "", name) or "gpu"


def host_tag(devices: Sequence) -> str:
    """A short tag naming the hardware the numbers came from: '2xH200', 'cpu-2core'."""
    gpus = [d for d in devices if d.platform == "gpu"]
    if gpus:
        return f"{len(gpus)}x{_short_gpu_name(gpus[0].device_kind)}"
    return f"cpu-{os.cpu_count()}core"


# -------------------------------------------------------------- environment --
def _driver_version() -> str | None:
    """nvidia-smi's, else (without it) the kernel module's banner."""
    smi = common.nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
    if smi:
        return smi[0]
    m = re.search(r"Kernel Module\s+([0-9.]+)", common.read_text("/proc/driver/nvidia/version"))
    return m.group(1) if m else None


def _cpu_model() -> str:
    m = re.search(r"^model name\s*:(.*)$", common.read_text("/proc/cpuinfo"), re.M)
    return m.group(1).strip() if m else platform.processor() or platform.machine()


def describe_environment(devices: Sequence) -> dict:
    """What a reader needs to interpret (and to reproduce) the numbers of a run on `devices`."""
    import jax
    import jaxlib

    import sifar_jax  # every benchmark runs it

    kind = "gpu" if any(d.platform == "gpu" for d in devices) else "cpu"
    env = {
        "host": host_tag(devices), "hostname": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": kind, "devices": len(devices),
        "device_kind": devices[0].device_kind if devices else None,
        "gpu": devices[0].device_kind if kind == "gpu" else None,
        "driver": _driver_version() if kind == "gpu" else None,
        "cpu": _cpu_model(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", None) or jax.lib.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "multicast_env": " ".join(f"{k}={os.environ.get(k)}" for k in common.MULTICAST_OFF),
    }
    try:
        env["platform_version"] = devices[0].client.platform_version
    except Exception:  # noqa: BLE001 - informational only
        pass
    env["sifar_jax"] = sifar_jax.__version__
    return env


# ------------------------------------------------------------------- output --
def default_out(kind: str) -> Path:
    """bench/results/ for GPU runs (committed), bench/results/local/ (git-ignored) on a CPU."""
    return DEFAULT_OUT if kind == "gpu" else LOCAL_OUT


def results_path(out_dir: str | os.PathLike | None, stem: str, host: str, suffix: str) -> Path:
    d = Path(out_dir) if out_dir else DEFAULT_OUT
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{stem}-{host}{suffix}"


def write_json(path: Path, records) -> Path:
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
    def line(cells):
        return "| " + " | ".join(str(c) for c in cells) + " |"

    rule = "|" + "|".join(" --- " for _ in headers) + "|"
    return "\n".join([line(headers), rule] + [line(row) for row in rows])


# The environment table's rows: describe_environment's keys (and the peers') and their labels.
ENV_LABELS = {
    "host": "host", "hostname": "hostname", "date": "date", "gpu": "GPU", "devices": "devices used",
    "driver": "driver", "platform_version": "platform", "cpu": "CPU", "cpu_count": "CPU cores",
    "python": "Python", "jax": "jax", "jaxlib": "jaxlib", "sifar_jax": "sifar_jax",
    "torch": "torch (peers)", "nccl": "NCCL (torch peers)", "xla_flags": "XLA_FLAGS",
    "multicast_env": "multicast switches",
}


def environment_markdown(env: dict) -> str:
    rows = [(label, f"`{env[k]}`" if k in ("xla_flags", "multicast_env") else env[k])
            for k, label in ENV_LABELS.items() if env.get(k) not in (None, "")]
    return markdown_table(["", ""], rows)


def write_markdown(path: Path, title: str, env: dict, sections: Sequence[tuple[str, str]],
                   notes: Sequence[str] = ()) -> Path:
    """A report: title, environment table, notes, then (heading, body) sections."""
    parts = [f"# {title}", "", environment_markdown(env), ""]
    parts += [f"> {n}" for n in notes] + ([""] if notes else [])
    for heading, body in sections:
        parts += [f"## {heading}", "", body, ""]
    path.write_text("\n".join(parts))
    return path


def section(title: str, table: tuple[Sequence[str], Sequence]) -> list[tuple[str, str]]:
    """[(title, the markdown table)], or [] when the table has no rows."""
    return [(title, markdown_table(*table))] if table[1] else []


def plain_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A fixed-width text table for the terminal: the first column left-aligned, the rest right."""
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])
