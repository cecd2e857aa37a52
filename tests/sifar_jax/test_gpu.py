"""CUDA backend tests: skipped unless at least two GPUs are visible.

On the GPU host:
    python -m pytest -q tests/sifar_jax/test_gpu.py                 # everything, stress test included
    python -m pytest -q tests/sifar_jax/test_gpu.py -m "not slow"   # without the stress test

Correctness of every portable algorithm against lax.psum and a float64
reference at TP=2 (and TP=4/8 on sub-meshes when that many GPUs exist), with
XLA command buffers on (in this process: XLA's default) and off (in a
subprocess, since XLA_FLAGS is read once at start-up); a stress test of
100,000 skewed all-reduces that checks every result on the device; a dropped
rank that must time out, not hang.

NVLink multicast is never executed here: every call names a portable
algorithm explicitly (never "auto", which could pick multicast where it is
enabled), and the one test about multicast only traces and lowers, after
checking that the guard refuses.

This file is also a script: `python tests/sifar_jax/test_gpu.py --child` runs the
correctness checks and prints a JSON summary (used for the command-buffers-off
run). SIFAR_GPU_TESTS_ON_CPU=1 runs the whole file on XLA:CPU host devices
instead, to dry-run its logic on a machine without GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import sifar_jax
from reference import chain_reference_f32, int_view, make_inputs, rank_order_sum
from sifar_jax import multicast, testing
from test_faults import hang_guard

DRY_RUN_ON_CPU = os.environ.get("SIFAR_GPU_TESTS_ON_CPU") == "1"
ALGS = tuple(a for a in sifar_jax.ALGORITHMS if a != "multicast")
assert "auto" not in ALGS and "multicast" not in ALGS  # never run multicast from here
DTYPES = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
}
SLOT = sifar_jax.DEFAULT_SLOT_BYTES  # 64 KB
STRESS_CALLS = int(os.environ.get("SIFAR_STRESS_CALLS", "100"))
STRESS_STEPS = int(os.environ.get("SIFAR_STRESS_STEPS", "1000"))


def devices() -> list:
    if DRY_RUN_ON_CPU:
        return jax.devices("cpu")
    try:
        return [d for d in jax.devices("gpu") if d.platform == "gpu"]
    except RuntimeError:
        return []


def tp_sizes() -> list[int]:
    return [t for t in (2, 4, 8) if t <= len(devices())]


# Every test skips through its fixtures: most need two GPUs (the `gpus` and
# `tp_mesh` fixtures), the virtual-rank tests one GPU and a CUDA build.
pytestmark = [pytest.mark.gpu]


def make_mesh(tp: int) -> Mesh:
    return Mesh(np.array(devices()[:tp]), ("tp",))


# ------------------------------------------------------------------ numbers --
def shapes_for(dtype) -> list[tuple[int, ...]]:
    """From one element (2 bytes for bf16) up to exactly the slot."""
    s = SLOT // np.dtype(dtype).itemsize
    flat = [1, 3, 8, 37, 1000, 2048, 4096, 8192, 16384, s - 1, s]  # 4..64 KB of bf16
    shapes = [(k,) for k in sorted(set(flat)) if k <= s]
    return shapes + [(3, 5), (2, 3, 7), (4, s // 4)]


def compare(got: np.ndarray, lax_got: np.ndarray, x: np.ndarray, what: str) -> list[str]:
    """got/lax_got: (n, *shape), one row per rank. Returns the failures."""
    n, dtype = x.shape[0], x.dtype
    fails = []
    bits = int_view(got)
    if not (bits == bits[:1]).all():
        fails.append(f"{what}: ranks are not bit-identical")
    ref = x.astype(np.float64).sum(0).astype(dtype)
    g = got[0].astype(np.float64)
    if not np.isfinite(g).all() or (g == 0).any():
        fails.append(f"{what}: NaN/inf/zero in the output (an element was not written)")
    elif dtype == np.float32:
        err = np.abs(g - ref.astype(np.float64)) / np.abs(ref.astype(np.float64))
        if err.max() > 1e-6 * n:
            fails.append(f"{what}: relative error {err.max():.3g} vs the float64 reference")
    else:
        ulps = np.abs(int_view(got[0]) - int_view(ref))
        if ulps.max() > 1:
            fails.append(f"{what}: {int((ulps > 1).sum())} elements > 1 ulp off the reference")
    eps = {4: 2.0**-23, 2: 2.0**-7 if dtype == DTYPES["bfloat16"] else 2.0**-10}[dtype.itemsize]
    lg = lax_got[0].astype(np.float64)
    rel = np.abs(g - lg) / np.maximum(np.abs(lg), 1e-30)
    if rel.max() > 2 * n * eps:
        fails.append(f"{what}: differs from lax.psum by {rel.max():.3g} (relative)")
    return fails


# ---------------------------------------------------------------- functions --
_FUNCS: dict = {}


def matrix_fn(mesh, algorithm, count):
    """count inputs (n, *shape_i) -> count pairs (sifar_psum, lax.psum), one jit."""
    key = ("matrix", tuple(mesh.devices.flat), algorithm, count)
    if key not in _FUNCS:

        def body(*xs):
            return tuple(
                (
                    sifar_jax.sifar_psum(x[0], "tp", algorithm=algorithm)[None],
                    jax.lax.psum(x[0], "tp")[None],
                )
                for x in xs
            )

        spec = P("tp")
        _FUNCS[key] = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(spec,) * count, out_specs=((spec, spec),) * count)
        )
    return _FUNCS[key]


def check_matrix(mesh, algorithm, dtype_name, seed=0) -> tuple[int, list[str]]:
    n = mesh.shape["tp"]
    dtype = DTYPES[dtype_name]
    shapes = shapes_for(dtype)
    f = matrix_fn(mesh, algorithm, len(shapes))
    fails, checked = [], 0
    for call in range(2):  # the second call reuses the executable (and the other slot)
        rng = np.random.default_rng(zlib.crc32(repr((n, algorithm, dtype_name, seed, call)).encode()))
        xs = [make_inputs(rng, n, s, dtype) for s in shapes]
        before = sifar_jax.stats()[algorithm]["calls"]
        outs = jax.block_until_ready(f(*xs))
        calls = sifar_jax.stats()[algorithm]["calls"] - before
        if calls != n * len(shapes):
            fails.append(f"tp={n} {algorithm}: stats counted {calls} calls, want {n * len(shapes)}")
        for x, (got, lax_got) in zip(xs, outs):
            checked += 1
            what = f"tp={n} {algorithm} {dtype_name} {x.shape[1:]} call {call}"
            fails += compare(np.asarray(got), np.asarray(lax_got), x, what)
    return checked, fails


def chain_fn(mesh, algorithm, steps):
    """y <- reduce(0.5 * y + x[k]) * (1/n), data-dependent, unrolled in one jit."""
    n = mesh.shape["tp"]
    key = ("chain", tuple(mesh.devices.flat), algorithm, steps)
    if key not in _FUNCS:

        def body(y0, xs):
            y, outs = y0[0], []
            for k in range(steps):
                v = 0.5 * y + xs[0, k]
                s = jax.lax.psum(v, "tp") if algorithm is None else sifar_jax.sifar_psum(
                    v, "tp", algorithm=algorithm
                )
                y = s * np.float32(1.0 / n)
                outs.append(y)
            return jnp.stack(outs)[None]

        _FUNCS[key] = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp")), out_specs=P("tp"))
        )
    return _FUNCS[key]


def check_chain(mesh, algorithm, steps=64, size=1000) -> list[str]:
    n = mesh.shape["tp"]
    rng = np.random.default_rng(zlib.crc32(repr((n, algorithm, "chain")).encode()))
    y0 = rng.uniform(0.5, 2.0, (n, size)).astype(np.float32)
    xs = rng.uniform(0.5, 2.0, (n, steps, size)).astype(np.float32)
    got = np.asarray(chain_fn(mesh, algorithm, steps)(y0, xs))
    lax_got = np.asarray(chain_fn(mesh, None, steps)(y0, xs))
    fails = []
    bits = got.view(np.int32)
    if not (bits == bits[:1]).all():
        fails.append(f"chain tp={n} {algorithm}: ranks are not bit-identical")
    bad = np.nonzero((bits[0] != chain_reference_f32(y0, xs).view(np.int32)).any(axis=1))[0]
    if bad.size:
        fails.append(f"chain tp={n} {algorithm}: steps {bad[:10].tolist()} differ from the emulation")
    if not np.allclose(got[0], lax_got[0], rtol=1e-5):
        fails.append(f"chain tp={n} {algorithm}: differs from the lax.psum chain")
    return fails


# -------------------------------------------------------------------- tests --
@pytest.fixture
def gpus(request):
    """conftest's gpu_devices (skips without 2 GPUs), or the CPU host devices in
    a SIFAR_GPU_TESTS_ON_CPU=1 dry run."""
    if DRY_RUN_ON_CPU:
        return devices()
    return request.getfixturevalue("gpu_devices")


@pytest.fixture(scope="class", params=[2, 4, 8], ids=lambda t: f"tp{t}")
def tp_mesh(request):
    if request.param > len(devices()):
        pytest.skip(f"needs {request.param} GPUs")
    sifar_jax.shutdown()
    mesh = make_mesh(request.param)
    sifar_jax.init(mesh)
    yield mesh
    sifar_jax.shutdown()


class TestCorrectness:
    """Command buffers as XLA configures them by default (on)."""

    @pytest.mark.parametrize("dtype_name", list(DTYPES))
    @pytest.mark.parametrize("algorithm", ALGS)
    def test_matrix(self, tp_mesh, algorithm, dtype_name):
        checked, fails = check_matrix(tp_mesh, algorithm, dtype_name)
        assert checked > 0
        assert not fails, "\n".join(fails[:20])

    @pytest.mark.parametrize("algorithm", ALGS)
    def test_chain(self, tp_mesh, algorithm):
        fails = check_chain(tp_mesh, algorithm)
        assert not fails, "\n".join(fails)

    def test_mixed_chain(self, tp_mesh):
        """Algorithms interleaved on one communicator, in one jit."""
        n = tp_mesh.shape["tp"]

        def body(x):
            y = x[0]
            outs = []
            for k in range(4 * len(ALGS)):
                y = sifar_jax.sifar_psum(y, "tp", algorithm=ALGS[k % len(ALGS)]) * np.float32(1 / n)
                outs.append(y)
            return jnp.stack(outs)[None]

        f = jax.jit(jax.shard_map(body, mesh=tp_mesh, in_specs=P("tp"), out_specs=P("tp")))
        x = make_inputs(np.random.default_rng(n), n, (4096,), np.float32)
        got = np.asarray(f(x))
        bits = got.view(np.int32)
        assert (bits == bits[:1]).all()
        first = x.astype(np.float64).sum(0) / n
        np.testing.assert_allclose(got[0, -1], first, rtol=1e-5)  # a fixed point after step 1

    @pytest.mark.parametrize("algorithm", ALGS)
    def test_repeat_in_one_launch(self, tp_mesh, algorithm):
        """psum_repeated (the kernel-level benchmark) gives the single call's result."""
        n = tp_mesh.shape["tp"]
        outs = {}
        for r in (1, 1000):
            f = jax.jit(
                jax.shard_map(
                    lambda v, r=r: sifar_jax.benchmarking.psum_repeated(v[0], "tp", r, algorithm=algorithm)[None],
                    mesh=tp_mesh, in_specs=P("tp"), out_specs=P("tp"),
                )
            )
            x = make_inputs(np.random.default_rng(7), n, (4096,), DTYPES["bfloat16"])
            before = sifar_jax.stats()[algorithm]["calls"]
            outs[r] = np.asarray(f(x))
            assert sifar_jax.stats()[algorithm]["calls"] - before == r * n
        np.testing.assert_array_equal(int_view(outs[1000]), int_view(outs[1]))
        sifar_jax.check()


def test_command_buffers_off(gpus):
    """The same checks in a fresh process with XLA command buffers disabled."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # this process holds GPU memory too
    r = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child"],
        env=env, capture_output=True, text=True, timeout=1800,
    )
    tail = (r.stdout[-4000:] + "\n" + r.stderr[-4000:]).strip()
    assert r.returncode == 0, tail
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["checked"] > 0 and not summary["failures"], tail
    assert "--xla_gpu_enable_command_buffer=" in summary["xla_flags"]


def _child_main() -> int:
    """Runs every correctness check on every TP size; prints a JSON summary."""
    checked, fails = 0, []
    for tp in tp_sizes():
        sifar_jax.shutdown()
        mesh = make_mesh(tp)
        sifar_jax.init(mesh)
        for alg in ALGS:
            for dt in DTYPES:
                c, f = check_matrix(mesh, alg, dt, seed=1)
                checked += c
                fails += f
            fails += check_chain(mesh, alg)
            checked += 1
        try:
            sifar_jax.check()
        except sifar_jax.SifarError as e:
            fails.append(str(e))
        sifar_jax.shutdown()
    print(json.dumps({"checked": checked, "failures": fails[:50],
                      "xla_flags": os.environ.get("XLA_FLAGS", ""),
                      "devices": [str(d) for d in devices()]}))
    return 1 if fails else 0


# ------------------------------------------------------------------- stress --
def stress_fn(mesh, steps, size):
    """steps data-dependent sifar all-reduces in a device loop; every result is
    checked on the device against its exact value, mismatches are counted.

    Rank r contributes a_r[i] = ((3 * prev[i] + 7 * i + k + 5 * r + 11 * c) % 31) + 1
    (small integers: every sum is exact in bfloat16, in any order), where prev
    is the previous all-reduce's result, k the step and c the call. Each rank
    computes the expected sum over all ranks itself.
    """
    n = mesh.shape["tp"]

    def body(c):
        r = jax.lax.axis_index("tp")
        i = jnp.arange(size, dtype=jnp.int32)

        def step(k, carry):
            prev, bad = carry
            base = 3 * prev + 7 * i + k + 11 * c[0]
            mine = ((base + 5 * r) % 31 + 1).astype(jnp.bfloat16)
            want = sum((base + 5 * q) % 31 + 1 for q in range(n))
            got = sifar_jax.sifar_psum(mine, "tp", algorithm="sifar").astype(jnp.int32)
            return got, bad + jnp.sum(got != want, dtype=jnp.int32)

        _, bad = jax.lax.fori_loop(0, steps, step, (jnp.zeros(size, jnp.int32), jnp.int32(0)))
        return bad[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("tp")))


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4, 8], ids=lambda t: f"tp{t}")
def test_stress_100k_skewed(gpus, mesh_factory, tp):
    if tp > len(devices()):
        pytest.skip(f"needs {tp} GPUs")
    factory = mesh_factory(devices())
    factory.close()
    mesh = factory(tp)
    size = 4096  # 8 KB of bf16, the decode payload
    f = stress_fn(mesh, STRESS_STEPS, size)
    jax.block_until_ready(f(np.int32([0])))  # compile
    before = sifar_jax.stats()["sifar"]
    bad = np.zeros(tp, np.int64)
    with hang_guard(1800), testing.inject_skew(50, seed=tp):
        results = [f(np.int32([c])) for c in range(1, STRESS_CALLS + 1)]
        for res in results:
            bad += np.asarray(res)
    after = sifar_jax.stats()["sifar"]
    sifar_jax.check()
    total = STRESS_CALLS * STRESS_STEPS
    print(f"\nstress tp={tp}: {total} skewed all-reduces, {int(bad.sum())} mismatching elements, "
          f"retries {after['retries'] - before['retries']}, timeouts "
          f"{after['timeouts'] - before['timeouts']}")
    assert after["calls"] - before["calls"] == tp * total
    assert after["timeouts"] == before["timeouts"]
    assert bad.sum() == 0, f"{bad.tolist()} mismatching elements (per rank) in {total} all-reduces"
    assert after["retries"] > before["retries"], "the skew never caused a mis-speculation"
    factory.close()


# --------------------------------------------------------------- dropped rank --
@pytest.mark.parametrize("algorithm", ALGS)
def test_dropped_rank_times_out(gpus, mesh_factory, algorithm):
    factory = mesh_factory(devices())
    factory.close()
    mesh = factory(2)
    f = jax.jit(
        jax.shard_map(
            lambda v: sifar_jax.sifar_psum(v[0], "tp", algorithm=algorithm)[None],
            mesh=mesh, in_specs=P("tp"), out_specs=P("tp"),
        )
    )
    x = np.arange(1, 2 * 512 + 1, dtype=np.float32).reshape(2, 512)
    np.testing.assert_array_equal(np.asarray(f(x))[0], x.sum(0))

    raised = None
    t0 = time.perf_counter()
    with hang_guard(300), testing.timeout(0.5), testing.drop_rank("tp", 1):
        for _ in range(2):  # the error may surface on the call or on the next one
            try:
                jax.block_until_ready(f(x))
            except Exception as e:  # noqa: BLE001 - XlaRuntimeError, whatever jax calls it
                raised = e
                break
    elapsed = time.perf_counter() - t0
    assert elapsed < 30, f"the dropped rank took {elapsed:.1f} s to report"
    if raised is not None:
        assert "timed out" in str(raised), str(raised)
    with pytest.raises(sifar_jax.SifarError, match=r"axis 'tp'.*rank \d+, epoch \d+") as e:
        sifar_jax.check()
    assert "rank 1" in str(e.value), str(e.value)

    # Recovery: shutdown() and init() again.
    sifar_jax.shutdown()
    sifar_jax.init(mesh)
    with hang_guard(300):
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(f(x))[0], x.sum(0))
    sifar_jax.check()
    factory.close()


# ------------------------------------------------------------ life cycle --
def test_old_executable_after_reinit_with_command_buffers(gpus, mesh_factory):
    """Issue 9.1: a function compiled (and recorded into a CUDA graph) before
    shutdown(); init(mesh, slot_bytes=other) replays its kernel arguments; they
    must still name valid memory (the pooled workspace), and both it and a new
    function stay exact."""
    from test_lifecycle import assert_exact, int_inputs, sum_fn

    factory = mesh_factory(devices())
    factory.close()
    mesh = factory(2, slot_bytes=SLOT)
    old = sum_fn(mesh, "sifar", calls=8)  # enough thunks for a command buffer
    assert_exact(old, int_inputs(2, 4096, 0))
    sifar_jax.shutdown()
    sifar_jax.init(mesh, slot_bytes=2 * SLOT)
    new = sum_fn(mesh, "sifar", calls=8)
    with hang_guard(300):
        for k in range(5):
            assert_exact(old, int_inputs(2, 4096, 10 + k))
            assert_exact(new, int_inputs(2, 4096, 20 + k))
    sifar_jax.check()
    factory.close()


def test_shutdown_waits_for_running_kernels(gpus, mesh_factory):
    """Issue 9.2: shutdown(release_memory=True) right after dispatching a long
    skewed chain must wait for every device before it frees anything: the
    results are exact and the next communicator works."""
    from test_lifecycle import int_inputs, sum_fn

    factory = mesh_factory(devices())
    factory.close()
    mesh = factory(2, slot_bytes=SLOT)
    f = sum_fn(mesh, "sifar", calls=200)
    x = int_inputs(2, 4096, 1)
    want = np.asarray(f(x)[1])
    skew = testing.inject_skew(100, seed=3)  # ~50 us per call: ~10 ms in flight
    with hang_guard(300):
        got = f(x)[0]  # dispatched, not waited for
        sifar_jax.shutdown(release_memory=True)
        skew.__exit__(None, None, None)
        np.testing.assert_array_equal(np.asarray(got), want)
    sifar_jax.init(mesh, slot_bytes=SLOT)
    g = sum_fn(mesh, "sifar", calls=200)  # re-traced: f's memory was released
    got, ref = (np.asarray(a) for a in g(x))
    np.testing.assert_array_equal(got, ref)
    sifar_jax.check()
    factory.close()


# ----------------------------------------------------- virtual ranks (N > 2) --
# Issue 9.10: N = 2, 4, 8 ranks of one communicator on ONE GPU (each with its
# own workspace and stream, grids small enough to be resident together),
# every portable algorithm, several dtypes and sizes, with and without skew,
# every rank's output bit-exact against the rank-order reference.
VR_TIMEOUT_S = 5.0
VR_ITERATIONS = int(os.environ.get("SIFAR_VR_ITERATIONS", "64"))  # per run, back to back
VR_SKEW_NS = (0, 20_000)
VR_DTYPES = {  # name: (numpy dtype, Elem index in elem_type.h)
    "float32": (np.dtype(np.float32), 0),
    "bfloat16": (DTYPES["bfloat16"], 1),
    "float16": (np.dtype(np.float16), 2),
    "int32": (np.dtype(np.int32), 3),
}


def _virtual_ranks_or_skip(nranks: int, slot: int = SLOT):
    from sifar_jax import _testing

    if DRY_RUN_ON_CPU or not sifar_jax._ext.lib.built_with_cuda():
        pytest.skip("virtual ranks need the CUDA backend")
    if not devices():
        pytest.skip("virtual ranks need one CUDA GPU")
    return _testing.VirtualRanks(0, nranks, slot, VR_TIMEOUT_S)


def rank_order_reference(x: np.ndarray) -> np.ndarray:
    """x: (iterations, N, count). Partials added in rank order 0..N-1 in
    float32, rounded once to the dtype; int32 sums wrap like lax.psum."""
    if x.dtype == np.int32:
        s = x.astype(np.int64).sum(axis=1)
        return ((s + 2**31) % 2**32 - 2**31).astype(np.int32)
    return rank_order_sum(np.moveaxis(x, 1, 0))


def _vr_inputs(rng, k, n, count, dtype) -> np.ndarray:
    if dtype == np.int32:
        return rng.integers(-(2**31), 2**31, (k, n, count), dtype=np.int64).astype(np.int32)
    mag = rng.standard_normal((k, n, count)) * 2.0 ** rng.integers(-6, 7, (k, n, count))
    return mag.astype(dtype)


def _vr_sizes(cap: int) -> list[int]:
    return sorted({b for b in (16, 48, 1008, 4096 + 16, cap // 2 // 16 * 16, cap) if 16 <= b <= cap})


def _vr_check_all(vr, nranks, algorithm, k) -> tuple[int, int, list[str]]:
    """Every skew x dtype x size on `vr`; returns (runs, retries, failures).
    Stops at the first failed call: the communicator is failed from then on."""
    alg = sifar_jax.algorithms.IDS[algorithm]
    runs, retries, fails = 0, 0, []
    for skew_ns in VR_SKEW_NS:
        vr.set_skew(skew_ns, nranks)
        for name, (dtype, elem) in VR_DTYPES.items():
            for nbytes in _vr_sizes(vr.max_bytes(alg)):
                count = nbytes // dtype.itemsize
                seed = zlib.crc32(repr((nranks, algorithm, skew_ns, name, nbytes)).encode())
                x = _vr_inputs(np.random.default_rng(seed), k, nranks, count, dtype)
                out, failure, calls, retried, timeouts = vr.run(alg, elem, x.tobytes(), nbytes, k)
                runs += 1
                retries += retried
                what = f"N={nranks} {algorithm} {name} {nbytes} B skew={skew_ns} ns"
                if failure or timeouts:
                    return runs, retries, fails + [f"{what}: {failure or f'{timeouts} timeouts'}"]
                if calls != k * nranks:
                    fails.append(f"{what}: {calls} calls counted, want {k * nranks}")
                got = np.frombuffer(out, np.uint8).reshape(k, nranks, nbytes)
                want = rank_order_reference(x).view(np.uint8).reshape(k, 1, nbytes)
                bad = (got != want).any(axis=2)  # (iteration, rank)
                if bad.any():
                    it, rank = np.nonzero(bad)
                    fails.append(f"{what}: {int(bad.sum())} of {k * nranks} (iteration, rank) "
                                 f"outputs differ, e.g. iteration {it[0]} rank {rank[0]}")
    return runs, retries, fails


@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("nranks", [2, 4, 8])
def test_virtual_ranks_bit_exact(nranks, algorithm):
    vr = _virtual_ranks_or_skip(nranks)
    k = max(1, min(VR_ITERATIONS, 1024 // nranks))
    try:
        with hang_guard(900):
            runs, retries, fails = _vr_check_all(vr, nranks, algorithm, k)
    finally:
        vr.close()
    print(f"\nvirtual ranks N={nranks} {algorithm}: {runs} runs of {k} all-reduces, retries {retries}")
    assert runs > 0
    assert not fails, "\n".join(fails[:20])


# ------------------------------------------- virtual ranks: psum_add_rmsnorm --
# The fused kernel at N = 2, 4, 8 ranks on one GPU (VirtualRanks.run_fused:
# LaunchRankFused, the CUDA handler's launch path): rows within a block, over
# 2-8 blocks (clusters), over 16-64 blocks (32-128 KB: thread blocks running 2,
# 4 or 8 of the protocol's blocks), padded rows, every dtype, with and without
# skew, several calls back to back. new_residual bit-identical to the
# rank-order reference, normed within test_fused's ulp bounds.
VR_FUSED_SLOT = 256 * 1024
VR_FUSED_ITERATIONS = 4
VR_FUSED_ROWS = {  # dtype: (hidden, rows); rows cut down to what stays resident
    "bfloat16": [(64, 3), (4096, 2), (5120, 2), (12288, 2), (16384, 2), (40960, 1)],
    "float16": [(896, 2), (8192, 1), (16384, 1)],
    "float32": [(3584, 2), (8192, 2), (16384, 1), (24576, 1)],
}
VR_FUSED_MAX_THREAD_BLOCKS = 64  # all ranks together: 8 clusters of 8


def fused_thread_blocks(hidden: int, itemsize: int, rows: int) -> int:
    """Thread blocks of one rank's fused launch (ffi/fused/cuda_fused.cu,
    LaunchRankFused): the protocol's blocks of the padded rows, `group` to a
    thread block."""
    lib = sifar_jax._ext.lib
    row_blocks = lib.fused_row_blocks(hidden * itemsize)
    blocks = min(-(-rows * lib.fused_padded_row_bytes(hidden * itemsize) // 2048), 64)
    return blocks // (row_blocks // min(row_blocks, 8))


def _vr_fused_check_all(vr, nranks: int, count, fails: list[str]) -> int:
    """Every skew x dtype x row of VR_FUSED_ROWS on `vr`; returns the runs.
    Stops at the first failed call: the communicator is failed from then on."""
    import test_fused as tf

    k, runs = VR_FUSED_ITERATIONS, 0
    for skew_ns in VR_SKEW_NS:
        vr.set_skew(skew_ns, nranks)
        for name, rows_list in VR_FUSED_ROWS.items():
            dtype, elem = VR_DTYPES[name]
            for hidden, rows in rows_list:
                while rows > 1 and (fused_thread_blocks(hidden, dtype.itemsize, rows) * nranks
                                    > VR_FUSED_MAX_THREAD_BLOCKS):
                    rows -= 1
                seed = zlib.crc32(repr(("fused", nranks, skew_ns, name, hidden, rows)).encode())
                rng = np.random.default_rng(seed)
                x = rng.standard_normal((k, nranks, rows, hidden)).astype(dtype)
                r = (2 * rng.standard_normal((rows, hidden))).astype(dtype)
                w = (1 + 0.1 * rng.standard_normal(hidden)).astype(dtype)
                normed, new_res, failure, calls, retried, timeouts = vr.run_fused(
                    elem, x.tobytes(), r.tobytes(), w.tobytes(), hidden, rows, tf.EPS, k)
                runs += 1
                what = f"N={nranks} {name} hidden={hidden} rows={rows} skew={skew_ns} ns"
                if failure or timeouts:
                    fails.append(f"{what}: {failure or f'{timeouts} timeouts'}")
                    return runs
                if calls != k * nranks:
                    fails.append(f"{what}: {calls} calls counted, want {k * nranks}")
                normed = np.frombuffer(normed, dtype).reshape(k, nranks, rows, hidden)
                new_res = np.frombuffer(new_res, dtype).reshape(k, nranks, rows, hidden)
                for it in range(k):
                    want_norm, want_res = tf.model_reference(x[it], r, w)
                    for q in range(nranks):
                        if not tf.same_bits(new_res[it, q], want_res):
                            fails.append(f"{what}: iteration {it} rank {q}: new_residual differs "
                                         f"from the rank-order reference")
                        if not tf.same_bits(normed[it, q], normed[it, 0]):
                            fails.append(f"{what}: iteration {it}: normed differs between ranks")
                        count[name].add(normed[it, q], want_norm)
    return runs


@pytest.mark.parametrize("nranks", [2, 4, 8])
def test_virtual_ranks_fused_rows(nranks):
    import test_fused as tf

    vr = _virtual_ranks_or_skip(nranks, VR_FUSED_SLOT)
    count = {name: tf.UlpCount("the float64 model reference", name) for name in VR_FUSED_ROWS}
    fails: list[str] = []
    try:
        with hang_guard(900):
            runs = _vr_fused_check_all(vr, nranks, count, fails)
    finally:
        vr.close()
    print(f"\nvirtual ranks N={nranks} psum_add_rmsnorm: {runs} runs of "
          f"{VR_FUSED_ITERATIONS} calls")
    assert runs > 0
    assert not fails, "\n".join(fails[:20])
    for c in count.values():
        c.check()


# ------------------------------------------------------------------ multicast --
def test_multicast_is_refused_here(gpus, mesh_factory):
    """Only traces and lowers: nothing is executed, and only after the guard
    has said no. Skipped (not run!) wherever multicast would be allowed."""
    if multicast.refusal() is None:
        pytest.skip("multicast is enabled on this host; not exercising it from the test suite")
    factory = mesh_factory(devices())
    factory.close()
    mesh = factory(2)
    body = lambda v: sifar_jax.sifar_psum(v[0], "tp", algorithm="multicast")[None]  # noqa: E731
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    expected = (ValueError, sifar_jax.MulticastDisabledError) if DRY_RUN_ON_CPU else (
        sifar_jax.MulticastDisabledError,
    )
    with pytest.raises(expected, match="multicast"):
        f.lower(jax.ShapeDtypeStruct((2, 4096), jnp.bfloat16))
    factory.close()


def test_multicast_guard_names_the_host_setting():
    """On the GPU hosts NCCL_NVLS_ENABLE=0 (etc.) are set: even with the
    opt-in, the guard must refuse and say why. Pure Python, nothing runs."""
    set_here = {v: os.environ[v] for v in multicast.DISABLING if v in os.environ}
    if not any(os.environ[v].strip() == off for v, off in multicast.DISABLING.items() if v in os.environ):
        pytest.skip(f"none of {sorted(multicast.DISABLING)} turns multicast off here ({set_here})")
    reason = multicast.refusal(environ=dict(os.environ, **{multicast.ENABLE_VAR: "1"}))
    assert reason is not None and any(v in reason for v in multicast.DISABLING), reason


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        sys.exit(_child_main())
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
