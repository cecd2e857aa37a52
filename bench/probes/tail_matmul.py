"""Probe: one layer tail together with the matmul after it, per variant.

At batch 1 every all-reduce of a decode step is followed by add, RMSNorm and a
matmul bound by reading its weight (the MLP's gate/up after attention, the next
layer's QKV after the MLP). This times a chain of R dependent tails + matmuls in
one jitted shard_map, each with its own weight from a pool larger than L2 (as
the decoder's layers are), per tail (t(R2) - t(R1)) / (R2 - R1):

  norm+dot          no all-reduce: the decoder without one (bench.decode's identity)
  psum+norm+dot     lax.psum, add, norm, XLA's dot
  fused+dot         sifar_jax.psum_add_rmsnorm (16 MiB prefetch), XLA's dot
  fused_matmul      sifar_jax.psum_add_rmsnorm_matmul: one launch

The next tail's partial is the matmul's output cut (or tiled) to the hidden
size: one small XLA fusion per tail, the same in every variant.

    python -m bench.probes.tail_matmul                 # GPU host: TP=2, QKV and gate/up shapes
    python -m bench.probes.tail_matmul --quick         # CPU
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from bench import common

common.use_host_devices(8)  # before jax is imported; only XLA:CPU reads it

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import sifar_jax  # noqa: E402
from models.tp import rms_norm  # noqa: E402

EPS = 1e-5
VARIANTS = ("norm+dot", "psum+norm+dot", "fused+dot", "fused_matmul")


def dot(h, m):
    return jnp.dot(h, m, preferred_element_type=jnp.float32).astype(h.dtype)


def tail(variant: str):
    """(x, residual, weight, matrix) -> (y, new_residual), inside shard_map."""
    def composed(allreduce):
        def f(x, r, w, m):
            r = r + allreduce(x)
            return dot(rms_norm(r, w, EPS), m), r
        return f

    def fused(x, r, w, m):
        h, r = sifar_jax.psum_add_rmsnorm(x, r, w, "tp", eps=EPS, prefetch=m)
        return dot(h, m), r

    return {"norm+dot": composed(lambda v: v),
            "psum+norm+dot": composed(lambda v: jax.lax.psum(v, "tp")),
            "fused+dot": fused,
            "fused_matmul": lambda x, r, w, m: sifar_jax.psum_add_rmsnorm_matmul(
                x, r, w, m, "tp", eps=EPS)}[variant]


def chain(mesh, variant: str, n: int, pool: int):
    one = tail(variant)

    def body(x, r, w, *ms):
        for i in range(n):
            y, r = one(x, r, w, ms[i % pool])
            hidden = x.shape[-1]
            reps = -(-hidden // y.shape[-1])
            x = jax.lax.optimization_barrier(jnp.tile(y, (1, reps))[:, :hidden])
        return x, r

    specs = (P("tp"), P(), P()) + (P(None, "tp"),) * pool
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P("tp"), P()),
                                 check_vma=False))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.tail_matmul", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=None, help="default: 2 (1 with one GPU)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--cols", default="3072,14336", help="columns per rank, one run each")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--chain", default="16,64", help="R1,R2")
    p.add_argument("--pool", type=int, default=16, help="distinct weights, cycled")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="small shapes, short chains (CPU)")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = p.parse_args(argv)
    platform, devices = common.bench_devices(min_gpus=1)
    tp = args.tp or (2 if len(devices) >= 2 else 1)
    r1, r2 = (2, 6) if args.quick else tuple(int(v) for v in args.chain.split(","))
    samples = 3 if args.quick else args.samples
    hidden = 256 if args.quick else args.hidden
    col_list = [64] if args.quick else [int(c) for c in args.cols.split(",")]
    pool = 2 if args.quick else args.pool
    mesh = Mesh(np.array(devices[:tp]), ("tp",))
    sifar_jax.init(mesh)
    grid = sifar_jax._ext._sifar.matmul_grid(0) if platform == "gpu" else 0
    print(f"psum_add_rmsnorm_matmul grid: {grid} blocks", flush=True)
    dtype = jnp.bfloat16
    rng = np.random.default_rng(0)
    rep, col_sh = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "tp"))
    x = jax.device_put(jnp.asarray(rng.standard_normal((tp, hidden)), dtype),
                       NamedSharding(mesh, P("tp")))
    r = jax.device_put(jnp.asarray(2 * rng.standard_normal((1, hidden)), dtype), rep)
    w = jax.device_put(jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), dtype), rep)
    results = {"host": common.host_tag(devices), "platform": platform, "tp": tp,
               "hidden": hidden, "dtype": "bfloat16", "chain": [r1, r2], "pool": pool,
               "samples": samples, "matmul_grid": grid, "us_per_tail": {}}
    for cols in col_list:
        key = jax.random.key(cols)
        ms = [jax.device_put(jax.random.normal(jax.random.fold_in(key, i), (hidden, tp * cols),
                                               dtype) * hidden ** -0.5, col_sh)
              for i in range(pool)]
        args_ = (x, r, w, *ms)
        row = results["us_per_tail"][str(cols)] = {}
        for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
            short, long_ = chain(mesh, variant, r1, pool), chain(mesh, variant, r2, pool)
            common.warm_up(short, args_, 2)
            common.warm_up(long_, args_, 2)
            us = [t * 1e6 for t in common.paired_differences(short, long_, args_, r2 - r1, samples)]
            med = statistics.median(us)
            row[variant] = {"median": round(med, 3), "p10": round(common.percentile(us, 10), 3),
                            "p90": round(common.percentile(us, 90), 3)}
            print(f"cols {cols:6d} {variant:14s} {med:8.2f} us per tail+matmul "
                  f"(p10 {common.percentile(us, 10):.2f}, p90 {common.percentile(us, 90):.2f})",
                  flush=True)
        base = row.get("norm+dot", {}).get("median")
        if base:
            for v, d in row.items():
                if v != "norm+dot":
                    print(f"cols {cols:6d} {v:14s} {d['median'] - base:+8.2f} us over no all-reduce",
                          flush=True)
        del ms
    sifar_jax.check()
    if args.out:
        print(f"wrote {common.write_json(Path(args.out), results)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
