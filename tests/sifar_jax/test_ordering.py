"""Ordering, lanes, the epoch-tag wrap and failed outputs, on the CPU backend
(real threads as ranks, so calls that XLA:CPU runs concurrently really race)
and, where two GPUs exist, on the CUDA backend (command buffers on).

- Calls that no data dependence orders (a scan body and its caller, two
  executables run from two threads) must each pair the same call on every rank:
  every result exact.
- Crossing the tag wrap must never let an old word validate: the wrap is made
  cheap to reach with testing.epoch_bits, and a big payload first leaves old
  words past the later small payloads.
- Epochs just below the 32-bit wrap, int32/uint32 sums, the call trace.
"""

from __future__ import annotations

import threading
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sifar_jax
from conftest import MeshFactory, cpu_devices, gpu_device_list
from sifar_jax import testing

ALGS = tuple(a for a in sifar_jax.ALGORITHMS if a != "multicast")
SLOT = 4096


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def rank_order_sum(parts: np.ndarray) -> np.ndarray:
    """float32, rank order, one rounding per add: what every rank must return."""
    acc = parts[0].astype(np.float32)
    for p in parts[1:]:
        acc = (acc + p).astype(np.float32)
    return acc


@pytest.fixture(params=["cpu", "gpu"])
def cpu_mesh(request):
    """Factory of initialised meshes on the CPU host devices or the GPUs (the
    name keeps the CPU tests' spelling); shut down after the test."""
    if request.param == "gpu":
        devs = gpu_device_list()
        if len(devs) < 2:
            pytest.skip("needs at least 2 CUDA GPUs")
    else:
        devs = cpu_devices()
    factory = MeshFactory(devs)
    factory.close()
    yield factory
    factory.close()


def shard(mesh, f, n_in=1):
    spec = P("tp")
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * n_in, out_specs=spec))


# ------------------------------------------------------------------ ordering --
@pytest.mark.parametrize("algorithm", ["sifar", "oneshot_db"])
def test_calls_inside_and_outside_a_scan_body_pair_correctly(cpu_mesh, algorithm):
    """One jit: a scan whose body all-reduces, and independent all-reduces of
    the caller that do not depend on the scan. XLA:CPU runs the loop and the
    caller's calls concurrently; both chains must stay exact."""
    # Payloads past XLA:CPU's threshold for running small thunks in program
    # order (otherwise the schedule alone would keep the ranks in step).
    n, steps, size = 4, 12, 2048
    mesh = cpu_mesh(n, slot_bytes=4 * size)

    def body(x, z):
        def step(c, _):  # the carry stays varying: the sum plus this rank's x
            c = sifar_jax.sifar_psum(c, "tp", algorithm=algorithm) * 0.25 + x[0] * 0.5
            return c, c

        _, ys = jax.lax.scan(step, x[0], None, length=steps)
        outer = [sifar_jax.sifar_psum(z[0] + k, "tp", algorithm=algorithm) for k in range(steps)]
        return ys[None], jnp.stack(outer)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp")),
                              out_specs=(P("tp"), P("tp"))))
    with testing.inject_skew(200, seed=3):
        for it in range(6):
            rng = rng_for("scan", algorithm, it)
            x = rng.standard_normal((n, size)).astype(np.float32)
            z = rng.standard_normal((n, size)).astype(np.float32)
            ys, outer = jax.device_get(f(x, z))
            c = x
            for k in range(steps):
                c = (rank_order_sum(c) * np.float32(0.25) + x * np.float32(0.5)).astype(np.float32)
                np.testing.assert_array_equal(ys.reshape(n, steps, size)[:, k], c)
            for k in range(steps):
                want = rank_order_sum((z + np.float32(k)).astype(np.float32))
                np.testing.assert_array_equal(outer.reshape(n, steps, size)[:, k],
                                              np.broadcast_to(want, (n, size)))


def run_two_threads(mesh, lock):
    """Two jitted functions on one mesh, each dispatched 40 times without
    waiting from its own thread at the same time. Returns (errors, mismatches)."""
    n, size, calls = mesh.shape["tp"], 2048, 8

    def chain(x):
        for k in range(calls):
            x = sifar_jax.sifar_psum(x, "tp") * 0.25 + k
        return x

    f = shard(mesh, chain)
    g = shard(mesh, lambda x: chain(x * 2.0))

    def expect(x):
        for k in range(calls):
            x = np.broadcast_to((rank_order_sum(x) * np.float32(0.25) + np.float32(k)).astype(np.float32), x.shape)
        return x

    errors: list = []
    mismatches: list = []

    def worker(fn, scale, seed):
        try:
            xs = [rng_for("threads", seed, it).standard_normal((n, size)).astype(np.float32)
                  for it in range(40)]
            outs = []
            for x in xs:
                with lock:
                    outs.append(fn(x))
            for x, got in zip(xs, outs):
                got = np.asarray(got)
                if not np.array_equal(got, expect((x * np.float32(scale)).astype(np.float32))):
                    mismatches.append(got)
        except Exception as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(f, 1.0, 1)),
               threading.Thread(target=worker, args=(g, 2.0, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors, mismatches


def test_two_threads_two_executables_one_mesh(cpu_mesh):
    """With sifar_jax.dispatch_lock held around each dispatch: every result exact."""
    mesh = cpu_mesh(4, slot_bytes=8192)
    with testing.inject_skew(100, seed=5):
        errors, mismatches = run_two_threads(mesh, sifar_jax.dispatch_lock)
    assert not errors, errors[0]
    assert not mismatches


def test_two_threads_without_the_lock_never_return_a_wrong_sum(cpu_mesh):
    """Without the lock the devices may run the two executables in different
    orders: the result is exact or a clear timeout error, never a wrong sum."""
    import contextlib

    mesh = cpu_mesh(4, slot_bytes=8192)
    with testing.timeout(1.0):
        errors, mismatches = run_two_threads(mesh, contextlib.nullcontext())
    assert not mismatches, f"{len(mismatches)} wrong results"
    for e in errors:
        assert "timed out" in str(e) and "same order" in str(e), e


def test_chain_ids_differ_between_jaxprs():
    from sifar_jax import ordering

    seen = {}

    def f(x):
        seen["outer"] = ordering.chain_id(x)

        def step(c, _):
            seen["inner"] = ordering.chain_id(c)
            return c, None

        jax.lax.scan(step, x, None, length=2)
        seen["outer_again"] = ordering.chain_id(x + 1)
        return x

    jax.jit(f)(jnp.ones(3))
    assert seen["outer"] == seen["outer_again"] != seen["inner"]
    assert ordering.chain_id(np.ones(3)) == 0


def test_chain_ids_are_counted_per_communicator():
    """Tracing calls on another axis does not shift this axis's chain ids (a process that
    traces one more function on an axis of its own still agrees with its peers)."""
    from sifar_jax import ordering

    def ids(scopes):
        got = []

        def f(x):
            got.extend(ordering.chain_id(x, s) for s in scopes)
            return x

        jax.jit(f)(jnp.ones(3))
        return got

    a1, = ids([101])
    b1, = ids([202])
    a2, b2 = ids([101, 202])
    a3, = ids([101])
    assert (a2, a3) == (a1 + 1, a1 + 2) and b2 == b1 + 1  # axis 202's traces left 101's alone


# --------------------------------------------------------------- epoch wrap --
@pytest.mark.parametrize("algorithm", ALGS)
def test_crossing_the_tag_wrap_never_accepts_old_words(cpu_mesh, algorithm):
    """Tags carry 4 epoch bits here, so a tag comes back every 14 epochs (the
    wrap skips two), at the same slot parity. One chain runs a full-slot
    all-reduce then 13 small ones, 8 times: from the second round on, every
    full call runs at the tag the previous full call left in every line, under
    skew (so a late peer's old word is what an early reader finds). Without
    the clearing at the wrap this returns wrong sums; with it every sum is
    exact."""
    n, rounds, smalls = 2, 8, 13
    mesh = cpu_mesh(n, slot_bytes=SLOT)
    full, small = SLOT // 4, 8

    def body(a, b):
        outs = [sifar_jax.sifar_psum(a, "tp", algorithm=algorithm)]
        outs += [sifar_jax.sifar_psum(b[0, k], "tp", algorithm=algorithm) for k in range(smalls)]
        return outs[0], jnp.stack(outs[1:])[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp")),
                              out_specs=(P("tp"), P("tp"))))
    rng = rng_for("wrap", algorithm)
    with testing.epoch_bits("tp", 4), testing.inject_skew(300, seed=11):
        for it in range(rounds):
            a = rng.standard_normal((n, full)).astype(np.float32)
            b = rng.standard_normal((n, smalls, small)).astype(np.float32)
            ga, gb = jax.device_get(f(a, b))
            np.testing.assert_array_equal(ga, np.broadcast_to(rank_order_sum(a), a.shape),
                                          err_msg=f"round {it}: full payload")
            want = np.stack([rank_order_sum(b[:, k]) for k in range(smalls)])
            np.testing.assert_array_equal(gb, np.broadcast_to(want, (n, smalls, small)),
                                          err_msg=f"round {it}: small payloads")
    sifar_jax.check()


@pytest.mark.parametrize("algorithm", ALGS)
def test_epochs_across_the_32_bit_wrap(cpu_mesh, algorithm):
    n = 4
    mesh = cpu_mesh(n, slot_bytes=SLOT)
    f = shard(mesh, lambda x: sifar_jax.sifar_psum(x, "tp", algorithm=algorithm))
    testing.set_epochs("tp", 0xFFFFFFFF - 6)
    rng = rng_for("wrap32", algorithm)
    for k in range(16):
        x = rng.standard_normal((n, 40 + 8 * k)).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(f(x)), np.broadcast_to(rank_order_sum(x), x.shape))
    sifar_jax.check()


# ------------------------------------------------------------------- integers --
@pytest.mark.parametrize("dtype", [np.int32, np.uint32])
@pytest.mark.parametrize("algorithm", ALGS)
def test_integer_sums_are_exact_and_wrap_like_lax_psum(cpu_mesh, dtype, algorithm):
    n = 4
    mesh = cpu_mesh(n, slot_bytes=SLOT)
    info = np.iinfo(dtype)
    x = rng_for("int", dtype, algorithm).integers(info.min, info.max, (n, 77), dtype=dtype, endpoint=True)
    got = shard(mesh, lambda v: sifar_jax.sifar_psum(v, "tp", algorithm=algorithm))(x)
    want = shard(mesh, lambda v: jax.lax.psum(v, "tp"))(x)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ----------------------------------------------------------------- call trace --
def test_call_trace_records_every_call_and_rank(cpu_mesh):
    n, calls = 2, 5
    mesh = cpu_mesh(n, slot_bytes=SLOT)
    f = shard(mesh, lambda x: sifar_jax.sifar_psum(x, "tp"))
    x = rng_for("trace").standard_normal((n, 32)).astype(np.float32)
    f(x).block_until_ready()  # outside the block: not recorded
    with sifar_jax.call_trace("tp") as trace:
        for _ in range(calls):
            f(x).block_until_ready()
    rec = trace.records()
    assert len(rec) == calls * n
    assert sorted(set(rec["rank"].tolist())) == list(range(n))
    assert (rec["end_ns"] >= rec["start_ns"]).all()
    assert set(rec["algorithm"].tolist()) == {sifar_jax.algorithms.IDS["sifar"]}
    for r in range(n):
        e = rec["epoch"][rec["rank"] == r]
        assert (np.diff(e.astype(np.int64)) == 1).all()


# ------------------------------------------------------------- failed calls --
@pytest.mark.parametrize("nbytes", [16, 4096, 8192, 48 * 1024])
@pytest.mark.parametrize("algorithm", ALGS)
def test_a_timed_out_call_returns_nan_everywhere(cpu_mesh, algorithm, nbytes):
    """Rank 1's blocks from block 1 on never arrive: rank 0's block 0 succeeds,
    the others time out. Every element of rank 0's output must be NaN (the
    failing blocks fill all of it, whatever their line size), never a stale
    or partial result. (The CPU backend raises instead: one block per rank.)"""
    mesh = cpu_mesh(2, slot_bytes=64 * 1024)
    if mesh.devices.flat[0].platform == "cpu":
        pytest.skip("the CPU backend raises on a timeout (one block per rank)")
    n = nbytes // 4
    line = 8 if algorithm in sifar_jax.algorithms.TAGGED else 16
    from_block = 1 if nbytes > 256 * line else 0  # one block: drop it all
    f = shard(mesh, lambda x: sifar_jax.sifar_psum(x, "tp", algorithm=algorithm))
    x = rng_for("nan", algorithm, nbytes).standard_normal((2, n)).astype(np.float32)
    f(x).block_until_ready()  # compiled, and the output buffer pool holds plausible numbers
    with testing.timeout(0.3), testing.drop_rank("tp", 1, from_block=from_block):
        out = np.asarray(f(x))[0]  # rank 0's result (rank 1 skipped its call)
    assert np.isnan(out).all(), f"{np.count_nonzero(~np.isnan(out))} of {n} elements not NaN"
    with pytest.raises(sifar_jax.SifarError, match="timed out"):
        sifar_jax.check()


@pytest.mark.parametrize("how", ["two_shard_maps", "nested_jit"])
def test_calls_of_separate_traces_in_one_jit(cpu_mesh, how):
    """Two shard_maps in one jit, or a jit nested in the shard_map body: each
    is its own trace, so no ordering operand links their calls, and XLA
    inlines them into one computation where they are independent."""
    n, size, calls = 4, 2048, 6
    mesh = cpu_mesh(n, slot_bytes=4 * size)

    def chain(x):
        for k in range(calls):
            x = sifar_jax.sifar_psum(x, "tp") * 0.25 + x * 0.5 + k
        return x

    spec = P("tp")
    if how == "two_shard_maps":
        sm = lambda: jax.shard_map(chain, mesh=mesh, in_specs=spec, out_specs=spec)  # noqa: E731
        f = jax.jit(lambda a, b: (sm()(a), sm()(b)))
    else:
        def body(a, b):
            return jax.jit(chain)(a), jax.jit(chain)(b)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))

    def expect(x):
        for k in range(calls):
            x = (rank_order_sum(x) * np.float32(0.25) + x * np.float32(0.5) + np.float32(k)).astype(np.float32)
        return x

    with testing.inject_skew(100, seed=7):
        for it in range(8):
            rng = rng_for("separate", how, it)
            a = rng.standard_normal((n, size)).astype(np.float32)
            b = rng.standard_normal((n, size)).astype(np.float32)
            ga, gb = jax.device_get(f(a, b))
            np.testing.assert_array_equal(ga, expect(a))
            np.testing.assert_array_equal(gb, expect(b))
