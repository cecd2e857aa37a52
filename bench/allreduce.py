"""All-reduce latency of every portable SiFAR algorithm, of lax.psum and of the peers (torch NCCL,
torch symmetric memory, XLA's one-shot kernel), in one run.

    python -m bench.allreduce                 # GPUs: the results the project commits
    python -m bench.allreduce --quick         # a quick look (CPU / CI: well under a minute)
    python -m bench.allreduce --peers none --no-trace   # ours and lax.psum only
    python -m bench.allreduce --sizes sweep --write-auto-table auto.json   # what "auto" runs
    python -m sifar_jax.launch -n 2 -- python -m bench.allreduce   # one process per GPU

Levels (kernel, jit, jit_device, the peers' cuda_graph_chain), the noise rule ("not resolved"),
the per-call trace and the JSON's fields: docs/reference.md (bench.allreduce). On a machine with
fewer than two GPUs it runs on 8 XLA:CPU host devices at TP=2: a protocol demo (every algorithm
checked bit for bit against lax.psum, sifar_jax.stats()), not a performance result.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import zlib

from bench import common

common.use_host_devices(8)  # before jax is imported; only XLA:CPU reads it

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import sifar_jax  # noqa: E402
import sifar_jax.benchmarking  # noqa: E402
from bench import calltrace, peers, report  # noqa: E402

LAUNCHED = sifar_jax.distributed.initialize()  # under sifar_jax.launch: one process per GPU

SCHEMA = "sifar-jax/bench.allreduce/3"  # 3: checks and stats in, target and retry out
PORTABLE = tuple(sifar_jax.algorithms.PORTABLE)
BASELINE = "lax.psum"
LEVELS = ("kernel", "jit", "jit_device")
LEVEL_TEXT = {
    "kernel": "R all-reduces in one launch: (t(R) - t(1)) / (R - 1)",
    "jit": "jitted chains of R1 and R2 data-dependent all-reduces: (t(R2) - t(R1)) / (R2 - R1)",
    "jit_device": "the R2 chain per rank and run from the device's clock: "
                  "(end of the last call - end of the first) / (R2 - 1)",
    **{k: v for k, v in peers.LEVELS.items() if k != peers.LEVEL_JIT},
}
# KB of bf16 per device. default: the decoders' all-reduces (4 KB: one token of the MoE model,
# 8 KB: Llama-3.1-8B's) up to a few tokens; sweep: 1 KB to 64 MB, for `auto`'s choice by size.
SIZE_PRESETS = {"default": (4, 8, 16, 32, 64),
                "sweep": tuple(float(2 ** k) for k in range(17))}  # 1 KB .. 65536 KB = 64 MB
CPU_NOTE = ("No GPUs here: XLA:CPU host devices (threads as ranks, one shared memory) ran the "
            "protocol for real; its timings mean nothing for GPUs. Speed figures: "
            "docs/performance.md.")


# ------------------------------------------------------------------ settings --
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.allreduce",
                                description="Per-all-reduce latency of the SiFAR algorithms, "
                                            "lax.psum and the peers (docs/reference.md).")
    add = p.add_argument
    add("--sizes", default="default", help="KB of bf16 per device, a comma list or a preset: "
        + "; ".join(f"{k}: {','.join(f'{v:g}' for v in kb)}" for k, kb in SIZE_PRESETS.items()))
    add("--algorithms", default=",".join(PORTABLE + (BASELINE,)),
        help=f"comma list from {', '.join(PORTABLE + (BASELINE,))} (default: all)")
    add("--levels", default=",".join(LEVELS), help=f"comma list from {', '.join(LEVELS)}")
    add("--tp", default=None, help="comma list of TP sizes (default: 2, 4, ... up to the GPUs)")
    add("--reps", type=int, default=None, help="timed runs per case (default 30 GPU, 10 CPU)")
    add("--kernel-repeat", type=int, default=None, help="R at kernel level (default 2000; CPU 20)")
    add("--chain", default=None, help="R1,R2: jit chain lengths (default 20,200; CPU 4,16)")
    add("--peers", default="auto", help=f"comma list from {', '.join(peers.ALL)}, auto or none")
    add("--peer-timeout", type=float, default=120.0, help="seconds per peer process")
    add("--no-trace", dest="trace", action="store_false",
        help="skip the mis-speculation and tail trace (jit_device still runs)")
    add("--skew-us", default="0,2,10", help="forced skews for the trace, max us per call")
    add("--trace-algorithms", default="sifar", help="algorithms traced per call")
    add("--trace-runs", type=int, default=None, help="long jit chains per trace (default 100)")
    add("--quick", action="store_true", help="fewer runs and shorter chains (CPU, CI)")
    add("--out", default=None, help="results directory")
    add("--write-auto-table", metavar="PATH", default=None,
        help="also write what algorithm='auto' should run per TP and size (sifar_jax.autotable)")
    return p.parse_args(argv)


def settings(args, kind: str, n_devices: int) -> dict:
    gpu = kind == "gpu"
    # One synchronous call per sample (inner 1): the differences cancel the host's dispatch
    # exactly (pipelined calls hide it behind the long run only, biasing the difference low).
    s = {"runs": 30 if gpu else 10, "kernel_r": 2000 if gpu else 20, "warmup": 3,
         "chain": (20, 200) if gpu else (4, 16), "inner_kernel": 1, "inner_jit": 1,
         "trace_runs": 100 if gpu else 5}
    if args.quick:
        s.update(runs=10, kernel_r=200 if gpu else 16, chain=(10, 50) if gpu else (4, 12), warmup=2,
                 trace_runs=20 if gpu else 5)
        if not gpu:
            s["inner_kernel"] = s["inner_jit"] = 2
    for key, given, least in (("runs", args.reps, 1), ("kernel_r", args.kernel_repeat, 2),
                              ("trace_runs", args.trace_runs, 1)):
        if given is not None:
            s[key] = max(least, given)
    if args.chain is not None:
        r1, r2 = (int(v) for v in args.chain.split(","))
        if not 0 < r1 < r2:
            raise SystemExit("--chain needs 0 < R1 < R2")
        s["chain"] = (r1, r2)

    def names(spec, allowed, what):
        out = [a.strip() for a in spec.split(",") if a.strip()]
        for a in out:
            if a not in allowed:
                why = " (never from this benchmark: it must be opted into by hand)" if a in (
                    "multicast", "auto") else ""
                raise SystemExit(f"unknown {what} {a!r}{why}; choose from {tuple(allowed)}")
        return out

    s["algorithms"] = names(args.algorithms, PORTABLE + (BASELINE,), "algorithm")
    s["trace_algorithms"] = names(args.trace_algorithms, PORTABLE, "trace algorithm")
    s["levels"] = names(args.levels, LEVELS, "level")
    s["skews_us"] = [float(v) for v in args.skew_us.split(",") if v.strip()]
    s["sizes_kb"] = parse_sizes(args.sizes)
    s["tp"] = ([int(v) for v in args.tp.split(",")] if args.tp else
               common.powers_of_two_up_to(n_devices) if gpu else [2])
    for t in s["tp"]:
        if not 2 <= t <= n_devices:
            raise SystemExit(f"--tp {t}: have {n_devices} {kind} devices")
    return s


def parse_sizes(text: str) -> list[float]:
    """--sizes: a preset's name (SIZE_PRESETS) or a comma list of KB."""
    if text.strip() in SIZE_PRESETS:
        return [float(v) for v in SIZE_PRESETS[text.strip()]]
    try:
        sizes = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--sizes {text!r}: a comma list of KB or one of "
                         f"{', '.join(SIZE_PRESETS)}") from None
    if not sizes or min(sizes) <= 0:
        raise SystemExit(f"--sizes {text!r}: sizes must be positive")
    return sizes


def payload_bytes(cfg) -> list[int]:
    return [int(kb * 1024) // 2 * 2 for kb in cfg["sizes_kb"]]  # whole bf16 elements


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
    bar = common.progress(len(cfg["tp"]) * (len(cases) + len(traced)), "all-reduce")
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


# ---------------------------------------------------------------- comparison --
def comparison(records) -> list[dict]:
    """sifar (jit level) against every algorithm not ours, per TP and size: ratio = peer / sifar
    (> 1: sifar is faster); None where either median is not resolved above its noise."""
    ours = {(r["tp"], r["bytes"]): r["us_median"] for r in records
            if r["algorithm"] == "sifar" and r["level"] == "jit"}
    out = []
    for r in (r for r in records if r["algorithm"] not in PORTABLE):
        s, peer = ours.get((r["tp"], r["bytes"])), r["us_median"]
        out.append({"tp": r["tp"], "bytes": r["bytes"], "peer": r["algorithm"],
                    "peer_level": r["level"], "peer_us": peer, "sifar_us": s,
                    "ratio": round(peer / s, 3) if s and peer is not None else None})
    return out


# -------------------------------------------------------------------- output --
def _speedup_row(level, rs, sizes):
    """sifar relative to lax.psum (jit) or to the best barrier algorithm (kernel)."""
    by = {(r["algorithm"], r["bytes"]): r["us_median"] for r in rs}
    if "sifar" not in {r["algorithm"] for r in rs}:
        return None
    bases, name = ((BASELINE,), "lax.psum") if level == "jit" else (
        ("oneshot", "twoshot"), "best of oneshot/twoshot")
    cells = []
    for b in sizes:
        s = by.get(("sifar", b))
        base = min((by[(a, b)] for a in bases if by.get((a, b)) is not None), default=None)
        cells.append(f"{(1 - s / base) * 100:+.0f}%" if s and base and base > 0 else "-")
    return [f"sifar: latency saved vs {name}"] + cells


def _cell(r, with_spread: bool) -> str:
    if r is None:
        return "-"
    if r["us_median"] is None:
        return common.fmt_latency(r)
    if with_spread:
        return (f"{common.fmt_us(r['us_median'])} "
                f"({common.fmt_us(r['us_p10'])}-{common.fmt_us(r['us_p90'])})")
    return common.fmt_us(r["us_median"])


def tables(records, sizes, with_spread: bool, speedup: bool = True):
    out = []
    groups = sorted({(r["level"], r["tp"]) for r in records if r["level"] in LEVELS},
                    key=lambda k: (LEVELS.index(k[0]), k[1]))
    for level, tp in groups:
        rs = [r for r in records if (r["level"], r["tp"]) == (level, tp)]
        algs = [a for a in PORTABLE + (BASELINE,) if any(r["algorithm"] == a for r in rs)]
        by = {(r["algorithm"], r["bytes"]): r for r in rs}
        headers = ["algorithm"] + [f"{b / 1024:g} KB" for b in sizes]
        rows = [[a] + [_cell(by.get((a, b)), with_spread) for b in sizes] for a in algs]
        extra = _speedup_row(level, rs, sizes) if speedup else None
        if extra:
            rows.append(extra)
        out.append((level, tp, headers, rows))
    return out


def peer_tables(records, comp, sizes):
    """Per TP: sifar (jit, and kernel for reference), then every peer as
    'median (ratio)', then whether sifar is ahead of all of them."""
    out = []
    for tp in sorted({c["tp"] for c in comp}):
        by = {(r["algorithm"], r["level"], r["bytes"]): r for r in records if r["tp"] == tp}
        headers = ["algorithm", "level"] + [f"{b / 1024:g} KB" for b in sizes]
        rows = []
        for level in ("jit", "kernel"):
            if any(("sifar", level, b) in by for b in sizes):
                rows.append(["sifar", level] + [_cell(by.get(("sifar", level, b)), False)
                                                for b in sizes])
        cs = [c for c in comp if c["tp"] == tp]
        at_size = {(c["peer"], c["peer_level"], c["bytes"]): c for c in reversed(cs)}
        for peer, level in dict.fromkeys((c["peer"], c["peer_level"]) for c in cs):
            row = [peer, level]
            for b in sizes:
                c = at_size.get((peer, level, b))
                if c is None:
                    row.append("-")
                else:
                    ratio = f" ({c['ratio']:.2f}x)" if c["ratio"] is not None else ""
                    row.append(f"{common.fmt_latency({'us_median': c['peer_us']})}{ratio}")
            rows.append(row)
        verdict = ["sifar ahead of every peer", ""]
        for b in sizes:
            here = [c for c in cs if c["bytes"] == b]
            at = [c for c in here if c["ratio"] is not None]
            # A peer (or sifar) whose median is not resolved above its noise decides nothing.
            unresolved = sorted({c["peer"] for c in here if c["ratio"] is None})
            if not at:
                verdict.append("not resolved" if unresolved else "-")
                continue
            worst = min(at, key=lambda c: c["ratio"])
            if worst["ratio"] <= 1.0:
                verdict.append(f"**no**, {worst['ratio']:.2f}x vs {worst['peer']}")
            elif unresolved:
                verdict.append(f"yes vs the resolved peers ({worst['ratio']:.2f}x vs "
                               f"{worst['peer']}); not resolved vs {', '.join(unresolved)}")
            else:
                verdict.append(f"yes, {worst['ratio']:.2f}x vs {worst['peer']}")
        rows.append(verdict)
        out.append((tp, headers, rows))
    return out


def trace_tables(trace_records):
    def share(v):
        return "-" if v is None else f"{v * 100:.1f}%"

    mis, tails = [], []
    for t in trace_records:
        head = [t["tp"], t["algorithm"], f"{t['bytes'] / 1024:g} KB", f"{t['skew_us']:g}"]
        if "error" in t:
            mis.append(head + ["error: " + t["error"]] + [""] * 6)
            continue
        retries = t.get("retries_per_call")
        us = [common.fmt_us(t[k]) for k in ("us_median_clean", "us_median_retried", "us_mean")]
        mis.append(head + [t["calls"], share(t.get("retried_share")),
                           "-" if retries is None else retries, *us, share(t.get("cost_share"))])
        tails.append(head + [t["calls"]] + [common.fmt_us(t[k]) for k in common.TAILS])
    mis_h = ["TP", "algorithm", "size", "skew us", "calls", "retried", "retries/call (counters)",
             "median clean us", "median retried us", "mean us", "cost"]
    tail_h = ["TP", "algorithm", "size", "skew us", "calls",
              "p50 us", "p90 us", "p99 us", "p99.9 us"]
    return (mis_h, mis), (tail_h, tails)


def print_tables(records, comp, sizes, host):
    print()
    for level, tp, headers, rows in tables(records, sizes, with_spread=False):
        print(f"[{host}] level={level} TP={tp}: microseconds per all-reduce (median)")
        print(report.plain_table(headers, rows) + "\n")
    for tp, headers, rows in peer_tables(records, comp, sizes):
        print(f"[{host}] TP={tp}: sifar (jit) against every peer, median us (peer / sifar)")
        plain = [[str(c).replace("**", "") for c in r] for r in rows]
        print(report.plain_table(headers, plain) + "\n")


def protocol_rows(meta) -> tuple[list[str], list[list]]:
    """Per TP and algorithm: its all-reduces (sifar_jax.stats() over the run), retries, timeouts,
    and its results against lax.psum's (one call per level and size)."""
    headers = ["TP", "algorithm", "calls", "retries", "timeouts", "against lax.psum"]
    rows = []
    for tp, stats in meta["stats"].items():
        for alg, c in stats.items():
            mine = [x for x in meta["checks"] if (x["tp"], x["algorithm"]) == (tp, alg)]
            if not mine and not c.get("calls"):
                continue
            same = sum(x["identical"] for x in mine)
            wrong = sum(not x["within_rounding"] for x in mine)
            verdict = (f"WRONG in {wrong} of {len(mine)} checks" if wrong else
                       f"bit-identical in all {len(mine)} checks" if same == len(mine) else
                       f"within bf16 rounding ({same} of {len(mine)} bit-identical)")
            rows.append([tp, alg, c.get("calls", 0), c.get("retries", 0), c.get("timeouts", 0),
                         verdict if mine else "-"])
    return headers, rows


def write_outputs(out_dir, args, records, meta, env, warnings_out, peer_out):
    host, gpu = env["host"], meta["kind"] == "gpu"
    cfg, sizes = meta["cfg"], meta["sizes"]
    comp = comparison(records)
    payload = {
        "schema": SCHEMA,
        "env": env,
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
        "levels": LEVEL_TEXT,
        "records": records,
        "errors": peer_out["errors"] + [{"error": w} for w in warnings_out],
        "checks": meta["checks"],
        "stats": {str(k): v for k, v in meta["stats"].items()},
        "comparison": comp,
        "trace": meta["trace"],
    }
    json_path = report.write_json(report.results_path(out_dir, "allreduce", host, ".json"), payload)
    notes = [] if gpu else [CPU_NOTE]
    notes.append(f"kernel level: (t(R) - t(1)) / (R - 1), R = {cfg['kernel_r']}; jit level: "
                 f"(t(R2) - t(R1)) / (R2 - R1), chains of {cfg['chain'][0]} and {cfg['chain'][1]}; "
                 f"median (p10-p90) over {cfg['runs']} runs, us, bf16 per device; 'not resolved': "
                 "within its noise bound (docs/reference.md, bench.allreduce).")
    notes += [f"**{w}**" for w in warnings_out]
    sections = [("What ran: sifar_jax.stats() per algorithm and its results against lax.psum",
                 report.markdown_table(*protocol_rows(meta)))]
    for tp, headers, rows in peer_tables(records, comp, sizes) if gpu else ():
        sections.append((f"sifar against every peer, TP={tp} (median us; in brackets peer / sifar "
                         f"at jit level, > 1 means sifar is faster)",
                         report.markdown_table(headers, rows)))
    if peer_out["errors"]:
        rows = [[e.get("algorithm", "-"), e.get("tp", "-"),
                 f"{e['bytes'] / 1024:g} KB" if e.get("bytes") else "all", e["error"]]
                for e in peer_out["errors"]]
        sections.append(("Peers that did not run or were not timed",
                         report.markdown_table(["peer", "TP", "size", "why"], rows)))
    for level, tp, headers, rows in tables(records, sizes, with_spread=True, speedup=gpu):
        sections.append((f"{level} level, TP={tp}" + ("" if gpu else " (XLA:CPU timings)"),
                         report.markdown_table(headers, rows)))
    if "records" in meta["trace"]:
        (mh, mrows), (th, trows) = trace_tables(meta["trace"]["records"])
        sections.append(("Mis-speculation per call (device trace of the jit chain; retried: share "
                         "of calls in which block 0 of a rank re-read a stale word; cost: "
                         "1 - mean(clean) / mean(all), an upper bound)",
                         report.markdown_table(mh, mrows)))
        if trows:
            sections.append(("Tail latency per call (end - start per call and rank: %globaltimer "
                             "on GPUs, the host's steady clock on the CPU)",
                             report.markdown_table(th, trows)))
    else:
        notes.append(f"Per-call trace: {meta['trace']['skipped']}.")
    md_path = report.write_markdown(report.results_path(out_dir, "allreduce", host, ".md"),
                                    f"All-reduce latency on {host}", env, sections, notes)
    return json_path, md_path


def main(argv=None) -> int:
    args = parse_args(argv)
    # Before anything starts NCCL (lax.psum's too): no NVLink multicast, ever.
    os.environ.update(common.MULTICAST_OFF)
    n_gpus = common.visible_gpu_count()
    if LAUNCHED and peers.parse(args.peers):
        print("NOTE: one process per GPU: the peers are skipped", flush=True)
        args.peers = "none"
    peer_out = run_peers(args, n_gpus)
    kind, devices = common.bench_devices()
    if (kind == "gpu") != (n_gpus >= 2):
        print(f"NOTE: {n_gpus} GPUs visible to the driver but JAX runs on {kind}: the peers "
              f"and ours ran on different hardware", file=sys.stderr)
    records, meta, warnings_out = run(args, kind, devices)
    records += peer_out["records"]
    if jax.process_index() != 0:
        return 1 if warnings_out else 0  # process 0 reports for all
    env = report.describe_environment(meta["devices"])
    if jax.process_count() > 1:
        env["host"] += f"-{jax.process_count()}proc"
    env.update({k: v for k, v in peer_out["info"].items() if k in ("torch", "nccl")})
    env["peers_info"] = peer_out["info"]
    if kind == "gpu":
        print_tables(records, comparison(records), meta["sizes"], env["host"])
    else:
        print(f"\n[{env['host']}] What ran: {CPU_NOTE}")
        print(report.plain_table(*protocol_rows(meta)))
        print("retries: speculative reads that found a stale word and read it again (SiFAR's "
              "design, not a fault); timeouts are failures.\n")
    out_dir = args.out if args.out else report.default_out(kind)
    for path in write_outputs(out_dir, args, records, meta, env, warnings_out, peer_out):
        print(f"wrote {path}")
    if args.write_auto_table:  # for the platform and the device kind this run had
        devices = (env["device_kind"],) if env.get("device_kind") else ()
        try:
            table = sifar_jax.autotable.from_records(
                records, "cuda" if kind == "gpu" else "cpu", device_kinds=devices,
                source=f"bench.allreduce on {env['host']}, {env['date']} "
                       f"({sifar_jax.autotable.LEVEL} level)")
        except ValueError as e:
            print(f"auto table not written: {e} (run with --levels including jit)", file=sys.stderr)
            return 1
        print(f"wrote {sifar_jax.autotable.write(table, args.write_auto_table)} (auto table)")
    for e in peer_out["errors"]:
        print(f"peer {e.get('algorithm')} tp={e.get('tp')}: {e['error']}", file=sys.stderr)
    if warnings_out:
        print("\n".join(warnings_out), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
