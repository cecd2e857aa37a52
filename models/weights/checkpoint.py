"""Hugging Face safetensors checkpoints, for any model family: reading the slices each device
needs, placing them as sharded arrays, writing tensors back in HF's file layout.

Loading reads, for each device, only the rows/columns of each HF tensor that its shard needs
(safetensors slices are memory-mapped) and places them with jax.make_array_from_callback, so the
full model is never assembled on the host or on one device. A family's loader says, for each of
its parameters, how to build a chunk of it from checkpoint tensors (`builders`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from typing import Any, Callable, Mapping, Optional

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from ..core.sharding import leaf_name
from . import fp8_checkpoint
from .fp8_checkpoint import CheckpointError  # noqa: F401 - the loaders' error type

FLOAT8 = (fp8_checkpoint.DTYPES["F8_E4M3"], fp8_checkpoint.DTYPES["F8_E5M2"])

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


def read_hf_config(path: str) -> dict:
    """The checkpoint's config.json as a dict."""
    with open(os.path.join(path, CONFIG_FILE)) as f:
        return json.load(f)


class Checkpoint:
    """Name -> slice reader over one or several safetensors files (open while `stack` is)."""

    def __init__(self, path: str, stack: contextlib.ExitStack):
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors in {path}")
            weight_map = {}
            for fn in files:
                with safe_open(os.path.join(path, fn), framework="np") as f:
                    weight_map.update({k: fn for k in f.keys()})
        self._files = {fn: stack.enter_context(safe_open(os.path.join(path, fn), framework="np"))
                       for fn in sorted(set(weight_map.values()))}
        self._map = weight_map

    def __contains__(self, name: str) -> bool:
        return name in self._map

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._map:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return tuple(self._files[self._map[name]].get_slice(name).get_shape())

    def read(self, name: str, dim: int = 0, lo: Optional[int] = None, hi: Optional[int] = None):
        """tensor[lo:hi] along dim (all of it if lo is None), as numpy."""
        if name not in self._map:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        sl = self._files[self._map[name]].get_slice(name)
        if sl.get_dtype().startswith("F8"):  # FP8 tensors go through weights/fp8_load.py
            raise ValueError(f"{name}: a {sl.get_dtype()} tensor read as a dense weight: an FP8 "
                             f"checkpoint names its layout in config.json's quantization_config "
                             f"(docs/reference.md, Loading FP8 checkpoints)")
        if lo is None:
            return sl[:]
        return sl[(slice(None),) * dim + (slice(lo, hi),)]


def place_array(where: str, sds, sharding, dim: Optional[int], build: Callable) -> jax.Array:
    """One parameter placed as `sharding`: each device's chunk [lo, hi) along dim (the whole
    tensor for dim None) from build(lo, hi), cast to sds.dtype and its shape checked."""
    chunks: dict = {}  # a replicated tensor is read once, not once per device

    def callback(index):
        if dim is None:
            lo, hi = 0, sds.shape[0]
        else:
            lo, hi, _ = index[dim].indices(sds.shape[dim])
        if (lo, hi) not in chunks:
            a = np.asarray(build(lo, hi)).astype(sds.dtype)
            want = list(sds.shape)
            if dim is not None:
                want[dim] = hi - lo
            if a.shape != tuple(want):
                raise ValueError(f"{where}: checkpoint gives shape {a.shape}, expected "
                                 f"{tuple(want)}")
            chunks[(lo, hi)] = a
        return chunks[(lo, hi)]

    return jax.make_array_from_callback(sds.shape, sharding, callback)


def load_sharded(path: str, abstract: dict, shardings: dict, tp_dims: Mapping[str, int],
                 builders: Callable[[Checkpoint], dict]) -> dict:
    """The parameter pytree `abstract` (ShapeDtypeStructs of the tp layout) read from the
    checkpoint at `path` and placed as `shardings`. builders(checkpoint) gives, per parameter
    path, f(lo, hi) -> its chunk [lo, hi) along its tp_dims dimension (the whole tensor for a
    replicated one)."""
    with contextlib.ExitStack() as stack:
        tree = builders(Checkpoint(path, stack))
        return jax.tree_util.tree_map_with_path(
            lambda p, sds, sh, build: place_array(jax.tree_util.keystr(p), sds, sh,
                                                  tp_dims.get(leaf_name(p)), build),
            abstract, shardings, tree)


def save(tensors: dict[str, np.ndarray], hf_config: dict[str, Any], path: str, *,
         num_shards: int = 1) -> None:
    """Write config.json and model.safetensors (or num_shards files plus
    model.safetensors.index.json) in Hugging Face's layout."""
    os.makedirs(path, exist_ok=True)
    if any(a.dtype in FLOAT8 for a in tensors.values()):  # safetensors' numpy API has no float8
        def write(t, fn):
            fp8_checkpoint.write_safetensors(fn, t, {"format": "pt"})
    else:
        write = functools.partial(save_file, metadata={"format": "pt"})
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(hf_config, f, indent=2)
    if num_shards == 1:
        write(tensors, os.path.join(path, "model.safetensors"))
        return
    names = list(tensors)
    groups = [names[k::num_shards] for k in range(num_shards)]
    weight_map = {}
    for k, group in enumerate(groups):
        fn = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        write({n: tensors[n] for n in group}, os.path.join(path, fn))
        weight_map.update({n: fn for n in group})
    total = sum(a.nbytes for a in tensors.values())
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
