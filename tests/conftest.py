"""Shared test set-up: 8 XLA:CPU host devices, mesh fixtures, GPU detection.

XLA reads XLA_FLAGS once, when the backend is created, so the flag must be set
here, before any test module imports jax.
"""

from __future__ import annotations

import os
import pathlib
import sys

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()
# GPU tests start subprocesses (command buffers off) that need GPU memory too.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Generous default bound on every wait for a peer: 8 ranks share 2 cores on CI.
os.environ.setdefault("SIFAR_TIMEOUT_S", "10")
# The tools (models.generate, bench.decode) turn JAX's persistent compilation cache on in the
# user's cache dir by default: never from the suite (and its subprocesses), unless a test does
# it in a temporary directory (models/decoder/compile_cache.py).
os.environ.setdefault("SIFAR_JAX_NO_COMPILE_CACHE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import sifar_jax  # noqa: E402


def cpu_devices() -> list:
    return jax.devices("cpu")


def gpu_device_list() -> list:
    """The CUDA devices of this process ([] on CPU-only jaxlib)."""
    try:
        return [d for d in jax.devices("gpu") if d.platform == "gpu"]
    except RuntimeError:  # no GPU backend in this jaxlib / no GPU
        return []


def clear_failed_effects() -> None:
    """Waits for outstanding side effects, forgetting a computation that failed
    (JAX keeps re-raising a failed side-effecting call's error otherwise), so
    the next test starts clean. The library does the same in shutdown()."""
    sifar_jax.comm.wait_for_effects()


class MeshFactory:
    """Builds meshes of the first CPU devices and sets sifar_jax up for them.

    make(n) -> 1-D mesh ("tp",) of n devices; make(shape=(2, 4),
    axis_names=("dp", "tp")) -> 2-D mesh. close() shuts sifar_jax down.
    """

    def __init__(self, devices=None):
        self._devices = devices
        self.meshes: list[Mesh] = []

    def __call__(
        self,
        n: int | None = None,
        *,
        shape: tuple[int, ...] | None = None,
        axis_names: tuple[str, ...] = ("tp",),
        slot_bytes: int = sifar_jax.DEFAULT_SLOT_BYTES,
        timeout_s: float | None = None,
        init: bool = True,
    ) -> Mesh:
        devices = self._devices if self._devices is not None else cpu_devices()
        if shape is None:
            shape = (n,)
        size = int(np.prod(shape))
        if size > len(devices):
            pytest.skip(f"needs {size} devices, have {len(devices)}")
        mesh = Mesh(np.array(devices[:size]).reshape(shape), axis_names)
        if init:
            sifar_jax.init(mesh, slot_bytes=slot_bytes, timeout_s=timeout_s)
        self.meshes.append(mesh)
        return mesh

    def close(self) -> None:
        try:
            sifar_jax.shutdown()
        except Exception:  # noqa: BLE001 - a test provoked a failure: start clean
            clear_failed_effects()
            sifar_jax.shutdown()
        self.meshes.clear()


@pytest.fixture
def cpu_mesh():
    """Factory: cpu_mesh(n, slot_bytes=..., ...) -> initialised mesh; shut down after the test."""
    factory = MeshFactory()
    factory.close()  # start from a clean registry whatever ran before
    yield factory
    factory.close()


@pytest.fixture(scope="session")
def mesh_factory():
    """The MeshFactory class, for fixtures of wider scope than cpu_mesh
    (e.g. a class-scoped mesh per rank count, to compile each function once)."""
    return MeshFactory


@pytest.fixture
def gpu_devices():
    """The CUDA devices; skips the test unless at least two exist."""
    devs = gpu_device_list()
    if len(devs) < 2:
        pytest.skip("needs at least 2 CUDA GPUs")
    return devs


@pytest.fixture
def peak_live_bytes(monkeypatch):
    """peak_live_bytes(fn) -> (live device bytes before, their peak at any
    jax.block_until_ready during fn() (models/weights/transforms.py waits there after each
    weight), fn's result): how many weights a one-weight-at-a-time transform holds at once."""
    def live() -> int:
        return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())

    def run(fn):
        import models.weights.transforms as transforms

        peak, real = [0], jax.block_until_ready

        def watch(x):
            out = real(x)
            peak[0] = max(peak[0], live())
            return out

        before = live()
        monkeypatch.setattr(transforms.jax, "block_until_ready", watch)
        out = fn()
        return before, peak[0], out

    return run


@pytest.fixture
def timing_figures():
    """tests/bench/timing_figures.find_timing_figures: what a CPU benchmark run must never print
    or write in markdown."""
    sys.path.insert(0, str(pathlib.Path(__file__).parent / "bench"))
    try:
        from timing_figures import find_timing_figures
    finally:
        sys.path.pop(0)
    return find_timing_figures
