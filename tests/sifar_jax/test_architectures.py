"""Which GPUs a build serves (src/sifar_jax/architectures.py), decided on the CPU
with made-up compute capabilities, and what init does on a GPU the build has
no kernels for (issue 26, item 1)."""

from __future__ import annotations

import re
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sifar_jax
from sifar_jax import _ext, architectures, comm, plan

WHEEL = ["90-real", "100-real", "100-virtual"]  # CMakeLists.txt's default


@pytest.mark.parametrize("capability,served", [
    ((9, 0), True),    # H100/H200: sm_90 SASS
    ((10, 0), True),   # B200: sm_100 SASS
    ((10, 3), True),   # B300: sm_100 SASS (same major, later minor)
    ((11, 0), True),   # newer than 10.0: compute_100 PTX
    ((12, 0), True),   # RTX 50xx: compute_100 PTX
    ((8, 0), False),   # A100: older than every entry
    ((8, 9), False),   # L40S
    ((7, 5), False),
])
def test_the_wheels_architectures(capability, served):
    assert architectures.covers(capability, WHEEL) is served


@pytest.mark.parametrize("archs,capability,served", [
    (["90-real"], (9, 0), True),
    (["90-real"], (10, 0), False),   # SASS of another major, and no PTX
    (["90-real"], (8, 9), False),
    (["90-virtual"], (12, 0), True),  # PTX runs on anything newer
    (["90-virtual"], (8, 9), False),
    (["80"], (8, 6), True),          # both: SASS for 8.x ...
    (["80"], (9, 0), True),          # ... and PTX for newer
    (["80"], (7, 5), False),
    (["90a-real"], (9, 0), True),    # arch-specific: that GPU only
    (["100a-real"], (10, 3), False),
    (["100a-virtual"], (12, 0), False),
    (["100f-virtual"], (10, 3), True),  # family-specific: same major
    (["100f-virtual"], (12, 0), False),
    (["native"], (7, 0), True),      # resolved by CMake when it built: not judged
    (["all-major"], (7, 0), True),
])
def test_compatibility_rules(archs, capability, served):
    assert architectures.covers(capability, archs) is served


def test_describe_names_every_entry():
    text = architectures.describe(WHEEL)
    for part in ("sm_90 (compute capability 9.0 to 9.x)", "sm_100 (compute capability 10.0 to 10.x)",
                 "compute_100 PTX (compute capability 10.0 or newer"):
        assert part in text, text


def _gpu(i, kind="NVIDIA A100-SXM4-80GB"):
    return types.SimpleNamespace(id=i, device_kind=kind, local_hardware_id=i)


def test_unsupported_gpus_names_the_gpu_and_what_the_build_supports():
    caps = {0: (9, 0), 1: (8, 0)}
    why = architectures.unsupported_gpus([_gpu(0, "NVIDIA H200"), _gpu(1)],
                                         capability_of=lambda d: caps[d.id], architectures=WHEEL)
    assert why is not None and why.startswith(architectures.REASON_PREFIX), why
    assert "GPU 1 (NVIDIA A100-SXM4-80GB, compute capability 8.0)" in why, why
    assert "sm_90" in why and "compute_100 PTX" in why and "80-real" in why, why
    assert architectures.unsupported_gpus([_gpu(0, "NVIDIA H200")], capability_of=lambda d: (9, 0),
                                          architectures=WHEEL) is None


def test_a_gpu_cuda_cannot_query_is_a_reason_too():
    """e.g. a driver older than the static CUDA runtime: CUDA's words, as the reason."""
    def fails(d):
        raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version")

    why = architectures.unsupported_gpus([_gpu(3)], capability_of=fails, architectures=WHEEL)
    assert why.startswith(architectures.REASON_PREFIX) and "GPU 3" in why, why
    assert "insufficient" in why and "driver supports CUDA" in why, why


def test_build_info_describes_this_build():
    info = sifar_jax.build_info()
    assert "cpu" in info["backends"]
    assert ("cuda" in info["backends"]) == ("cuda" in _ext.PLATFORMS)
    assert bool(info["cuda_architectures"]) == ("cuda" in info["backends"])
    assert (info["cuda_runtime_version"] is None) == ("cuda" not in info["backends"])
    for arch in info["cuda_architectures"]:
        assert architectures.parse(arch) is not None, arch
    assert re.fullmatch(r"\d+\.\d+.*", info["jax_version_built_with"]), info
    assert re.fullmatch(r"\d+\.\d+\.\d+", info["nanobind_version"]), info
    assert re.fullmatch(r"\d+\.\d+", info["xla_ffi_api_version"]), info
    assert isinstance(info["stable_abi"], bool)


def test_init_on_a_gpu_the_build_lacks_falls_back_and_says_why(cpu_mesh, monkeypatch):
    """Made-up CUDA devices (the CPU ones, claimed as compute capability 8.0
    GPUs): init warns then, naming the axis and the supported GPUs, sets up no
    communicator, and sifar_psum hands the axis to lax.psum ("auto") or raises
    (a named algorithm)."""
    mesh = cpu_mesh(2, init=False)
    monkeypatch.setattr(comm, "_platform", lambda d: "cuda")
    monkeypatch.setattr(_ext, "PLATFORMS", frozenset({"cpu", "cuda"}))
    monkeypatch.setattr(architectures, "build_info",
                        lambda: {"cuda_architectures": WHEEL, "cuda_runtime_version": "13.0"})
    monkeypatch.setattr(_ext.lib, "device_compute_capability", lambda ordinal: (8, 0))
    monkeypatch.setattr(plan, "warned", set())
    with pytest.warns(UserWarning) as caught:
        sifar_jax.init(mesh)
    [w] = [w for w in caught if "falls back" in str(w.message)]
    text = str(w.message)
    assert text.startswith("sifar_jax.init: axis 'tp' falls back to lax.psum: "
                           + architectures.REASON_PREFIX), text
    assert "compute capability 8.0" in text and "sm_90" in text, text
    assert w.filename == __file__, "the warning should point at the caller's init line"
    assert sifar_jax.communicators("tp") == []
    [u] = comm.unsupported("tp")
    assert u.reason.startswith(architectures.REASON_PREFIX)

    def run(algorithm):
        f = jax.jit(jax.shard_map(lambda x: sifar_jax.sifar_psum(x, "tp", algorithm=algorithm),
                                  mesh=mesh, in_specs=P("tp"), out_specs=P()))
        return np.asarray(f(jnp.arange(8.0).reshape(2, 4)))

    with warnings.catch_warnings(record=True) as trace_warnings:
        warnings.simplefilter("always")
        got = run("auto")
    np.testing.assert_array_equal(got, [[4.0, 6.0, 8.0, 10.0]])
    assert any("falling back to lax.psum" in str(w.message) and "compute capability 8.0"
               in str(w.message) for w in trace_warnings)
    with pytest.raises(ValueError, match="compute capability 8.0"):
        run("sifar")
