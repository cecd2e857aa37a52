"""How much memory a decoder needs per device, from its config alone, and whether the devices have
it: checked before any weight is allocated, so that a model too large for the machine is refused
with the numbers instead of being killed by the kernel half-way through its random init.

The estimate: the parameters of the tp layout (split ones divided by tp, replicated ones whole),
the KV cache (rows x capacity positions, this rank's KV heads), and a transient: the largest
parameter in float32 (random init and checkpoint conversion compute a tensor in float32 before
casting it) plus a prefill's activations (float32, a generous bound). With quantize="fp8" the
weights are the FP8 model's and the transient also holds the largest parameter in the model's
dtype: random init makes and quantizes one weight at a time (weights/random.py), so its peak is
the FP8 weights plus one weight dense, never the dense model. Compared with what a GPU
reports free (memory_stats' bytes_limit - bytes_in_use). On the CPU every host device shares
the host's ONE memory: the sum over the tp devices is compared with the host's available memory,
with what XLA:CPU adds there: it runs a bfloat16/float16 matmul in float32 and, measured at
Llama-8B shapes (2 and 4 layers, TP=2), keeps a float32 copy of every matmul weight while the
steps run (peak host memory: the weights plus those copies), so a bfloat16 model takes about
three times its weights' bytes.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional, Sequence

import jax
import numpy as np

from ..core.sharding import leaf_name
from ..weights.transforms import check_quantize, quantize_params

HEADROOM = 0.9  # use at most this share of what the device reports free
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Bytes per device."""

    weights: int
    kv_cache: int
    transient: int
    cpu_matmul_copies: int = 0  # float32 copies of low-precision matmul weights (XLA:CPU)

    @property
    def total(self) -> int:
        """Bytes per device on an accelerator."""
        return self.weights + self.kv_cache + self.transient

    def host_total(self, devices: int) -> int:
        """Bytes `devices` host devices of this footprint take of one CPU host's memory."""
        return devices * (self.total + self.cpu_matmul_copies)

    def describe(self) -> str:
        return (f"{self.total / GIB:.2f} GiB per device (weights {self.weights / GIB:.2f}, KV cache "
                f"{self.kv_cache / GIB:.2f}, transient {self.transient / GIB:.2f})")


def estimate(family, config: Any, tp: int, rows: int, capacity: int,
             prompt_len: int = 0, quantize: Optional[str] = None) -> Footprint:
    """The footprint per device of `config` split tp ways with a KV cache of rows x capacity
    positions and a prefill of prompt_len tokens (family.layout raises if tp does not split it).
    quantize="fp8": the projections held as FP8 (1 byte a weight, plus their float32 scales;
    models/weights/transforms.py); the transient holds the largest one in float32 and in the
    model's dtype (the one weight made dense before it is quantized: weights/random.py)."""
    check_quantize(quantize)
    layout = family.layout(config, tp).shapes
    _, abstract = family.abstract_model(layout)
    held = abstract if quantize is None else jax.eval_shape(
        lambda p: quantize_params(p, family), abstract)
    weights = sum(jax.tree.leaves(family.local_bytes(held, tp)))
    largest, matmul = 0, 0
    for path, sds in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        n = math.prod(sds.shape)
        if leaf_name(path) in family.tp_dims:
            n //= tp
        largest = max(largest, n)
        if len(sds.shape) > 1 and leaf_name(path) != "embed":  # a matmul's weight
            matmul += n
    item = np.dtype(config.dtype).itemsize
    if config.tie_word_embeddings:  # the LM head: this rank's vocab slice of the embedding
        matmul += config.vocab_size // tp * config.hidden_size
    kv = 2 * layout.num_layers * rows * capacity * (layout.num_kv_heads // tp) * layout.head_dim * item
    ffn = getattr(config, "intermediate_size", 4 * config.hidden_size)
    act = rows * prompt_len * (4 * config.hidden_size + 3 * ffn // tp) * 4
    made = (4 + (item if quantize else 0)) * largest  # one weight in float32 (+ dense, FP8)
    return Footprint(weights, kv, made + act, 4 * matmul if item < 4 else 0)


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


def check_fits(footprint: Footprint, devices: Sequence) -> None:
    """Raise MemoryError (with the numbers) unless `footprint` fits HEADROOM of what each GPU
    has free, or on the CPU, of the host's available memory, which every host device shares
    (Footprint.host_total); says nothing where the platform does not report its memory."""
    if devices[0].platform != "cpu":
        stats = devices[0].memory_stats()
        if not stats or "bytes_limit" not in stats:
            return
        free = min(d.memory_stats()["bytes_limit"] - d.memory_stats().get("bytes_in_use", 0)
                   for d in devices)
        if footprint.total > HEADROOM * free:
            raise MemoryError(
                f"the model needs about {footprint.describe()}, but only {free / GIB:.2f} GiB is "
                f"free per device ({devices[0].device_kind} free memory); use more devices "
                f"(--tp), a smaller dtype, a shorter KV cache or a smaller model")
        return
    host = _host_available()
    need = footprint.host_total(len(devices))
    if host is None or need <= HEADROOM * host:
        return
    raise MemoryError(
        f"the model needs about {need / GIB:.2f} GiB of host memory: {footprint.describe()} on "
        f"each of {len(devices)} host devices, which share the host's memory, + "
        f"{footprint.cpu_matmul_copies / GIB:.2f} GiB per device of float32 copies of its "
        f"matmul weights (XLA:CPU multiplies low-precision weights in "
        f"float32); only {host / GIB:.2f} GiB is available (more --tp devices share the same "
        f"memory on a CPU): use a smaller model, a shorter KV cache or a larger machine")
