"""Helpers shared by the benchmarks: devices, timing (the device's copy rate too), statistics and
payloads; what they write: bench.report. Nothing here imports jax at module level: import this
before jax for `use_host_devices()` to take effect (XLA reads XLA_FLAGS once)."""

from __future__ import annotations

import itertools
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
_HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
# NVLink multicast stays off everywhere (it can take a shared host's GPUs out of service): forced
# into every process a benchmark starts. sifar_jax.multicast.DISABLING's values (a test keeps them
# equal), here so that the torch peers need not import sifar_jax, hence jax.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}


# ------------------------------------------------------------------ devices --
def use_host_devices(n: int = 8) -> None:
    """Asks XLA:CPU for n host devices unless XLA_FLAGS says how many (before jax is imported)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _HOST_DEVICES_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_HOST_DEVICES_FLAG}={n}".strip()


def bench_devices(min_gpus: int = 2) -> tuple[str, list]:
    """("gpu", GPUs) when at least min_gpus are visible, else ("cpu", host devices)."""
    import jax

    try:
        gpus = [d for d in jax.devices("gpu") if d.platform == "gpu"]
    except RuntimeError:
        gpus = []
    if len(gpus) >= min_gpus:
        return "gpu", gpus
    return "cpu", jax.devices("cpu")


def visible_gpu_count() -> int:
    """NVIDIA GPUs this process may use, without starting a framework (nvidia-smi, else the
    /dev/nvidiaN nodes), limited by CUDA_VISIBLE_DEVICES: the peers run before JAX starts."""
    n = sum(1 for line in nvidia_smi("-L") if line.startswith("GPU "))
    if n == 0:
        n = sum(1 for p in Path("/dev").glob("nvidia[0-9]*") if p.name[6:].isdigit())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # CUDA ignores the ids from the first negative one on
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        n = min(n, len(list(itertools.takewhile(lambda v: not v.startswith("-"), ids))))
    return n


def child_env(**extra: str) -> dict:
    """The environment for a process a benchmark starts: ours, multicast off, plus `extra`."""
    return {**os.environ, **MULTICAST_OFF, **extra}


def powers_of_two_up_to(n: int, start: int = 2) -> list[int]:
    """start, 2 start, 4 start, ... up to n."""
    return [start << k for k in range((n // start).bit_length())]


# ------------------------------------------------------------------ the host --
def nvidia_smi(*args: str) -> list[str]:
    """nvidia-smi's non-empty output lines; none where it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=20,
                             check=True).stdout if exe else ""
    except (OSError, subprocess.SubprocessError):
        out = ""
    return [line.strip() for line in out.splitlines() if line.strip()]


def read_text(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


# ------------------------------------------------------------------- timing --
def block(x):
    import jax

    return jax.block_until_ready(x)


def time_calls(fn: Callable, args: tuple, inner: int = 1) -> float:
    """Seconds per call of `inner` back-to-back calls and one wait for the last."""
    t0 = time.perf_counter()
    out = None
    for _ in range(inner):
        out = fn(*args)
    block(out)
    return (time.perf_counter() - t0) / inner


def warm_up(fn: Callable, args: tuple, times: int = 3) -> None:
    for _ in range(times):
        block(fn(*args))


# The buffer copy_rate copies: 4 GiB on a GPU (far past any cache); on a CPU only the code path
# matters (CPU runs print no timing figure).
COPY_BYTES = {"gpu": 4 << 30, "cpu": 64 << 20}


def copy_rate(device, nbytes: int | None = None, samples: int = 7, inner: int = 4) -> float:
    """Bytes per second of a device-to-device copy on `device`, read + write counted: a jitted
    `x + 1` over nbytes of uint32 (default COPY_BYTES of the platform), the median over `samples`
    of `inner` back-to-back calls and one wait, after two untimed calls. The memory floor of a
    step is the bytes it reads at this rate, measured in the same process as the step. (Over
    uint8, XLA:GPU's loop reads a byte per thread: 1.67 TB/s on an H100 whose copies run at
    3.0-3.1.)"""
    import jax
    import jax.numpy as jnp

    n = nbytes or COPY_BYTES["gpu" if device.platform == "gpu" else "cpu"]
    with jax.default_device(device):
        x = jax.device_put(jnp.zeros((n // 4,), jnp.uint32), device)
    add_one = jax.jit(lambda a: a + jnp.uint32(1))
    warm_up(add_one, (x,), 2)
    seconds = statistics.median(time_calls(add_one, (x,), inner) for _ in range(samples))
    del x
    return 2 * (n // 4 * 4) / seconds


def paired_differences(fn_small: Callable, fn_large: Callable, args: tuple, extra_work: float,
                       runs: int, inner: int = 1) -> list[float]:
    """Per-unit seconds of runs of (fn_large - fn_small) / extra_work: functions that differ only
    in `extra_work` units (all-reduces), timed alternately; the difference cancels the launch."""
    out = []
    for _ in range(runs):
        t_small = time_calls(fn_small, args, inner)
        out.append((time_calls(fn_large, args, inner) - t_small) / extra_work)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100] (NaN of no values)."""
    return float(np.percentile(values, q)) if len(values) else math.nan


TAILS = {"us_p50": 50, "us_p90": 90, "us_p99": 99, "us_p99_9": 99.9}


def tails_us(values_us) -> dict:
    """{us_p50, us_p90, us_p99, us_p99_9} of latencies in microseconds (None of no values)."""
    v = np.asarray(values_us, dtype=np.float64)
    return {k: round(float(np.percentile(v, q)), 3) if v.size else None for k, q in TAILS.items()}


# A latency from a difference of timings carries both timings' noise and can come out negative.
# A median is reported only above NOISE_SE standard errors of the median, estimated from the
# samples' interquartile range: 1.2533 * (IQR / 1.349) / sqrt(n) (exact for normal samples; the
# IQR ignores a busy host's outliers). Fewer than MIN_SAMPLES samples bound nothing.
NOISE_SE = 2.0
MIN_SAMPLES = 3


def noise_bound_us(us: Sequence[float]) -> float | None:
    """NOISE_SE standard errors of the median of `us`; None below MIN_SAMPLES samples."""
    if len(us) < MIN_SAMPLES:
        return None
    iqr = percentile(us, 75) - percentile(us, 25)
    return NOISE_SE * 1.2533 * (iqr / 1.349) / math.sqrt(len(us))


def resolved_us(median: float, noise: float | None) -> float | None:
    """The median if it lies above its noise bound, else None (never a within-noise figure)."""
    if noise is None or not math.isfinite(median) or median <= noise:
        return None
    return median


def summarize_us(seconds: Sequence[float]) -> dict:
    """Per-unit seconds as us_median (None within its noise), us_median_raw, us_p10, us_p90,
    us_noise (the bound) and samples."""
    us = [s * 1e6 for s in seconds]
    median = statistics.median(us)
    noise = noise_bound_us(us)
    got = resolved_us(median, noise)
    return {
        "us_median": None if got is None else round(got, 3),
        "us_median_raw": round(median, 3),
        "us_p10": round(percentile(us, 10), 3),
        "us_p90": round(percentile(us, 90), 3),
        "us_noise": None if noise is None else round(noise, 3),
        "samples": len(us),
    }


def fmt_latency(rec: dict, unit: str = "") -> str:
    """A record's us_median (with `unit`), or 'not resolved'."""
    if rec.get("us_median") is None:
        return "not resolved"
    return fmt_us(rec["us_median"]) + unit


def progress(total: int, desc: str, timings: bool = True):
    """A tqdm bar on stderr (tqdm comes with the bench and test extras); none when stderr is
    not a terminal (a log or a pipe would get every redraw). timings=False (a CPU run): no
    elapsed time and no rate in it."""
    from tqdm import tqdm

    fmt = None if timings else "{l_bar}{bar}| {n_fmt}/{total_fmt}{postfix}"
    return tqdm(total=total, desc=desc, unit="case", dynamic_ncols=True, file=sys.stderr,
                mininterval=0.5, disable=None, bar_format=fmt)


# ----------------------------------------------------------------- payloads --
def random_payload(seed: int, ranks: int, elems: int) -> np.ndarray:
    """float32 (ranks, elems) of bf16-exact values, |x| in [0.5, 2), random signs: never zero,
    so every peer reduces the same numbers."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    x = rng.uniform(0.5, 2.0, (ranks, elems)) * np.where(rng.random((ranks, elems)) < 0.5, -1, 1)
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def allreduce_mismatch(got, inputs, ranks: Sequence[int] | None = None) -> str | None:
    """None when every row of `got` (results, elems) is the sum of `inputs` (ranks, elems) within
    any bf16 summation order's error (2 * ranks * 2^-8 * sum |x_i|), else what is wrong; `ranks`
    names got's rows. A missing or stale partial (an error >= min |x_i| = 0.5) fails."""
    g = np.asarray(got, dtype=np.float64)
    x = np.asarray(inputs, dtype=np.float64)
    want = x.sum(0)
    bound = 2 * x.shape[0] * 2.0**-8 * np.abs(x).sum(0)
    g = g.reshape((-1,) + want.shape)
    ranks = list(range(g.shape[0])) if ranks is None else list(ranks)
    err = np.abs(g - want)
    bad = ~(err <= bound)  # NaN counts as bad
    if not bad.any():
        return None
    worst = np.where(bad, np.nan_to_num(err, nan=np.inf), -1.0)
    r, i = np.unravel_index(int(np.argmax(worst)), bad.shape)
    return (f"{int(bad.sum())} of {bad.size} elements differ from the float64 sum; worst: rank "
            f"{ranks[r]} element {i} got {float(g[r, i])!r}, want {float(want[i])!r} "
            f"(bound {float(bound[i]):.3g})")


# --------------------------------------------------------------- formatting --
def fmt_us(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.2f}" if abs(x) < 100 else f"{x:.0f}"
