"""One process of the multi-process tests, started by tests/sifar_jax/test_multiprocess.py
through `python -m sifar_jax.launch` (every process runs this same program).

    exact   every portable algorithm over an axis spanning all processes: a
            chain of all-reduces, without and with testing.inject_skew,
            bit-identical to the rank-order float32 reference; one all-reduce
            against lax.psum (cross-process CPU collectives: gloo), int32 exactly
    mesh2d  a ("proc", "dev") mesh: "dev" within each process, "proc" across
            processes; the sum over both axes in rank order, exactly
    kill    process --victim kills itself (SIGKILL) after --after all-reduces;
            the others must fail within the timeout with an error naming it
    hosts   the processes claim different hosts: every process falls back to
            lax.psum with that reason ("auto"), an explicit algorithm raises
    absent  process 1 never calls init: process 0's init raises, naming it
    pool    shutdown() pools the shared workspaces (still mapped) and init takes
            the same ones back; shutdown(release_memory=True) unmaps them; when
            only process 1 released, init falls back to fresh memory; exact
            throughout (--handshake: with the GPUs' `closed` handshake)
    oldexec a function compiled (CUDA graph) before shutdown() runs again after
            init with the same slot (pooled memory reused) and with another
            (pooled memory kept), beside new functions, exactly
    fused   psum_add_rmsnorm over processes: rows in a block, over 2, 4 and 8
            blocks' lines (clusters on GPUs), over 16 and 64 (32 and 128 KB
            padded) and over two rounds of blocks;
            then fused and plain calls of other sizes interleaved on one chain
            across the tag wrap under skew:
            new_residual bit-identical to the rank-order reference, normed
            within test_fused's ulp bounds

    rowpar  sifar_jax.row_parallel and row_parallel_add_rmsnorm in a jit program with
            named shardings (no shard_map of its own) over processes, f32 and bf16:
            the product bit-identical to this device's partial products added in
            rank order in float32 (rounded once); new_residual likewise; the sifar
            call count exact; against XLA's own all-reduce of `x @ w` (not
            --no-psum) within float32 rounding
Each process checks the rows it holds and prints "OK <scenario> ..." lines; any
failure exits non-zero (the launcher propagates it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import warnings

import sifar_jax
from sifar_jax import _jax_compat, _testing, distributed

distributed.initialize()  # before any computation: the launcher's coordinator

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

# tests/ holds the shared references (reference.py) since the tests mirror the code.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reference import chain_reference_f32  # noqa: E402
from test_faults import scan_chain_fn  # noqa: E402

SLOT = 4096
SIZE = 61  # float32 elements: 244 bytes, padded to whole lines
PORTABLE = tuple(sifar_jax.algorithms.PORTABLE)
ME = jax.process_index()


def say(msg: str) -> None:
    print(msg, flush=True)


def global_array(mesh, spec, data: np.ndarray):
    """The global array whose value is `data` (every process holds all of it)."""
    return jax.make_array_from_callback(data.shape, NamedSharding(mesh, spec), lambda i: data[i])


def local_rows(arr) -> dict[int, np.ndarray]:
    """{row: value} of the rows of a ("tp",)-sharded array this process holds."""
    return {s.index[0].start or 0: np.asarray(s.data) for s in arr.addressable_shards}


def expect_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    g, w = np.ascontiguousarray(got), np.ascontiguousarray(want)
    bad = np.nonzero(g.view(np.uint32) != w.view(np.uint32))
    if bad[0].size:
        raise AssertionError(f"process {ME}: {what}: {bad[0].size} words differ from the "
                             f"rank-order float32 reference, first at {[int(b[0]) for b in bad]}")


def tp_mesh():
    return Mesh(np.array(jax.devices()), ("tp",))


def run_exact(args) -> None:
    mesh = tp_mesh()
    n = mesh.size
    sifar_jax.init(mesh, slot_bytes=SLOT, timeout_s=args.timeout)
    (comm,) = sifar_jax.communicators("tp")
    assert comm.processes == tuple(range(jax.process_count())), comm
    local = sum(1 for d in mesh.devices.flat if d.process_index == ME)
    for algorithm in args.algorithms.split(","):
        f = scan_chain_fn(mesh, algorithm)
        rng = np.random.default_rng([n, len(algorithm)])
        y0 = rng.uniform(0.5, 2.0, (n, SIZE)).astype(np.float32)
        xs = rng.uniform(0.5, 2.0, (n, args.steps, SIZE)).astype(np.float32)
        want = chain_reference_f32(y0, xs)
        y0_g, xs_g = global_array(mesh, P("tp"), y0), global_array(mesh, P("tp"), xs)
        for skew_us in (0, 200):
            before = sifar_jax.stats()[algorithm]
            skew = sifar_jax.testing.inject_skew(skew_us, seed=n) if skew_us else contextlib.nullcontext()
            with skew:
                got = f(y0_g, xs_g)
                jax.block_until_ready(got)
            sifar_jax.check()
            after = sifar_jax.stats()[algorithm]
            for row, value in local_rows(got).items():
                expect_bits(value[0], want, f"{algorithm} skew={skew_us}us rank {row}")
            calls = after["calls"] - before["calls"]
            assert calls == local * args.steps, (algorithm, calls)
            assert after["timeouts"] == before["timeouts"]
            retries = after["retries"] - before["retries"]
            if algorithm == "sifar" and skew_us:
                assert retries > 0, "skewed ranks arrive late: sifar must have re-read"
            say(f"OK exact {algorithm} n={n} skew={skew_us}us steps={args.steps} retries={retries}")

    # One all-reduce against lax.psum, which runs on the cross-process CPU
    # collectives (NCCL on GPUs): sifar is the rank-order float32 sum; psum
    # may add in another order (close), and int32 sums agree exactly.
    def both(x):
        ours = sifar_jax.sifar_psum(x[0], "tp")[None]
        if args.no_psum:  # NCCL refuses two ranks on one GPU
            return ours, ours
        return ours, jax.lax.psum(x[0], "tp")[None]

    g = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P("tp"), out_specs=(P("tp"), P("tp"))))
    rng = np.random.default_rng(7)
    x = rng.uniform(-2, 2, (n, 300)).astype(np.float32)
    want = x[0].copy()
    for r in range(1, n):
        want = (want + x[r]).astype(np.float32)
    ours, theirs = g(global_array(mesh, P("tp"), x))
    for row, value in local_rows(ours).items():
        expect_bits(value[0], want, f"sifar_psum vs reference, rank {row}")
        np.testing.assert_allclose(local_rows(theirs)[row][0], want, rtol=1e-5, atol=1e-5)
    xi = rng.integers(-(2**30), 2**30, (n, 300), dtype=np.int32)
    ours, theirs = g(global_array(mesh, P("tp"), xi))
    for row, value in local_rows(ours).items():
        np.testing.assert_array_equal(value, local_rows(theirs)[row])
    say(f"OK exact lax.psum n={n}")

    # Set up again (new workspaces and names, the same compiled function).
    sifar_jax.shutdown()
    sifar_jax.init(mesh, slot_bytes=SLOT, timeout_s=args.timeout)
    ours, _ = g(global_array(mesh, P("tp"), x))
    for row, value in local_rows(ours).items():
        expect_bits(value[0], want, f"after re-init, rank {row}")
    say(f"OK exact re-init n={n}")


def rank_order_sum(x: np.ndarray) -> np.ndarray:
    want = x[0].copy()
    for r in range(1, len(x)):
        want = (want + x[r]).astype(np.float32)
    return want


def shm_mappings() -> set[str]:
    """Paths of the sifar_jax shared-memory objects this process maps (unlinked
    ones read '<path> (deleted)')."""
    with open("/proc/self/maps") as f:
        return {ln.split(None, 5)[5].strip() for ln in f if f"/dev/shm/{distributed.SHM_PREFIX}" in ln}


def mapped_names(handles: dict[str, str]) -> set[str]:
    """Which of these workspaces (CPU handles: shared-memory names) are mapped."""
    maps = shm_mappings()
    names = {bytes.fromhex(h).decode() for h in handles.values()}
    return {n for n in names if any(m.split(" ")[0] == f"/dev/shm{n}" for m in maps)}


def live_handles(axis: str) -> dict[str, str]:
    (c,) = sifar_jax.communicators(axis)
    return distributed.shared_memory_state()["live"][c.comm_id]


def run_pool(args) -> None:
    if args.handshake:
        distributed.HANDSHAKE_PLATFORMS.add("cpu")
        distributed.CLOSE_TIMEOUT_S = 1.5
    axis = "pool"
    mesh = Mesh(np.array(jax.devices()), (axis,))
    n = mesh.size

    def body(v):
        return sifar_jax.sifar_psum(v[0], axis)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))
    rng = np.random.default_rng(17)

    def check(what: str) -> None:  # the same compiled f every time (an old executable)
        for k in range(3):
            x = rng.uniform(-2, 2, (n, 250)).astype(np.float32)
            for row, value in local_rows(f(global_array(mesh, P(axis), x))).items():
                expect_bits(value[0], rank_order_sum(x), f"pool: {what}, call {k}, rank {row}")
        sifar_jax.check()

    def init():
        sifar_jax.init(mesh, slot_bytes=SLOT, timeout_s=args.timeout)
        return live_handles(axis), _testing.comm_workspaces(sifar_jax.communicators(axis)[0].comm_id)

    first, addresses = init()
    assert len(first) == n and mapped_names(first) == {bytes.fromhex(h).decode() for h in first.values()}
    check("first set-up")

    # shutdown(): pooled, still mapped; init takes the very same memory back.
    sifar_jax.shutdown()
    state = distributed.shared_memory_state()
    assert first in state["pooled"] and not state["live"], state
    assert len(mapped_names(first)) == n, "shutdown() must keep the pooled workspaces mapped"
    again, addresses_again = init()
    assert again == first and addresses_again == addresses, "init must reuse the pooled workspaces"
    assert not distributed.shared_memory_state()["pooled"]
    check("re-init on pooled memory")
    say(f"OK pool reuse n={n} handshake={args.handshake}")

    # shutdown(release_memory=True) everywhere: nothing pooled, nothing mapped.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sifar_jax.shutdown(release_memory=True)
    assert not [w for w in caught if "sifar_jax" in str(w.message)], [str(w.message) for w in caught]
    assert distributed.shared_memory_state() == {"live": {}, "pooled": [], "closing": []}
    assert not mapped_names(first), f"released workspaces still mapped: {mapped_names(first)}"
    fresh, _ = init()
    assert not set(fresh.values()) & set(first.values()), "release_memory=True: new memory expected"
    check("after release_memory=True")
    say(f"OK pool release n={n} handshake={args.handshake}")

    # Only process 1 releases: the processes disagree, so every one frees what
    # it holds and allocates anew.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sifar_jax.shutdown(release_memory=(ME == 1))
    waiting = [str(w.message) for w in caught if "has not released" in str(w.message)]
    state = distributed.shared_memory_state()
    if ME == 1 and args.handshake:  # process 0 still maps process 1's memory: kept
        assert waiting and "process 0" in waiting[0], [str(w.message) for w in caught]
        assert state["closing"] == [fresh] and not state["pooled"], state
    else:
        assert not waiting, waiting
        assert state["pooled"] == ([fresh] if ME == 0 else []) and not state["closing"], state
    newest, _ = init()
    assert not set(newest.values()) & set(fresh.values()), "a disagreement must give new memory"
    assert distributed.shared_memory_state()["pooled"] == []
    assert distributed.shared_memory_state()["closing"] == []
    assert not mapped_names(fresh), f"the disagreed-on workspaces are still mapped: {mapped_names(fresh)}"
    check("after a disagreement")
    say(f"OK pool mismatch n={n} handshake={args.handshake}")


def chain_fn(mesh, calls: int = 8):
    """`calls` chained sifar all-reduces (enough thunks for a CUDA graph)."""
    def body(v):
        y = v[0]
        for _ in range(calls):
            y = sifar_jax.sifar_psum(y, "tp", algorithm="sifar") - y
        return y[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))


def chain_reference(x: np.ndarray, calls: int = 8) -> np.ndarray:
    y = x.copy()
    for _ in range(calls):
        y = (rank_order_sum(y)[None] - y).astype(np.float32)
    return y


def run_oldexec(args) -> None:
    mesh = tp_mesh()
    n = mesh.size
    rng = np.random.default_rng(19)

    def check(fn, what: str) -> None:
        x = rng.integers(-8, 9, (n, 500)).astype(np.float32)  # every sum exact; fits SLOT
        want = chain_reference(x)
        assert np.abs(want).max() > 0
        for row, value in local_rows(fn(global_array(mesh, P("tp"), x))).items():
            expect_bits(value[0], want[row], f"oldexec: {what}, rank {row}")

    sifar_jax.init(mesh, slot_bytes=SLOT, timeout_s=args.timeout)
    first = live_handles("tp")
    old = chain_fn(mesh)
    check(old, "old before shutdown")
    sifar_jax.shutdown()
    sifar_jax.init(mesh, slot_bytes=SLOT, timeout_s=args.timeout)  # the pooled memory, reused
    assert live_handles("tp") == first, "init must reuse the pooled workspaces"
    new = chain_fn(mesh)
    for k in range(5):
        check(old, f"old after re-init on pooled memory ({k})")
        check(new, f"new after re-init on pooled memory ({k})")
    sifar_jax.shutdown()
    sifar_jax.init(mesh, slot_bytes=2 * SLOT, timeout_s=args.timeout)  # another layout: kept
    assert first in distributed.shared_memory_state()["pooled"]
    newer = chain_fn(mesh)
    for k in range(5):
        check(old, f"old after re-init with another slot ({k})")
        check(newer, f"new after re-init with another slot ({k})")
    sifar_jax.check()
    say(f"OK oldexec n={n}")


def run_mesh2d(args) -> None:
    nproc = jax.process_count()
    devs = np.array(jax.devices()).reshape(nproc, -1)  # row p: process p's devices
    mesh = Mesh(devs, ("proc", "dev"))
    sifar_jax.init(mesh, slot_bytes=SLOT, timeout_s=args.timeout)
    assert all(c.processes == () for c in sifar_jax.communicators("dev"))
    assert all(c.processes == tuple(range(nproc)) for c in sifar_jax.communicators("proc"))

    def body(x):
        return sifar_jax.sifar_psum(sifar_jax.sifar_psum(x[0, 0], "dev"), "proc")[None, None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("proc", "dev"),
                              out_specs=P("proc", "dev")))
    rng = np.random.default_rng(11)
    x = rng.uniform(-2, 2, devs.shape + (200,)).astype(np.float32)
    per_proc = []
    for p in range(nproc):  # "dev" first, in rank order, then "proc" in rank order
        s = x[p, 0].copy()
        for d in range(1, devs.shape[1]):
            s = (s + x[p, d]).astype(np.float32)
        per_proc.append(s)
    want = per_proc[0]
    for p in range(1, nproc):
        want = (want + per_proc[p]).astype(np.float32)
    for _ in range(3):
        out = f(global_array(mesh, P("proc", "dev"), x))
        for s in out.addressable_shards:
            expect_bits(np.asarray(s.data)[0, 0], want, f"mesh2d shard {s.index}")
    sifar_jax.check()
    say(f"OK mesh2d {devs.shape}")


def run_kill(args) -> None:
    mesh = tp_mesh()
    n = mesh.size
    sifar_jax.init(mesh, slot_bytes=SLOT, timeout_s=args.timeout)

    def body(x):
        return sifar_jax.sifar_psum(x[0], "tp", algorithm=args.algorithms.split(",")[0])[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    x = np.random.default_rng(3).uniform(0.5, 2, (n, 64)).astype(np.float32)
    want = x[0].copy()
    for r in range(1, n):
        want = (want + x[r]).astype(np.float32)
    xg = global_array(mesh, P("tp"), x)
    for i in range(args.after + 50):
        t0 = time.monotonic()
        try:
            out = f(xg)
            jax.block_until_ready(out)
            sifar_jax.check()
        except Exception as e:  # noqa: BLE001 - the expected failure
            elapsed = time.monotonic() - t0
            msg = str(e)
            assert i == args.after + 1, f"failed at call {i}, expected {args.after + 1}: {msg}"
            victim_ranks = [r for r, d in enumerate(mesh.devices.flat)
                            if d.process_index == args.victim]
            named = [f"rank {r} (process {args.victim}) never arrived" for r in victim_ranks]
            assert "timed out" in msg and any(s in msg for s in named), msg
            assert elapsed < args.timeout + 5, f"the error took {elapsed:.1f} s"
            say(f"OK kill: call {i} failed after {elapsed:.1f} s: "
                f"{msg[msg.index('sifar_jax:'):][:300]}")
            sys.stdout.flush()
            # Exit now: jax.distributed's shutdown would wait for the dead process.
            os._exit(0)
        for row, value in local_rows(out).items():
            expect_bits(value[0], want, f"kill: call {i}, rank {row}")
        if ME == args.victim and i == args.after:
            say(f"killing myself after call {i}")
            os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError(f"process {ME}: no call failed after process {args.victim} died")


def run_hosts(args) -> None:
    distributed.host_id = lambda: f"host-{ME}/boot"  # as if each process ran elsewhere
    mesh = Mesh(np.array(jax.devices()), ("hosts",))
    sifar_jax.init(mesh, slot_bytes=SLOT)
    (unsupported,) = sifar_jax.comm.unsupported("hosts")
    assert "spans hosts" in unsupported.reason, unsupported
    assert not sifar_jax.communicators("hosts")
    x = np.random.default_rng(5).uniform(-1, 1, (mesh.size, 40)).astype(np.float32)

    def body(v):
        return sifar_jax.sifar_psum(v[0], "hosts")[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("hosts"), out_specs=P("hosts")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = f(global_array(mesh, P("hosts"), x))
    assert any("spans hosts" in str(w.message) for w in caught), [str(w.message) for w in caught]
    for row, value in local_rows(out).items():
        np.testing.assert_allclose(value[0], x.sum(0), rtol=1e-5, atol=1e-6)

    def explicit(v):
        return sifar_jax.sifar_psum(v[0], "hosts", algorithm="sifar")[None]

    try:
        jax.jit(jax.shard_map(explicit, mesh=mesh, in_specs=P("hosts"), out_specs=P("hosts")))(
            global_array(mesh, P("hosts"), x))
    except ValueError as e:
        assert "spans hosts" in str(e), e
    else:
        raise AssertionError("an explicit algorithm on an axis across hosts must raise")
    say("OK hosts: lax.psum on an axis across hosts")


def run_hosts2d(args) -> None:
    """A ("host", "gpu") mesh, each process as if on its own host, reduced over
    both axes: sifar within the host ("gpu", this process's devices), lax.psum
    across hosts (the product axis falls back: it spans hosts)."""
    distributed.host_id = lambda: f"host-{ME}/boot"
    nproc = jax.process_count()
    devs = np.array(jax.devices()).reshape(nproc, -1)  # row p: process p's devices
    mesh = Mesh(devs, ("host", "gpu"))
    sifar_jax.init(mesh, slot_bytes=SLOT, timeout_s=args.timeout)

    def body(x):
        return sifar_jax.sifar_psum(x[0, 0], ("host", "gpu"))[None, None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("host", "gpu"),
                              out_specs=P("host", "gpu")))
    x = np.random.default_rng(13).uniform(-2, 2, devs.shape + (96,)).astype(np.float32)
    before = sifar_jax.stats()["sifar"]["calls"]
    out = f(global_array(mesh, P("host", "gpu"), x))
    for s in out.addressable_shards:
        np.testing.assert_allclose(np.asarray(s.data)[0, 0], x.sum((0, 1)), rtol=1e-5, atol=1e-5)
    sifar_jax.check()
    (unsupported,) = sifar_jax.comm.unsupported(("host", "gpu"))
    assert "spans hosts" in unsupported.reason, unsupported
    calls = sifar_jax.stats()["sifar"]["calls"] - before
    assert calls == devs.shape[1], f"sifar must serve the in-host axis: {calls} calls"
    say(f"OK hosts2d {devs.shape}: sifar over 'gpu', lax.psum over 'host'")


def run_absent(args) -> None:
    client = _jax_compat.kv_client()
    if ME == 1:  # never sets the axis up; waits until process 0 has given up
        client.blocking_key_value_get("test/absent/done", 60_000)
        return
    distributed.INIT_TIMEOUT_S = 2.0
    t0 = time.monotonic()
    try:
        sifar_jax.init(Mesh(np.array(jax.devices()), ("absent",)))
    except sifar_jax.SifarError as e:
        assert "process 1 did not reach 'identity'" in str(e), e
        assert time.monotonic() - t0 < 10
        say(f"OK absent: {str(e)[:120]}")
    else:
        raise AssertionError("init must fail when a process never comes")
    finally:
        client.key_value_set("test/absent/done", "1")


def run_fused(args) -> None:
    import test_fused as tf

    mesh = tp_mesh()
    n = mesh.size
    sifar_jax.init(mesh, slot_bytes=256 * 1024, timeout_s=args.timeout)
    dt = tf.DTYPES["bfloat16"]
    count = tf.UlpCount("the float64 model reference", "bfloat16")

    # Every row layout in one jit; 5120, 3584, 896, 12288 and 40960 are rows padded to a power
    # of two of lines; 16384, 12288 and 40960 rows over 16 KB (16 and 64 blocks' lines: thread
    # blocks running 2 and 8 of the protocol's blocks). The fused call must serve them all: a
    # fallback to the unfused composition is an error.
    shapes = [(64, 3), (2048, 3), (4096, 1), (4096, 4), (8192, 2), (4096, 20), (5120, 2),
              (3584, 3), (896, 1), (16384, 2), (12288, 3), (40960, 1)]
    k = len(shapes)
    warnings.filterwarnings("error", message=".*falling back.*")
    warnings.filterwarnings("error", message=".*unfused.*")

    def body(*a):
        outs = []
        for x, r, w in zip(a[:k], a[k:2 * k], a[2 * k:]):
            normed, res = sifar_jax.psum_add_rmsnorm(x[0], r, w, "tp", eps=tf.EPS)
            outs += [normed[None], res[None]]
        return tuple(outs)

    rng = tf.rng_for("multiprocess-fused", n)
    data = [tf.make_data(rng, "normal", n, t, h, dt) for h, t in shapes]
    args_g = ([global_array(mesh, P("tp"), d[0]) for d in data]
              + [global_array(mesh, P(), d[1]) for d in data]
              + [global_array(mesh, P(), d[2]) for d in data])
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * k + (P(),) * (2 * k),
                              out_specs=(P("tp"),) * (2 * k)))
    got = f(*args_g)
    sifar_jax.check()
    for i, ((h, t), (x, r, w)) in enumerate(zip(shapes, data)):
        want_norm, want_res = tf.model_reference(x, r, w)
        for row, value in local_rows(got[2 * i + 1]).items():
            assert tf.same_bits(value[0], want_res), f"process {ME}: hidden={h} tokens={t} rank {row}"
        for row, value in local_rows(got[2 * i]).items():
            count.add(value[0], want_norm)
    say(f"OK fused shapes n={n}")

    # Fused and plain calls on one chain: the plain calls' sizes move the
    # first blocks' epochs ahead of the rest of a row, so a row's blocks wrap
    # at different calls (4 epoch bits: a wrap every 14 calls).
    hidden, tokens, steps = 4096, 2, 6

    def chain(xs, zs, r0, w):
        xs, zs = xs[0], zs[0]
        r, outs = r0, []
        for s in range(steps):
            normed, r = sifar_jax.psum_add_rmsnorm(xs[s], r, w, "tp", eps=tf.EPS)
            outs += [normed, r, sifar_jax.sifar_psum(zs[s], "tp"),
                     sifar_jax.sifar_psum(zs[s][:, :64], "tp")]
        return tuple(v[None] for v in outs)

    g = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(P("tp"), P("tp"), P(), P()),
                              out_specs=(P("tp"),) * (4 * steps)))
    with sifar_jax.testing.epoch_bits("tp", 4), sifar_jax.testing.inject_skew(200, seed=13):
        for it in range(3):
            rng = tf.rng_for("multiprocess-interleave", it)
            xs = rng.standard_normal((n, steps, tokens, hidden)).astype(dt)
            zs = rng.standard_normal((n, steps, tokens, hidden)).astype(dt)
            r0 = (2 * rng.standard_normal((tokens, hidden))).astype(dt)
            w = (1 + 0.1 * rng.standard_normal(hidden)).astype(dt)
            out = g(global_array(mesh, P("tp"), xs), global_array(mesh, P("tp"), zs),
                    global_array(mesh, P(), r0), global_array(mesh, P(), w))
            for s, (normed, res, plain) in enumerate(tf.chain_reference(xs, zs, r0, w)):
                for row, value in local_rows(out[4 * s + 1]).items():
                    assert tf.same_bits(value[0], res), f"process {ME}: run {it} step {s} rank {row}"
                for row, value in local_rows(out[4 * s + 2]).items():
                    assert tf.same_bits(value[0], plain), f"process {ME}: plain, step {s}"
                for row, value in local_rows(out[4 * s + 3]).items():
                    assert tf.same_bits(value[0], plain[:, :64]), f"process {ME}: small, step {s}"
                for row, value in local_rows(out[4 * s]).items():
                    count.add(value[0], normed)
    sifar_jax.check()
    count.check()
    say(f"OK fused interleave n={n}")


def run_rowpar(args) -> None:
    mesh = tp_mesh()
    n = mesh.size
    sifar_jax.init(mesh, slot_bytes=SLOT, timeout_s=args.timeout)
    local = sum(1 for d in mesh.devices.flat if d.process_index == ME)
    dev = jax.local_devices()[0]
    t, k, h, eps = 3, 32 * n, 40, 1e-6
    project = jax.jit(lambda x, w: sifar_jax.row_parallel(x, w, mesh=mesh))
    fused = jax.jit(lambda *a: sifar_jax.row_parallel_add_rmsnorm(*a, eps=eps, mesh=mesh))
    for dt in (jnp.float32, jnp.bfloat16):
        rng = np.random.default_rng([n, 5])
        x = rng.standard_normal((t, k)).astype(dt)
        w = (rng.standard_normal((k, h)) / 8).astype(dt)
        r = rng.standard_normal((t, h)).astype(dt)
        g = (1 + rng.standard_normal(h) / 4).astype(dt)
        # Each rank's partial product as this device computes it, summed in rank order.
        rows = k // n
        partials = [np.asarray(jnp.matmul(jax.device_put(x[:, q * rows:(q + 1) * rows], dev),
                                          jax.device_put(w[q * rows:(q + 1) * rows], dev)))
                    for q in range(n)]
        want = rank_order_sum(np.stack([p_.astype(np.float32) for p_ in partials])).astype(dt)
        want_res = (r.astype(np.float32) + want.astype(np.float32)).astype(dt)
        xg, wg = global_array(mesh, P(None, "tp"), x), global_array(mesh, P("tp", None), w)
        rg, gg = global_array(mesh, P(), r), global_array(mesh, P(), g)
        before = sifar_jax.stats()["sifar"]["calls"]
        got = project(xg, wg)
        normed, res = fused(xg, wg, rg, gg)
        jax.block_until_ready((got, normed, res))
        sifar_jax.check()
        calls = sifar_jax.stats()["sifar"]["calls"] - before
        name = np.dtype(dt).name
        for s_ in got.addressable_shards:
            assert np.asarray(s_.data).view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), (
                f"process {ME}: row_parallel {name}: not the rank-order sum of the partials")
        for s_ in res.addressable_shards:
            assert np.asarray(s_.data).view(np.uint8).tobytes() == want_res.view(np.uint8).tobytes(), (
                f"process {ME}: row_parallel_add_rmsnorm {name}: new_residual")
        want_norm = want_res.astype(np.float32)
        want_norm = want_norm / np.sqrt(np.mean(want_norm ** 2, -1, keepdims=True) + eps) * g
        np.testing.assert_allclose(np.asarray(normed.addressable_shards[0].data, np.float32),
                                   want_norm, rtol=2e-2 if dt == jnp.bfloat16 else 1e-5, atol=2e-2)
        # sifar's counter: one plain and one fused call on every local rank, nothing on lax.psum.
        assert calls == 2 * local, (name, calls, local)
        if not args.no_psum:  # XLA's own all-reduce (gloo / NCCL) of the same product
            xla = jax.jit(jnp.matmul, out_shardings=NamedSharding(mesh, P()))(xg, wg)
            np.testing.assert_allclose(np.asarray(xla.addressable_shards[0].data, np.float32),
                                       want.astype(np.float32), rtol=1e-5 if dt == jnp.float32 else 1e-2,
                                       atol=1e-5 if dt == jnp.float32 else 1e-2)
        say(f"OK rowpar {name} n={n} sifar calls={calls}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenarios", nargs="+", choices=tuple(SCENARIOS))
    p.add_argument("--algorithms", default=",".join(PORTABLE))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--after", type=int, default=3)
    p.add_argument("--no-psum", action="store_true", help="skip the lax.psum comparison")
    p.add_argument("--handshake", action="store_true", help="pool: the `closed` handshake on the CPU")
    args = p.parse_args()
    say(f"PID {os.getpid()} process {ME} of {jax.process_count()}, "
        f"{jax.local_device_count()} local device(s) of {jax.device_count()}")
    for scenario in args.scenarios:
        SCENARIOS[scenario](args)
    sifar_jax.shutdown()
    say("DONE")


SCENARIOS = {"exact": run_exact, "mesh2d": run_mesh2d, "kill": run_kill, "hosts": run_hosts,
             "hosts2d": run_hosts2d, "absent": run_absent, "pool": run_pool,
             "oldexec": run_oldexec, "fused": run_fused, "rowpar": run_rowpar}

if __name__ == "__main__":
    main()
