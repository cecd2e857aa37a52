"""Probe: where a decode step's device time goes, kernel by kernel, for each all-reduce variant.

The decoder with no all-reduce at all (identity) bounds every variant from below; issue 10 asks
the fused sifar decoder to reach it. This profiles a few back-to-back steps of each variant with
`jax.profiler` (CUPTI) and sums the device time of the kernels per step by kind (our all-reduce,
NCCL, matmuls, reductions, the rest), so the cost of the all-reduce shows next to the XLA kernels
it replaces (the fused call replaces the residual add and RMSNorm fusions).

Durations are the kernels' own device times. The span per step (first kernel's start to last
kernel's end, over the profiled steps) includes the gaps between kernels, which match a
command-buffer run only where XLA keeps command buffers while profiling
(`XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true`, where this XLA knows the
flag); the step time to quote comes from `bench.decode`.

    python -m bench.probes.step_kernels                    # GPU host: TP=2 (1 with one GPU)
    python -m bench.probes.step_kernels --quick            # CPU: the tiny model, host only
"""

from __future__ import annotations

import argparse
import collections
import glob
import statistics
import tempfile
from pathlib import Path

import jax

from bench import common
from bench import decode as bd
from models import make_mesh, random_params

VARIANTS = {"psum": ("psum", "psum", "auto", False), "sifar": ("sifar", "sifar", "auto", False),
            "sifar+fused": ("sifar+fused", "sifar", "auto", True),
            # the fused call without its L2 prefetch of the next weight
            "sifar+fused:pf0": ("sifar+fused:pf0", "sifar", "auto", True, 0),
            "identity": ("identity", "identity", "auto", False)}


def kind_of(kernel: str) -> str:
    """A kernel's kind, from its name."""
    k = kernel.lower()
    if "sifar" in k:
        return "sifar"
    if "nccl" in k:
        return "nccl"
    if any(t in k for t in ("gemm", "dot", "cublas", "cutlass", "xmma", "matmul")):
        return "matmul"
    if "reduce" in k or "reduction" in k:
        return "reduction"
    return "other"


def device_kernels(xspace_path: str) -> list[tuple[str, int, int]]:
    """[(name, start_ns, duration_ns)] of the kernels on the first GPU's streams."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xspace_path)
    planes = sorted((p for p in data.planes if p.name.startswith("/device:GPU:")),
                    key=lambda p: p.name)
    if not planes:
        return []
    out = []
    for line in planes[0].lines:
        if not line.name.startswith("Stream"):
            continue  # "XLA Ops", "XLA Modules": annotations over the same kernels
        out += [(e.name, int(e.start_ns), int(e.duration_ns)) for e in line.events]
    return out


def per_step(kernels, steps: int, top: int) -> dict:
    """Counts and device microseconds per step, by kind and for the `top` longest kernels."""
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    by_name = collections.defaultdict(list)
    for name, _, dur in kernels:
        by_kind[kind_of(name)][0] += 1
        by_kind[kind_of(name)][1] += dur / 1e3
        by_name[name].append(dur / 1e3)
    busy = sum(d for _, _, d in kernels) / 1e3
    span = (max(t + d for _, t, d in kernels) - min(t for _, t, _ in kernels)) / 1e3
    names = sorted(by_name, key=lambda n: -sum(by_name[n]))[:top]
    return {
        "kernels_per_step": round(len(kernels) / steps, 1),
        "busy_us_per_step": round(busy / steps, 1),
        # first kernel's start to last kernel's end: idle = span - busy (kernels on one stream)
        "span_us_per_step": round(span / steps, 1),
        "by_kind": {k: {"count": round(c / steps, 1), "us": round(t / steps, 1)}
                    for k, (c, t) in sorted(by_kind.items())},
        "top": [{"kernel": n[:120], "kind": kind_of(n), "count": round(len(by_name[n]) / steps, 1),
                 "median_us": round(statistics.median(by_name[n]), 2),
                 # a kernel run at several shapes (one name, several calls) is multimodal
                 "p25_us": round(common.percentile(by_name[n], 25), 2),
                 "p75_us": round(common.percentile(by_name[n], 75), 2),
                 "us": round(sum(by_name[n]) / steps, 1)} for n in names],
    }


def profile_steps(dec, steps: int) -> list[tuple[str, int, int]]:
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            dec.advance(steps)
            dec.token()
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        return device_kernels(files[0]) if files else []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.step_kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=None, help="default: 2 (1 with one GPU)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=8, help="profiled back-to-back steps")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--top", type=int, default=12, help="kernels listed per variant")
    p.add_argument("--quick", action="store_true", help="tiny model (CPU)")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = p.parse_args(argv)
    platform, devices = common.bench_devices(min_gpus=1)
    gpu = platform == "gpu"
    tp = args.tp or (2 if len(devices) >= 2 else 1)
    preset = "tiny" if args.quick or not gpu else "llama3_8b"
    config = bd.PRESETS[preset]().replace(dtype="bfloat16" if gpu else "float32",
                                          max_seq_len=args.context)
    mesh = make_mesh(tp, devices=devices[:tp])
    params = random_params(config, mesh, seed=0)
    s = {"warmup": 2, "samples": 1, "tokens": args.steps, "chunk": 16}
    results = {"host": common.host_tag(devices), "tp": tp, "preset": preset,
               "steps": args.steps, "context": args.context, "variants": {}}
    for name in [v.strip() for v in args.variants.split(",") if v.strip()]:
        variant = VARIANTS[name]
        dec = bd.make_decoder(config, mesh, params, variant, 1, args.context, 0)
        dec.seek(args.context - args.steps - 8, bd.start_tokens(config, 1, 0))
        dec.advance(3)  # compiled and warm
        dec.token()
        kernels = profile_steps(dec, args.steps)
        del dec
        if not kernels:
            results["variants"][name] = {"note": "no GPU kernels in the profile (not a GPU host)"}
            print(f"{name}: no GPU kernels in the profile", flush=True)
            continue
        r = per_step(kernels, args.steps, args.top)
        results["variants"][name] = r
        kinds = ", ".join(f"{k} {v['count']} x = {v['us']} us" for k, v in r["by_kind"].items())
        print(f"{name}: {r['kernels_per_step']} kernels, {r['busy_us_per_step']} us busy of "
              f"{r['span_us_per_step']} us per step ({kinds})", flush=True)
        for t in r["top"]:
            print(f"    {t['us']:8.1f} us  {t['count']:5.1f} x {t['median_us']:6.2f} "
                  f"(p25 {t['p25_us']:.2f}, p75 {t['p75_us']:.2f})  [{t['kind']}] {t['kernel']}",
                  flush=True)
    if args.out:
        path = common.write_json(Path(args.out), results)
        print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
