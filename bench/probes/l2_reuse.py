"""Probe: does a batch-1 matmul run faster when its weight is already in L2?

The premise of prefetching the next matmul's weight during an all-reduce's wait
(psum_add_rmsnorm(prefetch=), docs/performance.md): the decode step's matmuls are
bound by reading their weights from HBM, so bytes already in L2 cut their time.
Here one jit runs y1 = x @ W, then y2 = x2 @ W with x2 depending on y1 (so the
second matmul starts after the first and finds the W bytes the first left in L2),
then the same after a pass over a large buffer in between (L2 flushed). Kernel
durations come from a device profile (CUPTI via jax.profiler), median over runs.

    python -m bench.probes.l2_reuse              # GPU host
    python -m bench.probes.l2_reuse --quick      # CPU: small shapes, runs the code only
"""

from __future__ import annotations

import argparse
import collections
import glob
import statistics
import tempfile

import jax
import jax.numpy as jnp

from bench.probes.step_kernels import device_kernels

# (name, rows, cols) of bf16 weights: the decode step's local shapes at TP=2 (Llama-3.1-8B).
SHAPES = [("qkv 25 MB", 4096, 3072), ("o 16 MB", 2048, 4096), ("down 58 MB", 7168, 4096),
          ("gate_up 117 MB", 4096, 14336)]


def chain(x, w, big):
    y1 = x @ w
    x2 = x + (y1[:, :1] * 1e-30).astype(x.dtype)   # depends on y1, the same numbers
    y2 = x2 @ w                                      # W's bytes: what y1 left in L2
    flushed = big * 2                                # streams 512 MB through L2
    x3 = x2 + (flushed[:1, :1] * 0 + y2[:, :1] * 1e-30).astype(x.dtype)
    y3 = x3 @ w                                      # W's bytes: back in HBM
    return y1, y2, y3, flushed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.l2_reuse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="small shapes (CPU)")
    args = p.parse_args(argv)
    dev = jax.devices()[0]
    side = 1 << (8 if args.quick else 14)
    big = jax.device_put(jnp.ones((side, side), jnp.bfloat16), dev)  # 512 MB on GPUs
    key = jax.random.PRNGKey(0)
    shapes = [("tiny", 64, 128)] if args.quick else SHAPES
    for name, rows, cols in shapes:
        w = jax.device_put(jax.random.normal(key, (rows, cols), jnp.bfloat16), dev)
        x = jax.device_put(jax.random.normal(key, (1, rows), jnp.bfloat16), dev)
        f = jax.jit(chain)
        jax.block_until_ready(f(x, w, big))
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                for _ in range(args.runs):
                    jax.block_until_ready(f(x, w, big))
            files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
            kernels = device_kernels(files[0]) if files else []
        if not kernels:
            print(f"{name}: no GPU kernels in the profile")
            continue
        # Kernels in start order, one run after another: the matmuls are the three longest
        # kernels of a run besides the flush; pick them by order of appearance per run.
        kernels.sort(key=lambda k: k[1])
        per_run = len(kernels) // args.runs
        by_pos = collections.defaultdict(list)
        for i, (kname, _, dur) in enumerate(kernels[:per_run * args.runs]):
            by_pos[(i % per_run, kname[:60])].append(dur / 1e3)
        print(f"{name}: {per_run} kernels per run")
        for (pos, kname), durs in sorted(by_pos.items()):
            print(f"    #{pos} {statistics.median(durs):8.2f} us  {kname}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
