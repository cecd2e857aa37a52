"""How much memory a decoder needs per device, from its config alone, and whether the devices have
it: checked before any weight is allocated, so that a model too large for the machine is refused
with the numbers instead of being killed by the kernel half-way through its random init.

The estimate: the parameters of the tp layout (split ones divided by tp, replicated ones whole),
the KV cache (rows x capacity positions, this rank's KV heads), and a transient: the largest
parameter in float32 (random init and checkpoint conversion compute a tensor in float32 before
casting it) plus a prefill's activations (float32, a generous bound). Compared with what a GPU
reports free (memory_stats' bytes_limit - bytes_in_use), or on the CPU, where every host device
shares the host's memory, the sum over the tp devices with the host's available memory.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional, Sequence

import jax
import numpy as np

from .sharding import leaf_name

HEADROOM = 0.9  # use at most this share of what the device reports free
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Bytes per device."""

    weights: int
    kv_cache: int
    transient: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.transient

    def describe(self) -> str:
        return (f"{self.total / GIB:.2f} GiB per device (weights {self.weights / GIB:.2f}, KV cache "
                f"{self.kv_cache / GIB:.2f}, transient {self.transient / GIB:.2f})")


def estimate(family, config: Any, tp: int, rows: int, capacity: int,
             prompt_len: int = 0) -> Footprint:
    """The footprint per device of `config` split tp ways with a KV cache of rows x capacity
    positions and a prefill of prompt_len tokens (family.layout raises if tp does not split it)."""
    layout = family.layout(config, tp)
    _, abstract = family.abstract_model(layout)
    weights, largest = 0, 0
    for path, sds in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        n = math.prod(sds.shape)
        if leaf_name(path) in family.tp_dims:
            n //= tp
        weights += n * np.dtype(sds.dtype).itemsize
        largest = max(largest, n)
    item = np.dtype(config.dtype).itemsize
    kv = 2 * layout.num_layers * rows * capacity * (layout.num_kv_heads // tp) * layout.head_dim * item
    ffn = getattr(config, "intermediate_size", 4 * config.hidden_size)
    act = rows * prompt_len * (4 * config.hidden_size + 3 * ffn // tp) * 4
    return Footprint(weights, kv, 4 * largest + act)


def _host_available() -> Optional[int]:
    """The host's available memory in bytes (psutil, else /proc/meminfo, else sysconf)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_bytes(devices: Sequence) -> tuple[Optional[int], str]:
    """(bytes free for the footprint of one device, what was asked). On the CPU the host's memory
    divided among `devices` (host devices share it); None where nothing says."""
    stats = devices[0].memory_stats() if devices[0].platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        free = min(d.memory_stats()["bytes_limit"] - d.memory_stats().get("bytes_in_use", 0)
                   for d in devices)
        return free, f"{devices[0].device_kind} free memory"
    host = _host_available()
    if host is None:
        return None, "unknown"
    return host // len(devices), f"host memory available / {len(devices)} devices"


def check_fits(footprint: Footprint, devices: Sequence) -> None:
    """Raise MemoryError (with the numbers) unless `footprint` fits HEADROOM of what each device
    has free; says nothing where the platform does not report its memory."""
    free, source = available_bytes(devices)
    if free is None or footprint.total <= HEADROOM * free:
        return
    raise MemoryError(f"the model needs about {footprint.describe()}, but only "
                      f"{free / GIB:.2f} GiB is free per device ({source}); use more devices "
                      f"(--tp), a smaller dtype, a shorter KV cache or a smaller model")
