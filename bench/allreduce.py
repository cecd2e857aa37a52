"""All-reduce latency of every portable SiFAR algorithm and of lax.psum.

    python -m bench.allreduce                 # full run
    python -m bench.allreduce --quick         # a quick look (CPU / CI: about a minute)
    python -m sifar_jax.launch -n 2 -- python -m bench.allreduce   # one process per GPU

Two levels, measured in the same run:

  kernel  R all-reduces back to back inside one handler call / kernel launch
          (sifar_psum(..., _repeat=R), the paper's method): per all-reduce =
          (t(R) - t(1)) / (R - 1). lax.psum has no such level.
  jit     a chain of R data-dependent all-reduces (y <- allreduce(y))
          in one jitted shard_map function: per all-reduce =
          (t(R2) - t(R1)) / (R2 - R1), which cancels the launch overhead.

Payloads are random bfloat16 (never zero), 4..64 KB per device by default.
Runs on GPUs when at least two are visible (TP = 2, 4, ... up to the GPU
count), else on 8 XLA:CPU host devices at TP=2, where the numbers only
demonstrate the protocol. Writes bench/results/allreduce-<host>.{json,md,png}
(<host> ends in "-<n>proc" when started by the launcher: process 0 writes).
"""

from __future__ import annotations

import argparse
import sys
import zlib

from bench import common

common.use_host_devices(8)  # before jax is imported; only XLA:CPU reads it

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import sifar_jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

sifar_jax.distributed.initialize()  # started by sifar_jax.launch: one process per GPU

PORTABLE = tuple(sifar_jax.algorithms.PORTABLE)
BASELINE = "lax.psum"
LEVELS = ("kernel", "jit")
CPU_NOTE = (
    "No GPUs here: these numbers come from XLA:CPU host devices (threads as ranks, "
    "shared host memory). They demonstrate the protocol; they are not a performance result."
)


# ------------------------------------------------------------------ settings --
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m bench.allreduce",
        description="Per-all-reduce latency of the SiFAR algorithms and lax.psum.",
    )
    p.add_argument("--sizes", default="4,8,16,32,64",
                   help="payload sizes per device in KB of bfloat16 (default: 4,8,16,32,64)")
    p.add_argument("--algorithms", default=",".join(PORTABLE + (BASELINE,)),
                   help=f"comma list from {', '.join(PORTABLE + (BASELINE,))} (default: all)")
    p.add_argument("--levels", default=",".join(LEVELS), help="kernel, jit or both (default)")
    p.add_argument("--tp", default=None,
                   help="comma list of TP sizes (default: 2, 4, ... up to the GPU count; 2 on CPU)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed runs per case, summarised as median/p10/p90 "
                        "(default: 30 on GPU, 10 on CPU and with --quick)")
    p.add_argument("--kernel-repeat", type=int, default=None,
                   help="R, all-reduces per launch at kernel level (default: 1000 GPU, 20 CPU)")
    p.add_argument("--chain", default=None,
                   help="R1,R2: chain lengths at jit level (default: 20,100 GPU; 4,16 CPU)")
    p.add_argument("--quick", action="store_true", help="fewer runs and shorter chains (CPU, CI)")
    p.add_argument("--out", default=str(common.DEFAULT_OUT),
                   help="directory for the results (default: bench/results)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p.parse_args(argv)


def settings(args, kind: str, n_devices: int) -> dict:
    gpu = kind == "gpu"
    s = {
        "runs": 30 if gpu else 10,
        "kernel_r": 2000 if gpu else 20,
        "chain": (20, 200) if gpu else (4, 16),
        # One synchronous call per sample: the differences then cancel the host's
        # dispatch time exactly. Back-to-back (pipelined) calls hide dispatch
        # behind the long run but not behind the short one, which biased the
        # first GPU run low (oneshot came out faster chained than in one kernel).
        "inner_kernel": 1,
        "inner_jit": 1,
        "warmup": 3,
    }
    if args.quick:
        s.update(runs=10, kernel_r=200 if gpu else 16, chain=(10, 50) if gpu else (4, 12), warmup=2)
        if not gpu:
            s["inner_kernel"] = s["inner_jit"] = 2
    if args.reps is not None:
        s["runs"] = max(1, args.reps)
    if args.kernel_repeat is not None:
        s["kernel_r"] = max(2, args.kernel_repeat)
    if args.chain is not None:
        r1, r2 = (int(v) for v in args.chain.split(","))
        if not 0 < r1 < r2:
            raise SystemExit("--chain needs 0 < R1 < R2")
        s["chain"] = (r1, r2)

    algs = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    for a in algs:
        if a not in PORTABLE + (BASELINE,):
            why = " (never from this benchmark: it must be opted into by hand)" if a in (
                "multicast", "auto") else ""
            raise SystemExit(f"unknown algorithm {a!r}{why}; choose from {PORTABLE + (BASELINE,)}")
    s["algorithms"] = algs
    s["levels"] = [lv.strip() for lv in args.levels.split(",") if lv.strip()]
    for lv in s["levels"]:
        if lv not in LEVELS:
            raise SystemExit(f"unknown level {lv!r}; choose from {LEVELS}")
    s["sizes_kb"] = [float(v) for v in args.sizes.split(",") if v.strip()]
    if args.tp:
        s["tp"] = [int(v) for v in args.tp.split(",")]
    else:
        s["tp"] = common.powers_of_two_up_to(n_devices) if gpu else [2]
    for t in s["tp"]:
        if not 2 <= t <= n_devices:
            raise SystemExit(f"--tp {t}: have {n_devices} {kind} devices")
    return s


# ----------------------------------------------------------------- functions --
def kernel_fn(mesh, algorithm: str, repeat: int):
    def body(x):
        return sifar_jax.sifar_psum(x[0], "tp", algorithm=algorithm, _repeat=repeat)[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))


def kernel_ref_fn(mesh):
    """lax.psum of the same input: what one kernel-level call must return."""

    def body(x):
        return jax.lax.psum(x[0], "tp")[None]

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


def random_bf16(seed: int, tp: int, elems: int):
    """|x| in [0.5, 2), random sign: never zero, no overflow along a chain."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.5, 2.0, (tp, elems)) * np.where(rng.random((tp, elems)) < 0.5, -1, 1)
    return jax.numpy.asarray(x, dtype=jax.numpy.bfloat16)


def on_mesh(mesh, x):
    """x sharded along "tp" (with several processes, each holds its rows)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("tp")), lambda i: x[i])


def local_rows(a) -> np.ndarray:
    """The rows of a "tp"-sharded result this process holds, as float32."""
    return np.concatenate([np.asarray(s.data, np.float32) for s in a.addressable_shards])


def check_result(got, want, tp: int) -> bool:
    g, w = local_rows(got), local_rows(want)
    same = all(np.array_equal(g[i].view(np.uint32), g[0].view(np.uint32)) for i in range(len(g)))
    return same and np.allclose(g, w, rtol=2 * tp * 2.0**-8, atol=0)


# ------------------------------------------------------------------- running --
def run(args) -> tuple[list[dict], dict, list[str]]:
    kind, devices = common.bench_devices()
    cfg = settings(args, kind, len(devices))
    warnings_out: list[str] = []
    if kind == "cpu":
        print(f"NOTE: {CPU_NOTE}", flush=True)
    sizes = [int(kb * 1024) // 2 * 2 for kb in cfg["sizes_kb"]]  # bytes, whole bf16 elements
    slot = max(sifar_jax.DEFAULT_SLOT_BYTES, max(sizes))
    algs = cfg["algorithms"]
    sifar_algs = [a for a in algs if a != BASELINE]

    cases = []
    for tp in cfg["tp"]:
        for level in cfg["levels"]:
            for alg in (sifar_algs if level == "kernel" else algs):
                for nbytes in sizes:
                    cases.append((tp, level, alg, nbytes))

    records: list[dict] = []
    retry: dict = {}
    bar = common.progress(len(cases), "all-reduce")
    fns: dict = {}
    for tp in cfg["tp"]:
        mesh = Mesh(np.array(devices[:tp]), ("tp",))
        sifar_jax.shutdown()
        sifar_jax.init(mesh, slot_bytes=slot)
        refs = {"kernel": kernel_ref_fn(mesh), "jit": chain_fn(mesh, BASELINE, 1)}
        for (ctp, level, alg, nbytes) in [c for c in cases if c[0] == tp]:
            bar.set_postfix_str(f"tp={tp} {level} {alg} {nbytes // 1024}KB")
            x = on_mesh(mesh, random_bf16(zlib.crc32(repr((tp, level, alg, nbytes)).encode()), tp,
                                          nbytes // 2))
            if level == "kernel":
                r = cfg["kernel_r"]
                small = fns.setdefault((tp, "k", alg, 1), kernel_fn(mesh, alg, 1))
                large = fns.setdefault((tp, "k", alg, r), kernel_fn(mesh, alg, r))
                extra, inner = r - 1, cfg["inner_kernel"]
                check = small
            else:
                r1, r2 = cfg["chain"]
                small = fns.setdefault((tp, "j", alg, r1), chain_fn(mesh, alg, r1))
                large = fns.setdefault((tp, "j", alg, r2), chain_fn(mesh, alg, r2))
                extra, inner = r2 - r1, cfg["inner_jit"]
                check = fns.setdefault((tp, "j", alg, 1), chain_fn(mesh, alg, 1))
            if alg != BASELINE and not check_result(check(x), refs[level](x), tp):
                msg = f"WRONG RESULT: tp={tp} {alg} {nbytes} bytes differs from lax.psum"
                warnings_out.append(msg)
                bar.write(msg)
            common.warm_up(small, (x,), cfg["warmup"])
            common.warm_up(large, (x,), cfg["warmup"])
            before = sifar_jax.stats().get(alg) if alg != BASELINE else None
            samples = common.paired_differences(small, large, (x,), extra, cfg["runs"], inner)
            if before is not None:
                after = sifar_jax.stats()[alg]
                calls = after["calls"] - before["calls"]
                if calls:
                    retry[(level, tp, alg, nbytes)] = (after["retries"] - before["retries"]) / calls
            records.append({"algorithm": alg, "level": level, "tp": tp, "bytes": nbytes,
                            **common.summarize_us(samples)})
            bar.update(1)
        sifar_jax.check()
        sifar_jax.shutdown()
    bar.close()
    meta = {"kind": kind, "devices": devices[: max(cfg["tp"])], "cfg": cfg, "retry": retry,
            "sizes": sizes}
    return records, meta, warnings_out


# -------------------------------------------------------------------- output --
def _groups(records):
    keys = sorted({(r["level"], r["tp"]) for r in records}, key=lambda k: (LEVELS.index(k[0]), k[1]))
    for level, tp in keys:
        rs = [r for r in records if r["level"] == level and r["tp"] == tp]
        yield level, tp, rs


def _speedup_row(level, rs, sizes):
    """sifar relative to lax.psum (jit) or to the best barrier algorithm (kernel)."""
    by = {(r["algorithm"], r["bytes"]): r["us_median"] for r in rs}
    if "sifar" not in {r["algorithm"] for r in rs}:
        return None
    cells = []
    for b in sizes:
        s = by.get(("sifar", b))
        if level == "jit":
            base, name = by.get((BASELINE, b)), "lax.psum"
        else:
            cands = [by[(a, b)] for a in ("oneshot", "twoshot") if (a, b) in by]
            base, name = (min(cands) if cands else None), "best of oneshot/twoshot"
        cells.append(f"{(1 - s / base) * 100:+.0f}%" if s and base and base > 0 else "-")
    return [f"sifar: latency saved vs {name}"] + cells


def tables(records, sizes, with_spread: bool):
    out = []
    for level, tp, rs in _groups(records):
        algs = [a for a in PORTABLE + (BASELINE,) if any(r["algorithm"] == a for r in rs)]
        by = {(r["algorithm"], r["bytes"]): r for r in rs}
        headers = ["algorithm"] + [f"{b / 1024:g} KB" for b in sizes]
        rows = []
        for a in algs:
            row = [a]
            for b in sizes:
                r = by.get((a, b))
                if r is None:
                    row.append("-")
                elif with_spread:
                    row.append(f"{common.fmt_us(r['us_median'])} "
                               f"({common.fmt_us(r['us_p10'])}-{common.fmt_us(r['us_p90'])})")
                else:
                    row.append(common.fmt_us(r["us_median"]))
            rows.append(row)
        extra = _speedup_row(level, rs, sizes)
        if extra:
            rows.append(extra)
        out.append((level, tp, headers, rows))
    return out


def print_tables(records, sizes, host):
    print()
    for level, tp, headers, rows in tables(records, sizes, with_spread=False):
        print(f"[{host}] level={level} TP={tp}: microseconds per all-reduce (median)")
        print(common.plain_table(headers, rows))
        print()


def write_outputs(args, records, meta, env, warnings_out):
    host = env["host"]
    cfg, sizes = meta["cfg"], meta["sizes"]
    json_path = common.write_json(common.results_path(args.out, "allreduce", host, ".json"), records)
    notes = []
    if meta["kind"] == "cpu":
        notes.append(CPU_NOTE)
    notes.append(
        f"kernel level: (t(R) - t(1)) / (R - 1) with R = {cfg['kernel_r']} all-reduces per launch; "
        f"jit level: (t(R2) - t(R1)) / (R2 - R1) with chains of {cfg['chain'][0]} and "
        f"{cfg['chain'][1]} data-dependent all-reduces with nothing between them. "
        f"Cells: median (p10-p90) over {cfg['runs']} runs, microseconds, bfloat16 payload per device."
    )
    notes += [f"**{w}**" for w in warnings_out]
    sections = []
    for level, tp, headers, rows in tables(records, sizes, with_spread=True):
        sections.append((f"{level} level, TP={tp}", common.markdown_table(headers, rows)))
    if meta["retry"]:
        rows = []
        for (level, tp, alg, b), rate in sorted(meta["retry"].items(),
                                                key=lambda kv: (LEVELS.index(kv[0][0]), kv[0][1:])):
            if alg in ("sifar", "sifar_flag"):
                rows.append([level, tp, alg, f"{b / 1024:g} KB", f"{rate:.3f}"])
        if rows:
            sections.append((
                "Mis-speculation (retries per all-reduce per rank; per warp on GPUs)",
                common.markdown_table(["level", "TP", "algorithm", "size", "retries"], rows),
            ))
    md_path = common.write_markdown(
        common.results_path(args.out, "allreduce", host, ".md"),
        f"All-reduce latency on {host}", env, sections, notes,
    )
    png_path = None
    if not args.no_plot:
        png_path = plot(records, common.results_path(args.out, "allreduce", host, ".png"), host,
                        meta["kind"])
    return json_path, md_path, png_path


def plot(records, path, host, kind):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(_groups(records))
    if not groups:
        return None
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (level, tp, rs) in zip(axes[0], groups):
        for alg in PORTABLE + (BASELINE,):
            pts = sorted((r["bytes"], r) for r in rs if r["algorithm"] == alg)
            if not pts:
                continue
            xs = [b / 1024 for b, _ in pts]
            med = [r["us_median"] for _, r in pts]
            lo = [r["us_p10"] for _, r in pts]
            hi = [r["us_p90"] for _, r in pts]
            style = "--" if alg == BASELINE else "-"
            (line,) = ax.plot(xs, med, style, marker="o", label=alg)
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["bytes"] / 1024 for r in rs}))
        ax.set_xticklabels([f"{v:g}" for v in sorted({r["bytes"] / 1024 for r in rs})])
        ax.set_xlabel("payload per device (KB, bf16)")
        ax.set_ylabel("us per all-reduce")
        ax.set_title(f"{level} level, TP={tp}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    title = f"All-reduce latency, {host}"
    if kind == "cpu":
        title += " (XLA:CPU protocol demo, not GPU performance)"
    return common.save_figure(fig, title, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    records, meta, warnings_out = run(args)
    if jax.process_index() != 0:
        return 1 if warnings_out else 0  # process 0 reports for all
    env = common.describe_environment(meta["devices"])
    if jax.process_count() > 1:
        env["host"] += f"-{jax.process_count()}proc"
    print_tables(records, meta["sizes"], env["host"])
    paths = write_outputs(args, records, meta, env, warnings_out)
    for p in paths:
        if p is not None:
            print(f"wrote {p}")
    if warnings_out:
        print("\n".join(warnings_out), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
