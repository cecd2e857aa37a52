"""The `psum` that JAX's own tests call once `jax_psum_suite` swapped it in.

`bench/probes/jax_psum_suite.py` copies JAX's test files and rewrites every
`lax.psum` / `jax.lax.psum` in them to `_sifar_swap.psum` (this file, copied
under that name); jax itself and sifar_jax keep the real `lax.psum` (sifar_psum
falls back to it, and its tangent and transpose are lax.psum's).

`psum` sets sifar_jax up for the mesh of the enclosing shard_map (pmap is a
shard_map too in this jax), then calls `sifar_jax.sifar_psum` with the same
arguments. The mesh comes from, in order: the concrete mesh given to the
innermost shard_map that has one (recorded by a wrapper around jax's
`_shard_map`), the concrete mesh set by `jax.set_mesh`, else the first devices
in id order shaped like the abstract mesh (what `jax.make_mesh` builds on the
CPU; recorded as "guessed", so that a failure from a wrong guess is visible).

What happened in each test (swapped calls, all-reduces sifar traced and ran,
fallback warnings, guessed meshes) goes to the JSON-lines file
$SIFAR_SWAP_LOG, one line per test, for the runner's summary. sifar_jax's
warnings (a fallback to lax.psum, an init replacing an axis's communicator)
are recorded there rather than raised: JAX's pytest settings turn warnings
into errors.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import warnings

import jax
import numpy as np
from jax._src import mesh as mesh_lib
from jax._src import shard_map as shard_map_lib

import sifar_jax
from sifar_jax import plan as sifar_plan
from sifar_jax import psum as sifar_psum_module

_local = threading.local()


def _stack() -> list:
    if not hasattr(_local, "meshes"):
        _local.meshes = []
    return _local.meshes


# ------------------------------------------------------------ which mesh --
_original_shard_map = shard_map_lib._shard_map


def _tracking_shard_map(f, *, mesh, **kwargs):
    """jax's _shard_map, with the concrete mesh (if any) known while f is traced."""
    if not callable(f):
        return _original_shard_map(f, mesh=mesh, **kwargs)

    @functools.wraps(f)
    def traced(*args, **kw):
        concrete = mesh if isinstance(mesh, mesh_lib.Mesh) and not mesh.empty else None
        _stack().append(concrete)
        try:
            return f(*args, **kw)
        finally:
            _stack().pop()

    return _original_shard_map(traced, mesh=mesh, **kwargs)


shard_map_lib._shard_map = _tracking_shard_map


def _current_mesh():
    """(concrete mesh, guessed?) for the shard_map being traced; None outside one."""
    abstract = mesh_lib.get_abstract_mesh()
    if abstract.empty or not abstract.manual_axes:
        return None, False
    for m in reversed(_stack()):
        if m is not None and tuple(m.axis_names) == tuple(abstract.axis_names):
            return m, False
    concrete = mesh_lib.get_concrete_mesh()
    if not concrete.empty and tuple(concrete.axis_names) == tuple(abstract.axis_names):
        return concrete, False
    shape = tuple(abstract.axis_sizes)
    devices = sorted(jax.devices(), key=lambda d: d.id)[: int(np.prod(shape))]
    return jax.sharding.Mesh(np.array(devices).reshape(shape), abstract.axis_names), True


# ------------------------------------------------------------ the record --
class _Record:
    def __init__(self):
        self.reset()

    def reset(self):
        self.swapped_calls = 0
        self.sifar_traced = 0
        self.sifar_ran = 0
        self.fallbacks: set[str] = set()
        self.guessed: set[str] = set()
        self.inited: list = []

    def note_warnings(self, caught):
        for w in caught:
            text = str(w.message)
            if "sifar_jax" in text:
                self.fallbacks.add(text.split(": ", 1)[-1][:200])
            else:  # not ours: pass it on as it was
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def ran_so_far(self) -> int:
        try:
            sifar_jax.comm.wait_for_effects()
            return sum(v["calls"] for v in sifar_jax.stats().values())
        except Exception:  # noqa: BLE001 - a failed test's communicator: count what we can
            return 0


record = _Record()

_original_allreduce = sifar_psum_module.allreduce


def _counting_allreduce(*args, **kwargs):
    record.sifar_traced += 1
    return _original_allreduce(*args, **kwargs)


sifar_psum_module.allreduce = _counting_allreduce


def _ensure_init(mesh, guessed: bool) -> None:
    if any(m is mesh or m == mesh for m in record.inited):
        return
    # A communicator replaced mid-test loses its counters: keep them first.
    record.sifar_ran += record.ran_so_far()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sifar_jax.init(mesh)
    record.note_warnings(caught)
    record.inited.append(mesh)
    if guessed:
        record.guessed.add(f"{dict(mesh.shape)}")
    # Counters restart with the new communicators: count from here.
    record.sifar_ran -= record.ran_so_far()


def psum(x, axis_name, *, axis_index_groups=None):
    """lax.psum's signature; sifar_jax.sifar_psum does the work."""
    record.swapped_calls += 1
    mesh, guessed = _current_mesh()
    if mesh is not None:
        _ensure_init(mesh, guessed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = sifar_jax.sifar_psum(x, axis_name, axis_index_groups=axis_index_groups)
    record.note_warnings(caught)
    return out


# ------------------------------------------------------------- per test --
def start_test() -> None:
    """A clean sifar_jax (no communicators, fallback warnings fresh) per test."""
    try:
        sifar_jax.shutdown()
    except Exception:  # noqa: BLE001 - the previous test left a failed call
        sifar_jax.comm.wait_for_effects()
        sifar_jax.shutdown()
    sifar_plan.warned.clear()
    record.reset()


def end_test(nodeid: str) -> None:
    record.sifar_ran += record.ran_so_far()
    path = os.environ.get("SIFAR_SWAP_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({
                "test": nodeid,
                "swapped_calls": record.swapped_calls,
                "sifar_traced": record.sifar_traced,
                "sifar_ran": record.sifar_ran,
                "fallbacks": sorted(record.fallbacks),
                "guessed_meshes": sorted(record.guessed),
            }) + "\n")
    start_test()
