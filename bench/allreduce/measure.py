"""bench.allreduce's measurements: the functions it times (kernel_fn: R all-reduces in one launch;
chain_fn: a jitted chain), each algorithm's result checked against lax.psum's, the peers (in
processes of their own, first), the timed cases and the per-call trace."""

from __future__ import annotations

import itertools
import zlib

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import sifar_jax
import sifar_jax.benchmarking
from bench import calltrace, common, peers
from bench.allreduce.settings import BASELINE, payload_bytes, settings

# ----------------------------------------------------------------- functions --
def kernel_fn(mesh, algorithm: str, repeat: int):
    def body(x):
        return sifar_jax.benchmarking.psum_repeated(x[0], "tp", repeat, algorithm=algorithm)[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))


def chain_fn(mesh, algorithm: str, length: int):
    """length data-dependent all-reduces: y <- allreduce(y), nothing else between
    them (a scale would add one XLA kernel per step to every row). Values grow
    by TP each step; past bf16's range they saturate to inf, which costs the
    same to add."""

    def body(x):
        y = x[0]
        for _ in range(length):
            if algorithm == BASELINE:
                y = jax.lax.psum(y, "tp")
            else:
                y = sifar_jax.sifar_psum(y, "tp", algorithm=algorithm)
        return y[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))


def cached(fns: dict, mesh, tp: int, level: str, alg: str, length: int):
    """kernel_fn (level "kernel") or chain_fn (the others) of `length` all-reduces, built once."""
    key = (tp, level == "kernel", alg, length)
    if key not in fns:
        fns[key] = (kernel_fn if level == "kernel" else chain_fn)(mesh, alg, length)
    return fns[key]


def as_bf16(x_np):
    return jax.numpy.asarray(x_np, dtype=jax.numpy.bfloat16)


def random_bf16(seed: int, tp: int, elems: int):
    """|x| in [0.5, 2), random sign: never zero, no overflow along a chain."""
    return as_bf16(common.random_payload(seed, tp, elems))


def on_mesh(mesh, x):
    """x sharded along "tp" (with several processes, each holds its rows)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("tp")), lambda i: x[i])


def check_result(got, want, tp: int) -> dict:
    """A result against lax.psum's: the same bits on every rank and within any bf16 summation
    order's rounding of lax.psum's (within_rounding), or bit for bit lax.psum's (identical)."""
    g, w = (np.concatenate([np.asarray(s.data, np.float32) for s in a.addressable_shards])
            for a in (got, want))  # the rows this process holds
    same = all(np.array_equal(g[i].view(np.uint32), g[0].view(np.uint32)) for i in range(len(g)))
    return {"within_rounding": bool(same and np.allclose(g, w, rtol=2 * tp * 2.0**-8, atol=0)),
            "identical": bool(np.array_equal(g.view(np.uint32), w.view(np.uint32)))}


# ------------------------------------------------------------------- running --
def run_peers(args, n_gpus: int) -> dict:
    """The peers, before this process starts JAX on the GPUs (theirs alone meanwhile)."""
    kind = "gpu" if n_gpus >= 2 else "cpu"
    cfg = settings(args, kind, n_gpus if kind == "gpu" else 8)
    names = peers.parse(args.peers)
    if not names:
        return {"records": [], "errors": [], "info": {}}
    print(f"peers ({kind}, {n_gpus} GPUs visible): {', '.join(names)}", flush=True)
    return peers.run(names, tps=cfg["tp"], sizes=payload_bytes(cfg), chain=cfg["chain"],
                     runs=cfg["runs"], warmup=cfg["warmup"], n_gpus=n_gpus,
                     timeout_s=args.peer_timeout)


def run(args, kind: str, devices: list) -> tuple[list[dict], dict, list[str]]:
    cfg = settings(args, kind, len(devices))
    if kind == "cpu":
        print("NOTE: no GPUs here: the protocol runs on XLA:CPU host devices (what ran: at the "
              "end)", flush=True)
    sizes = payload_bytes(cfg)
    algs = cfg["algorithms"]
    # jit_device is traced always (timed_case), the mis-speculation trace unless --no-trace
    call_trace = sifar_jax.call_trace if args.trace else None
    cases = [(level, alg, nbytes) for level in cfg["levels"]
             for alg in (algs if level == "jit" else [a for a in algs if a != BASELINE])
             for nbytes in sizes]
    traced = list(itertools.product(cfg["trace_algorithms"], sizes, cfg["skews_us"])
                  if call_trace else ())
    records, checks, traces, warnings_out = [], [], [], []
    stats: dict = {}  # tp -> sifar_jax.stats() over that TP size's runs
    bar = common.progress(len(cfg["tp"]) * (len(cases) + len(traced)), "all-reduce",
                          timings=kind == "gpu")
    fns: dict = {}
    for tp in cfg["tp"]:
        mesh = Mesh(np.array(devices[:tp]), ("tp",))
        sifar_jax.shutdown()
        sifar_jax.init(mesh, slot_bytes=max(sifar_jax.DEFAULT_SLOT_BYTES, max(sizes)))
        stats0 = sifar_jax.stats()
        ref = chain_fn(mesh, BASELINE, 1)  # what one call at every level must return
        for level, alg, nbytes in cases:
            bar.set_postfix_str(f"tp={tp} {level} {alg} {nbytes // 1024}KB")
            x = on_mesh(mesh, random_bf16(zlib.crc32(repr((tp, level, alg, nbytes)).encode()), tp,
                                          nbytes // 2))
            if alg != BASELINE and level != "jit_device":
                got = cached(fns, mesh, tp, level, alg, 1)(x)
                checks.append({"tp": tp, "level": level, "algorithm": alg, "bytes": nbytes,
                               **check_result(got, ref(x), tp)})
                if not checks[-1]["within_rounding"]:
                    warnings_out.append(f"WRONG RESULT: tp={tp} {alg} {nbytes} bytes differs "
                                        "from lax.psum")
                    bar.write(warnings_out[-1])
            records.append(timed_case(mesh, fns, cfg, tp, level, alg, nbytes, x))
            bar.update(1)
        for alg, nbytes, skew in traced:
            bar.set_postfix_str(f"tp={tp} trace {alg} {nbytes // 1024}KB skew={skew:g}us")
            traces.append(trace_case(call_trace, mesh, fns, cfg, tp, alg, nbytes, skew)[0])
            bar.update(1)
        sifar_jax.check()
        stats[tp] = {a: {k: v - stats0.get(a, {}).get(k, 0) for k, v in c.items()}
                     for a, c in sifar_jax.stats().items()}
        sifar_jax.shutdown()
    bar.close()
    meta = {"kind": kind, "devices": devices[: max(cfg["tp"])], "cfg": cfg,
            "sizes": sizes, "checks": checks, "stats": stats,
            "trace": {"records": traces} if call_trace else {"skipped": "--no-trace"}}
    return records, meta, warnings_out


def timed_case(mesh, fns, cfg, tp, level, alg, nbytes, x) -> dict:
    """One algorithm and size at one level: kernel, R all-reduces in one launch against one; jit,
    a chain of R2 against one of R1; jit_device, the R2 chain per rank on the device's clock."""
    r1, r2 = (1, cfg["kernel_r"]) if level == "kernel" else cfg["chain"]
    small, large = (cached(fns, mesh, tp, level, alg, r) for r in (r1, r2))
    if level == "jit_device":
        common.warm_up(large, (x,), cfg["warmup"])
        rec = calltrace.collect(sifar_jax.call_trace, "tp", large, (x,), cfg["runs"], r2)
        samples = calltrace.chain_seconds_per_call(rec, r2)
    else:
        common.warm_up(small, (x,), cfg["warmup"])
        common.warm_up(large, (x,), cfg["warmup"])
        inner = cfg["inner_kernel" if level == "kernel" else "inner_jit"]
        samples = common.paired_differences(small, large, (x,), r2 - r1, cfg["runs"], inner)
    return {"algorithm": alg, "level": level, "tp": tp, "bytes": nbytes,
            **common.summarize_us(samples)}


def trace_case(call_trace, mesh, fns, cfg, tp, alg, nbytes, skew_us):
    """One traced jit chain: (entry for the JSON, per-call latencies in us or None)."""
    r2 = cfg["chain"][1]
    fn = cached(fns, mesh, tp, "jit", alg, r2)
    x = on_mesh(mesh, random_bf16(zlib.crc32(repr((tp, "trace", alg, nbytes)).encode()), tp,
                                  nbytes // 2))
    entry = {"algorithm": alg, "level": "jit", "tp": tp, "bytes": nbytes, "skew_us": skew_us,
             "chain": r2, "runs": cfg["trace_runs"]}
    try:
        common.warm_up(fn, (x,), 1)
        before = sifar_jax.stats()[alg]
        rec = calltrace.collect(call_trace, "tp", fn, (x,), cfg["trace_runs"], r2, skew_us)
        after = sifar_jax.stats()[alg]
    except Exception as e:  # noqa: BLE001 - recorded; the benchmark goes on
        entry["error"] = f"{type(e).__name__}: {e}"
        return entry, None
    calls = after["calls"] - before["calls"]
    retries = after["retries"] - before["retries"]
    entry["retries_per_call"] = round(retries / calls, 4) if calls else None
    entry.update(calltrace.summarize(rec))
    return entry, calltrace.latencies_us(rec)[0]


