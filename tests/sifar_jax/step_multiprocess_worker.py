"""One process of llama_step across devices in several processes (tests/sifar_jax/
test_step_multiprocess.py, through `python -m sifar_jax.launch`; every process runs this same
program). One rank per device, the ranks in different processes: the step's all-reduce reads
the peers' words through the communicator's shared workspaces (POSIX shared memory on the CPU,
CUDA IPC mappings on GPUs, also two processes sharing one GPU: --share-gpu).

    bits    the step at TP = the process count, sifar and oneshot, fp8 and bf16: h, this
            process's cache shard and logit shard bit for bit the same model's step as
            virtual ranks (llama_step_virtual_ranks on this process's device; slot < 64, so
            the GPU kernel's attention is one key range whatever the grid)
    skew    --steps steps in one jit loop under testing.inject_skew (--skew-us): every step's
            h and logit shard the unskewed step's bits (0 mismatching steps); sifar re-read
            stale words
    absent  process --victim's rank skips the step (testing.drop_rank): the others get NaN in
            h and every logit and a SifarError naming the phase and the missing rank within the
            timeout; after shutdown() and init() (every process) the next step is exact
    kill    process --victim kills itself (SIGKILL) after --after steps; the others' next step
            gives NaN and a SifarError naming the rank, its process and the phase within the
            timeout
    seam    steps between plain psums of other sizes (test_step_across_devices.py's SEAM_*: the
            plain all-reduce's protocol blocks lagging behind block 0 when a step begins), sifar
            and oneshot: --steps iterations in one jit loop under --skew-us and 3 epoch bits,
            every step the virtual ranks' bits and every psum exact; then, on a fresh
            communicator, the step after block 0 crossed the tag wrap alone in a plain call
            (SEAM_WRAP), exact
Each process prints "OK step <scenario> ..." lines; any failure exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import sifar_jax
from sifar_jax import distributed

distributed.initialize()  # before any computation: the launcher's coordinator

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_step_across_devices import (BF16, E4M3, KW, SEAM_POS, SEAM_WRAP_SMALL,  # noqa: E402
                                      seam_inputs, seam_loop_fn, seam_operands, seam_total,
                                      seam_wrap_fn, step_operands)

from sifar_jax import decode_step_tp as tpm  # noqa: E402
from sifar_jax import testing  # noqa: E402

ME = jax.process_index()


def say(msg: str) -> None:
    print(msg, flush=True)


def tp_mesh():
    return Mesh(np.array(jax.devices()), ("tp",))


def global_tree(mesh, tree, specs):
    """Global arrays of the (host) values in `tree`, sharded by `specs` over `mesh` (every
    process holds the whole values)."""
    def one(spec, v):
        v = np.asarray(v)
        return jax.make_array_from_callback(v.shape, NamedSharding(mesh, spec), lambda i: v[i])

    return jax.tree.map(one, specs, tree, is_leaf=lambda s: isinstance(s, P))


def local_shards(arr) -> dict:
    """{index tuple: value} of the shards of `arr` this process holds."""
    return {tuple((s.start or 0) for s in sh.index): np.asarray(sh.data)
            for sh in arr.addressable_shards}


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def expect_shards(arr, want: np.ndarray, what: str) -> None:
    """Every shard of `arr` this process holds equals the same slice of `want`, bit for bit."""
    want = np.asarray(want)
    for sh in arr.addressable_shards:
        got = np.asarray(sh.data)
        ref = want[sh.index]
        bad = np.count_nonzero(bits(got) != bits(ref))
        if bad:
            raise AssertionError(f"process {ME}: {what}: {bad} of {got.size} elements of the "
                                 f"shard at {sh.index} differ from the virtual ranks' step")


def step_fn(mesh, allreduce, head=True):
    def f(x, rope, pos, fnorm, layers, cache, hd):
        return sifar_jax.llama_step(x, rope, pos, fnorm, layers, cache, head=hd, axis_name="tp",
                                    allreduce=allreduce, **KW)

    def run(x, rope, pos, fnorm, layers, cache, hd):
        return jax.shard_map(f, mesh=mesh, in_specs=tpm.tp_in_specs(layers, "tp", hd),
                             out_specs=tpm.tp_out_specs("tp", True))(
            x, rope, pos, fnorm, layers, cache, hd)

    return jax.jit(run)


def operands(mesh, wdt, seed):
    """(the TP=1 operands on this process's device, the global TP operands, pos)."""
    n = mesh.size
    x, rope, fnorm, layers, cache, head = step_operands(wdt, seed=seed)
    pos = np.array([9, 2], np.int32)
    lt = tpm.tp_layout(layers, n)
    specs = tpm.tp_in_specs(lt, "tp", head)
    host = (x, rope, pos, fnorm, lt, cache, head)
    tp = global_tree(mesh, jax.tree.map(np.asarray, host), specs)
    local = jax.device_put((x, rope, jnp.asarray(pos), fnorm, layers, cache, head),
                           jax.local_devices()[0])
    return local, tp


def virtual(local, n, allreduce):
    x, rope, pos, fnorm, layers, cache, head = local
    h, c, lg, st = sifar_jax.llama_step_virtual_ranks(x, rope, pos, fnorm, layers, cache,
                                                      head=head, ranks=n, allreduce=allreduce,
                                                      **KW)
    assert not sifar_jax.check_step_status(st).failed
    return np.asarray(h), np.asarray(c), np.asarray(lg)


def run_bits(args) -> None:
    mesh = tp_mesh()
    n = mesh.size
    sifar_jax.init(mesh, timeout_s=args.timeout)
    for allreduce in ("sifar", "oneshot"):
        for wdt, name in ((E4M3, "fp8"), (BF16, "bf16")):
            local, tp = operands(mesh, wdt, seed=n)
            want = virtual(local, n, allreduce)
            before = sifar_jax.stats()[allreduce]["calls"]
            got = jax.block_until_ready(step_fn(mesh, allreduce)(*tp))
            sifar_jax.check()
            for g, w, what in zip(got, want, ("h", "cache", "logits")):
                expect_shards(g, w, f"{allreduce} {name} {what}")
            calls = sifar_jax.stats()[allreduce]["calls"] - before
            say(f"OK step bits {allreduce} {name} n={n} calls={calls}")


def run_skew(args) -> None:
    mesh = tp_mesh()
    n = mesh.size
    sifar_jax.init(mesh, timeout_s=args.timeout)
    steps = args.steps
    for allreduce in args.skew_allreduce.split(","):
        local, tp = operands(mesh, E4M3, seed=20 + n)
        x, rope, pos, fnorm, lt, cache, head = tp
        h0, _, lg0 = jax.block_until_ready(step_fn(mesh, allreduce)(*tp))

        def body_all(x, rope, pos, fnorm, layers, cache, hd, h0, lg0):
            def body(_, carry):
                cache, bad = carry
                h, cache, lg = sifar_jax.llama_step(x, rope, pos, fnorm, layers, cache, head=hd,
                                                    axis_name="tp", allreduce=allreduce, **KW)
                same = (jnp.all(jax.lax.bitcast_convert_type(h, jnp.uint16)
                                == jax.lax.bitcast_convert_type(h0, jnp.uint16))
                        & jnp.all(jax.lax.bitcast_convert_type(lg, jnp.uint32)
                                  == jax.lax.bitcast_convert_type(lg0, jnp.uint32)))
                return cache, bad + (~same).astype(jnp.int32)

            bad0 = jax.lax.pcast(jnp.int32(0), ("tp",), to="varying")
            _, bad = jax.lax.fori_loop(0, steps, body, (cache, bad0))
            return bad[None]

        specs = tpm.tp_in_specs(lt, "tp", head) + (P(), P("tp"))
        loop = jax.jit(jax.shard_map(body_all, mesh=mesh, in_specs=specs, out_specs=P("tp")))
        before = sifar_jax.stats()[allreduce]
        t0 = time.monotonic()
        with testing.inject_skew(args.skew_us, seed=n):
            bad = jax.block_until_ready(loop(*tp, h0, lg0))
        elapsed = time.monotonic() - t0
        sifar_jax.check()
        after = sifar_jax.stats()[allreduce]
        mismatches = sum(int(v[0]) for v in local_shards(bad).values())
        retries = after["retries"] - before["retries"]
        assert mismatches == 0, f"process {ME}: {mismatches} skewed {allreduce} steps differ"
        if allreduce == "sifar":
            assert retries > 0, "no stale word was ever read: the skew did not reach the reads"
        say(f"OK step skew {allreduce} n={n} steps={steps} mismatches=0 retries={retries} "
            f"in {elapsed:.1f} s")


def _expect_failure(text: str, victim_ranks, phase: str = "phase 1 (layer 0's o)") -> None:
    assert f"llama_step's all-reduce of {phase}" in text, text
    assert any(f"rank {r}" in text and "never arrived" in text for r in victim_ranks), text


def run_absent(args) -> None:
    mesh = tp_mesh()
    n = mesh.size
    sifar_jax.init(mesh, timeout_s=args.timeout)
    victim_ranks = [r for r, d in enumerate(mesh.devices.flat) if d.process_index == args.victim]
    for allreduce in ("sifar", "oneshot"):
        local, tp = operands(mesh, E4M3, seed=40 + n)
        f = step_fn(mesh, allreduce)
        good = jax.block_until_ready(f(*tp))
        sifar_jax.check()
        t0 = time.monotonic()
        with testing.drop_rank("tp", victim_ranks[0]):
            h, _, logits = jax.block_until_ready(f(*tp))
        elapsed = time.monotonic() - t0
        assert all(np.isnan(v.astype(np.float32)).all() for v in local_shards(h).values())
        assert all(np.isnan(v).all() for v in local_shards(logits).values())
        if ME != args.victim:
            try:
                sifar_jax.check()
            except sifar_jax.SifarError as e:
                _expect_failure(str(e), victim_ranks)
                msg = str(e)
            else:
                raise AssertionError(f"process {ME}: check() did not report the absent rank")
            assert elapsed < args.timeout + 5, f"the failure took {elapsed:.1f} s"
            say(f"OK step absent {allreduce}: NaN and the error after {elapsed:.1f} s: "
                f"{msg[:240]}")
        else:
            say(f"OK step absent {allreduce}: skipped, NaN")
        sifar_jax.comm.wait_for_effects()
        sifar_jax.shutdown()
        sifar_jax.init(mesh, timeout_s=args.timeout)
        again = jax.block_until_ready(f(*tp))
        sifar_jax.check()
        for g, w, what in zip(again, good, ("h", "cache", "logits")):
            for (idx, v), (_, u) in zip(sorted(local_shards(g).items()),
                                        sorted(local_shards(w).items())):
                assert np.array_equal(bits(v), bits(u)), f"{allreduce} {what} after re-init"
        say(f"OK step absent {allreduce}: exact after re-init")


def run_kill(args) -> None:
    mesh = tp_mesh()
    n = mesh.size
    sifar_jax.init(mesh, timeout_s=args.timeout)
    victim_ranks = [r for r, d in enumerate(mesh.devices.flat) if d.process_index == args.victim]
    local, tp = operands(mesh, E4M3, seed=60 + n)
    f = step_fn(mesh, args.algorithm)
    good = [local_shards(a) for a in jax.block_until_ready(f(*tp))]
    for i in range(args.after + 50):
        t0 = time.monotonic()
        out = jax.block_until_ready(f(*tp))
        failed = None
        try:
            sifar_jax.check()
        except sifar_jax.SifarError as e:
            failed = str(e)
        elapsed = time.monotonic() - t0
        if failed is not None:
            assert i == args.after + 1, f"failed at step {i}, expected {args.after + 1}: {failed}"
            named = [f"rank {r} (process {args.victim}) never arrived" for r in victim_ranks]
            assert any(s in failed for s in named), failed
            assert "llama_step's all-reduce of phase 1 (layer 0's o)" in failed, failed
            assert all(np.isnan(v.astype(np.float32)).all() for v in local_shards(out[0]).values())
            assert elapsed < args.timeout + 5, f"the error took {elapsed:.1f} s"
            say(f"OK step kill: step {i} failed after {elapsed:.1f} s: "
                f"{failed[failed.index('sifar_jax:'):][:300]}")
            sys.stdout.flush()
            os._exit(0)  # jax.distributed's shutdown would wait for the dead process
        for g, w in zip(out, good):
            for idx, v in local_shards(g).items():
                assert np.array_equal(bits(v), bits(w[idx])), f"kill: step {i} differs"
        if ME == args.victim and i == args.after:
            say(f"killing myself after step {i}")
            os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError(f"process {ME}: no step failed after process {args.victim} died")


def run_seam(args) -> None:
    mesh = tp_mesh()
    n = mesh.size
    x, rope, fnorm, layers, cache, head = seam_operands()
    pos = np.array(SEAM_POS, np.int32)
    lt = tpm.tp_layout(layers, n)
    local = jax.device_put((x, rope, jnp.asarray(pos), fnorm, layers, cache, head),
                           jax.local_devices()[0])
    for allreduce in ("sifar", "oneshot"):
        want_h, _, want_lg = virtual(local, n, allreduce)
        sifar_jax.init(mesh, timeout_s=args.timeout)
        f, specs = seam_loop_fn(mesh, allreduce, args.steps, head)
        extra, total = seam_inputs(n, seam_total(allreduce))
        tp = global_tree(mesh, jax.tree.map(np.asarray, (x, rope, pos, fnorm, lt, cache, head,
                                                         want_h, want_lg, extra, total)),
                         specs(lt))
        before = sifar_jax.stats()
        t0 = time.monotonic()
        with testing.inject_skew(args.skew_us, seed=n + 7), testing.epoch_bits("tp", 3):
            bad = jax.block_until_ready(f(*tp))
        elapsed = time.monotonic() - t0
        sifar_jax.check()
        counts = np.sum([v for v in local_shards(bad).values()], axis=0).reshape(-1)
        assert counts.tolist() == [0, 0], \
            f"process {ME}: {allreduce}: {counts[0]} steps and {counts[1]} psums differ"
        calls = sifar_jax.stats()[allreduce]["calls"] - before[allreduce]["calls"]
        say(f"OK step seam loop {allreduce} n={n} steps={args.steps} mismatches=0 "
            f"calls={calls} in {elapsed:.1f} s")

        # From fresh epochs: the step after block 0 wrapped alone in a plain call.
        sifar_jax.comm.wait_for_effects()
        sifar_jax.shutdown()
        sifar_jax.init(mesh, timeout_s=args.timeout)
        fw, wspecs = seam_wrap_fn(mesh, allreduce, head)
        big, big_sum = seam_inputs(n, 1024, seed=1)
        small, small_sum = seam_inputs(n, 8, seed=2)
        tpw = global_tree(mesh, jax.tree.map(np.asarray, (x, rope, pos, fnorm, lt, cache, head,
                                                          big, small)), wspecs(lt))
        with testing.epoch_bits("tp", 3), testing.inject_skew(args.wrap_skew_us, seed=n + 3):
            h1, lg1, h2, lg2, b, sm = jax.block_until_ready(fw(*tpw))
        sifar_jax.check()
        expect_shards(h1, want_h, f"seam wrap {allreduce} h (first step)")
        expect_shards(lg1, want_lg, f"seam wrap {allreduce} logits (first step)")
        expect_shards(h2, want_h, f"seam wrap {allreduce} h (the step after the wrap)")
        expect_shards(lg2, want_lg, f"seam wrap {allreduce} logits (the step after the wrap)")
        expect_shards(b, big_sum, f"seam wrap {allreduce} 4 KB psum")
        ks = np.arange(1, SEAM_WRAP_SMALL + 1, dtype=np.float32)[:, None]
        expect_shards(sm, small_sum * ks, f"seam wrap {allreduce} small psums")
        say(f"OK step seam wrap {allreduce} n={n}: exact")
        sifar_jax.comm.wait_for_effects()
        sifar_jax.shutdown()


SCENARIOS = {"bits": run_bits, "skew": run_skew, "absent": run_absent, "kill": run_kill,
             "seam": run_seam}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenarios", nargs="+", choices=tuple(SCENARIOS))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--skew-us", type=float, default=200.0)
    p.add_argument("--skew-allreduce", default="sifar,oneshot",
                   help="skew: the all-reduces inside the step it runs, in order")
    p.add_argument("--wrap-skew-us", type=float, default=5000.0,
                   help="seam: the skew of the wrap's sequence (one pair of steps)")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--after", type=int, default=3)
    p.add_argument("--algorithm", default="sifar", choices=("sifar", "oneshot"))
    args = p.parse_args()
    say(f"PID {os.getpid()} process {ME} of {jax.process_count()}, "
        f"{jax.local_device_count()} local device(s) of {jax.device_count()}")
    for scenario in args.scenarios:
        SCENARIOS[scenario](args)
    sifar_jax.shutdown()
    say("DONE")


if __name__ == "__main__":
    main()
