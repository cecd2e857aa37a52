"""Fault injection on the CPU backend: skew forces mis-speculation (results
must stay exact), a dropped rank must time out with a clear error, never hang."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sifar_jax
from sifar_jax import testing
from reference import chain_reference_f32

SLOT = 4096
STEPS = 300
SIZE = 61  # float32 elements: 244 bytes, padded


@contextlib.contextmanager
def hang_guard(seconds: float):
    """Kills the test process with every thread's stack if the block hangs,
    rather than letting CI sit until its own time limit."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def scan_chain_fn(mesh, algorithm):
    """y <- sifar_psum(0.5 * y + x[k]) / n for every k, inside lax.scan; returns every y."""
    n = mesh.shape["tp"]

    def step(y, x):
        y = sifar_jax.sifar_psum(0.5 * y + x, "tp", algorithm=algorithm) / n
        return y, y

    def body(y0, xs):
        # Like lax.psum, sifar_psum's result is invariant over "tp": run the
        # first step outside the scan so the carry has one type throughout.
        y1, _ = step(y0[0], xs[0, 0])
        _, ys = jax.lax.scan(step, y1, xs[0, 1:])
        return jnp.concatenate([y1[None], ys])[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp")), out_specs=P("tp")))


@pytest.mark.parametrize("algorithm", ["sifar", "sifar_flag", "oneshot_db"])
@pytest.mark.parametrize("n", [4, 8])
def test_skew_keeps_results_exact(cpu_mesh, n, algorithm):
    mesh = cpu_mesh(n, slot_bytes=SLOT)
    f = scan_chain_fn(mesh, algorithm)
    rng = np.random.default_rng([n, len(algorithm)])
    y0 = rng.uniform(0.5, 2.0, (n, SIZE)).astype(np.float32)
    xs = rng.uniform(0.5, 2.0, (n, STEPS, SIZE)).astype(np.float32)
    want = chain_reference_f32(y0, xs)
    jax.block_until_ready(f(y0, xs))  # compile and warm up outside the measured window
    before = sifar_jax.stats()[algorithm]
    with hang_guard(300), testing.inject_skew(200, seed=n):
        got = np.asarray(f(y0, xs))  # (n, STEPS, SIZE)
    after = sifar_jax.stats()[algorithm]
    sifar_jax.check()
    assert after["calls"] - before["calls"] == n * STEPS
    assert after["timeouts"] == before["timeouts"]
    bits = got.view(np.int32)
    assert (bits == bits[:1]).all(), "ranks disagree"
    bad = np.nonzero((bits[0] != want.view(np.int32)).any(axis=1))[0]
    assert bad.size == 0, f"{algorithm} n={n}: {bad.size} of {STEPS} all-reduces wrong, e.g. {bad[:5]}"
    if algorithm in ("sifar", "sifar_flag"):
        # The skewed ranks arrive late: speculation must have failed and been retried.
        assert after["retries"] > before["retries"], after
    else:
        assert after["retries"] == before["retries"] == 0, "oneshot_db has no speculation"


def test_skew_context_is_undone(cpu_mesh):
    mesh = cpu_mesh(2, slot_bytes=SLOT)
    f = scan_chain_fn(mesh, "sifar")
    y0 = np.ones((2, 4), np.float32)
    xs = np.ones((2, 20, 4), np.float32)
    jax.block_until_ready(f(y0, xs))
    with testing.inject_skew(5000):  # 5 ms: 20 steps take >= ~50 ms on average
        t0 = time.perf_counter()
        jax.block_until_ready(f(y0, xs))
        skewed = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(f(y0, xs))
    plain = time.perf_counter() - t0
    assert skewed > 0.02 and plain < skewed, (skewed, plain)


@pytest.mark.parametrize("algorithm", [a for a in sifar_jax.ALGORITHMS if a != "multicast"])
def test_dropped_rank_times_out_then_recovers(cpu_mesh, algorithm):
    n = 4
    mesh = cpu_mesh(n, slot_bytes=SLOT)

    def body(v):
        return sifar_jax.sifar_psum(v[0], "tp", algorithm=algorithm)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    x = np.arange(1, 4 * 24 + 1, dtype=np.float32).reshape(n, 24)
    np.testing.assert_array_equal(np.asarray(f(x))[0], x.sum(0))
    sifar_jax.check()

    t0 = time.perf_counter()
    with hang_guard(120), testing.timeout(0.5), testing.drop_rank("tp", 1):
        with pytest.raises(Exception, match="timed out") as e:
            jax.block_until_ready(f(x))
    elapsed = time.perf_counter() - t0
    assert elapsed < 10, f"the timeout took {elapsed:.1f} s"
    msg = str(e.value)
    assert "'tp'" in msg and "rank 1 never arrived" in msg and "epoch" in msg, msg

    # The communicator is failed: check() reports it, and so does the next call, at once.
    with pytest.raises(sifar_jax.SifarError, match=r"axis 'tp'.*rank \d+, epoch \d+") as e:
        sifar_jax.check()
    assert algorithm in str(e.value) and "shutdown" in str(e.value)
    assert sifar_jax.stats()[algorithm]["timeouts"] > 0
    with hang_guard(120):
        t0 = time.perf_counter()
        with pytest.raises(Exception, match="timed out"):
            jax.block_until_ready(f(x))
        assert time.perf_counter() - t0 < 10

    # Recovery, as the error message says: shutdown() then init() again.
    sifar_jax.shutdown()
    sifar_jax.init(mesh, slot_bytes=SLOT)
    sifar_jax.check()
    with hang_guard(120):
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(f(x))[0], x.sum(0))
    sifar_jax.check()
    assert sifar_jax.stats()[algorithm]["calls"] == 3 * n


def test_dropped_rank_in_a_chain(cpu_mesh):
    """A drop in the middle of a scanned chain (8 ranks) also ends in a timeout."""
    n = 8
    mesh = cpu_mesh(n, slot_bytes=SLOT)
    f = scan_chain_fn(mesh, "sifar")
    y0 = np.ones((n, 8), np.float32)
    xs = np.ones((n, 50, 8), np.float32)
    jax.block_until_ready(f(y0, xs))
    t0 = time.perf_counter()
    with hang_guard(120), testing.timeout(0.5), testing.drop_rank("tp", 5):
        with pytest.raises(Exception, match="timed out"):
            jax.block_until_ready(f(y0, xs))
    assert time.perf_counter() - t0 < 10
    with pytest.raises(sifar_jax.SifarError, match="rank 5 never arrived"):
        sifar_jax.check()
    sifar_jax.shutdown()
    sifar_jax.init(mesh, slot_bytes=SLOT)
    out = np.asarray(f(y0, xs))
    np.testing.assert_allclose(out[:, -1], np.full((n, 8), 2.0 - 2.0**-50), rtol=1e-6)


# A program that provokes a timeout, catches it (the call's error and check()'s SifarError)
# and exits without shutdown(): run in a fresh interpreter, whose exit hooks are the subject.
_CAUGHT_TIMEOUT_THEN_EXIT = r"""
import jax, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import sifar_jax
from sifar_jax import testing

mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
sifar_jax.init(mesh, timeout_s=10)
f = jax.jit(jax.shard_map(lambda v: sifar_jax.sifar_psum(v[0], "tp")[None], mesh=mesh,
                          in_specs=P("tp"), out_specs=P("tp")))
x = np.ones((4, 24), np.float32)
f(x).block_until_ready()
with testing.timeout(0.5), testing.drop_rank("tp", 1):
    try:
        jax.block_until_ready(f(x))
    except Exception as e:
        assert "timed out" in str(e), e
        print("call raised")
try:
    sifar_jax.check()
except sifar_jax.SifarError as e:
    print("check raised")
"""


def test_a_caught_timeout_leaves_nothing_at_exit():
    """The failed computation's error was raised (by the call, and by check()): the
    interpreter's exit must not print it again (JAX's exit hooks re-raise a failed
    side-effecting computation's error, twice, as 'Exception ignored in atexit callback')."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    p = subprocess.run([sys.executable, "-c", _CAUGHT_TIMEOUT_THEN_EXIT], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["call", "raised", "check", "raised"], (p.stdout, p.stderr)
    assert "Exception ignored" not in p.stderr and "Traceback" not in p.stderr, p.stderr
