"""bench.allreduce's flags (parse_args) and settings: the algorithms, levels, sizes and TP sizes
one run measures, with the constants the report names (SCHEMA, LEVEL_TEXT)."""

from __future__ import annotations

import argparse

import sifar_jax
from bench import common, peers

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
            "protocol for real; no timing is shown, as none would mean anything for GPUs. Speed "
            "figures: docs/performance.md.")


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


