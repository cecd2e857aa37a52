"""Hugging Face safetensors checkpoints, for any model family: reading the slices each device
needs, placing them as sharded arrays, writing tensors back in HF's file layout.

Loading reads, for each device, only the rows/columns of each HF tensor that its shard needs
(safetensors slices are memory-mapped) and places them with jax.make_array_from_callback, so the
full model is never assembled on the host or on one device. A family's loader says, for each of
its parameters, how to build a chunk of it from checkpoint tensors (`builders`).

Before anything is placed, the checkpoint is checked from its files' headers alone (read_index,
check_reads): every file is safetensors and whole, the index (if any) is JSON and each tensor is
in the file it names, each tensor the config implies has its shape, and every chunk each device
will read is there. A bad checkpoint is one CheckpointError naming the file and the tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from typing import Any, Callable, Mapping, Optional

import jax
import numpy as np
from safetensors import SafetensorError, safe_open
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
        try:
            return json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{CONFIG_FILE}: not JSON ({e})") from None


@dataclasses.dataclass(frozen=True)
class Index:
    """Where a checkpoint's tensors are, from its files' headers (read_index): tensor name ->
    file name (relative to `path`), and each file's header (name -> dtype, shape, offsets)."""

    path: str
    weight_map: dict[str, str]
    headers: dict[str, dict[str, dict]]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.headers[self.weight_map[name]][name]["shape"])

    def dtype(self, name: str) -> str:
        return self.headers[self.weight_map[name]][name]["dtype"]

    def missing(self, name: str) -> CheckpointError:
        """The error for a tensor the model reads and the checkpoint lacks."""
        where = (INDEX_FILE + "'s weight_map" if os.path.exists(os.path.join(self.path, INDEX_FILE))
                 else ", ".join(sorted(self.headers)))
        return CheckpointError(f"no tensor {name!r} in {where}")


def read_index(path: str) -> Index:
    """The checkpoint at `path`'s Index, every file's header checked
    (fp8_checkpoint.read_header): with model.safetensors.index.json, the files it names, each
    holding the tensors it maps to it; without, every *.safetensors file of the directory."""
    index = os.path.join(path, INDEX_FILE)
    if not os.path.exists(index):
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors file (and no {INDEX_FILE})")
        headers = {fn: fp8_checkpoint.read_header(os.path.join(path, fn))[0] for fn in files}
        return Index(path, {k: fn for fn in files for k in headers[fn]}, headers)
    with open(index, "rb") as f:
        try:
            weight_map = json.load(f).get("weight_map")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise CheckpointError(f"{INDEX_FILE}: not JSON of a weight_map ({e})") from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{INDEX_FILE}: no weight_map of tensor names to file names")
    headers = {}
    for name, fn in weight_map.items():
        if fn not in headers:
            if not os.path.isfile(os.path.join(path, fn)):
                raise CheckpointError(f"{INDEX_FILE}: maps {name!r} to {fn}, which is not in "
                                      f"the checkpoint's directory")
            headers[fn] = fp8_checkpoint.read_header(os.path.join(path, fn))[0]
        if name not in headers[fn]:
            raise CheckpointError(f"{INDEX_FILE}: maps {name!r} to {fn}, which does not hold it")
    return Index(path, weight_map, headers)


def _dense_only(name: str, dtype: str) -> None:
    if dtype.startswith("F8"):  # FP8 tensors go through weights/fp8_load.py
        raise CheckpointError(f"{name}: a {dtype} tensor read as a dense weight: an FP8 "
                              f"checkpoint names its layout in config.json's quantization_config "
                              f"(docs/reference.md, Loading FP8 checkpoints)")


class Checkpoint:
    """Name -> slice reader over one or several safetensors files (open while `stack` is)."""

    def __init__(self, path: str, stack: contextlib.ExitStack):
        self.index = read_index(path)
        self._files = {}
        for fn in sorted(self.index.headers):
            try:
                self._files[fn] = stack.enter_context(safe_open(os.path.join(path, fn),
                                                                framework="np"))
            except SafetensorError as e:  # what read_header does not check
                raise CheckpointError(f"{fn}: {e}") from None
        self._map = self.index.weight_map

    def __contains__(self, name: str) -> bool:
        return name in self._map

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._map:
            raise self.index.missing(name)
        return self.index.shape(name)

    def read(self, name: str, dim: int = 0, lo: Optional[int] = None, hi: Optional[int] = None):
        """tensor[lo:hi] along dim (all of it if lo is None), as numpy."""
        if name not in self._map:
            raise self.index.missing(name)
        sl = self._files[self._map[name]].get_slice(name)
        _dense_only(name, sl.get_dtype())
        if lo is None:
            return sl[:]
        return sl[(slice(None),) * dim + (slice(lo, hi),)]


# ---- the checks before anything is placed -------------------------------------------------------

NOTHING = np.dtype([])  # numpy's empty structured dtype: arrays of it hold 0 bytes


class ShapeReader:
    """Checkpoint's interface over an Index alone: each read gives an array of NOTHING of the
    slice's shape (so a family's builders run in full, allocating nothing), its bounds checked;
    the tensors each build reads, and how far along each split dim they are read, recorded."""

    def __init__(self, index: Index, float8: bool):
        self.index, self.float8 = index, float8
        self.reads: list[str] = []
        self.extent: dict[tuple[str, int], int] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.index:
            raise self.index.missing(name)
        return self.index.shape(name)

    def read(self, name: str, dim: int = 0, lo: Optional[int] = None, hi: Optional[int] = None):
        shape = self.shape(name)
        if not self.float8:
            _dense_only(name, self.index.dtype(name))
        self.reads.append(name)
        if lo is not None:
            if dim >= len(shape) or not 0 <= lo <= hi <= shape[dim]:
                raise CheckpointError(f"{self.where(name)} has shape {shape}: the model reads "
                                      f"[{lo}:{hi}] of its dim {dim}")
            self.extent[name, dim] = max(self.extent.get((name, dim), 0), hi)
            shape = shape[:dim] + (hi - lo,) + shape[dim + 1:]
        return np.empty(shape, NOTHING)

    def where(self, name: str) -> str:
        return f"{self.index.weight_map[name]}: tensor {name!r}"


def hf_shapes(to_hf_tensors: Callable, abstract: dict, config: Any) -> dict[str, tuple]:
    """HF tensor name -> shape of the checkpoint a model of `abstract`'s shapes writes: the
    family's writer run on arrays of NOTHING (nothing read or allocated)."""
    empty = jax.tree.map(lambda s: np.empty(s.shape, NOTHING), abstract)
    return {k: tuple(v.shape) for k, v in to_hf_tensors(empty, config).items()}


def _chunks(sds, sharding, dim: Optional[int]) -> list[tuple[int, int]]:
    """The [lo, hi) place_array's callback asks the builder for, over this process's devices."""
    if dim is None:
        return [(0, sds.shape[0])]
    return sorted({index[dim].indices(sds.shape[dim])[:2]
                   for index in sharding.addressable_devices_indices_map(sds.shape).values()})


def check_reads(index: Index, expected: Optional[Mapping[str, tuple]], abstract: dict,
                shardings: dict, tp_dims: Mapping[str, int], builders: Callable,
                float8: bool = False) -> None:
    """Before anything is placed: each tensor of `expected` (hf_shapes: what the config implies)
    the checkpoint holds has that shape; then every chunk of every parameter each device will
    ask for (place_array's) is built through `builders` on a ShapeReader, so a tensor missing,
    a slice out of bounds, a chunk of the wrong shape or a tensor read only in part is a
    CheckpointError naming the file and the tensor. float8: float8 tensors may be read (an FP8
    checkpoint's reader)."""
    for name, want in (expected or {}).items():
        if name in index and index.shape(name) != tuple(want):
            raise CheckpointError(f"{index.weight_map[name]}: tensor {name!r} has shape "
                                  f"{index.shape(name)}, expected {tuple(want)} (config.json's "
                                  f"shapes)")
    reader = ShapeReader(index, float8)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    for (path, sds), sh, build in zip(flat, treedef.flatten_up_to(shardings),
                                      treedef.flatten_up_to(builders(reader))):
        dim = tp_dims.get(leaf_name(path))
        for lo, hi in _chunks(sds, sh, dim):
            reader.reads = []
            want = list(sds.shape)
            if dim is not None:
                want[dim] = hi - lo
            try:
                got = np.shape(build(lo, hi))
            except CheckpointError:
                raise
            except ValueError as e:  # e.g. a reshape of tensors whose shapes do not fit
                got = f"none ({e})"
            if got != tuple(want):
                read = ", ".join(f"{reader.where(n)} {index.shape(n)}"
                                 for n in dict.fromkeys(reader.reads))
                raise CheckpointError(f"{read}: these give {jax.tree_util.keystr(path)}[{lo}:{hi}] "
                                      f"the shape {got}, expected {tuple(want)}")
    for (name, dim), hi in reader.extent.items():
        if hi != index.shape(name)[dim]:
            raise CheckpointError(f"{reader.where(name)} has shape {index.shape(name)}: the "
                                  f"model reads {hi} of its dim {dim}")


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
                 builders: Callable[[Checkpoint], dict],
                 expected: Optional[Mapping[str, tuple]] = None) -> dict:
    """The parameter pytree `abstract` (ShapeDtypeStructs of the tp layout) read from the
    checkpoint at `path` and placed as `shardings`. builders(checkpoint) gives, per parameter
    path, f(lo, hi) -> its chunk [lo, hi) along its tp_dims dimension (the whole tensor for a
    replicated one). Checked first (check_reads; expected: hf_shapes of the config)."""
    with contextlib.ExitStack() as stack:
        ck = Checkpoint(path, stack)
        check_reads(ck.index, expected, abstract, shardings, tp_dims, builders)
        tree = builders(ck)
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
