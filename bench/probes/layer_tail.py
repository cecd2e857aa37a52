"""Probe: the cost of one layer tail (all-reduce + residual add + RMSNorm) per variant.

A decode step at batch 1 runs 64 layer tails (Llama-3.1-8B, hidden 4096). This times a chain
of R dependent tails in one jitted shard_map (each tail's normed output is the next one's
all-reduce input, XLA kept from fusing across tails), per tail (t(R2) - t(R1)) / (R2 - R1) as
bench.allreduce's jit level does, for: the norm alone (`norm`: what the decoder without
all-reduce runs), lax.psum + norm, sifar_psum + norm, and the fused `psum_add_rmsnorm`.
`fused - norm` is what one fused call costs over no all-reduce at all: the gap recovered of
issue 10 per layer tail.

    python -m bench.probes.layer_tail                 # GPU host: TP=2 (1 with one GPU)
    python -m bench.probes.layer_tail --quick         # CPU
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
from sifar_jax.fused import rms_norm  # noqa: E402

EPS = 1e-5


def tail(variant: str):
    """(x, residual, weight) -> (normed, new_residual) of one variant, inside shard_map."""
    def norm_only(x, r, w):
        r = r + x
        return rms_norm(r, w, EPS), r

    def composed(allreduce):
        def f(x, r, w):
            r = r + allreduce(x, "tp")
            return rms_norm(r, w, EPS), r
        return f

    return {"norm": norm_only, "psum+norm": composed(jax.lax.psum),
            "sifar+norm": composed(sifar_jax.sifar_psum),
            "fused": lambda x, r, w: sifar_jax.psum_add_rmsnorm(x, r, w, "tp", eps=EPS)}[variant]


def chain(mesh, variant: str, n: int):
    one = tail(variant)

    def body(x, r, w):
        for _ in range(n):
            # The next tail's input is this tail's output; the barrier keeps XLA from fusing
            # one tail's norm into the next tail's add (in the decoder a matmul lies between).
            x, r = jax.lax.optimization_barrier(one(x, r, w))
        return x, r

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P("tp"), P()),
                      check_vma=False)
    return jax.jit(f)


def per_tail_us(mesh, variant, args, r1: int, r2: int, samples: int) -> list[float]:
    short, long_ = chain(mesh, variant, r1), chain(mesh, variant, r2)
    common.warm_up(short, args, 2)
    common.warm_up(long_, args, 2)
    return [t * 1e6 for t in common.paired_differences(short, long_, args, r2 - r1, samples)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.layer_tail", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=None, help="default: 2 (1 with one GPU)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--variants", default="norm,psum+norm,sifar+norm,fused")
    p.add_argument("--chain", default="10,410", help="R1,R2")
    p.add_argument("--samples", type=int, default=25)
    p.add_argument("--quick", action="store_true", help="short chains, few samples (CPU)")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = p.parse_args(argv)
    platform, devices = common.bench_devices(min_gpus=1)
    tp = args.tp or (2 if len(devices) >= 2 else 1)
    r1, r2 = (2, 6) if args.quick else tuple(int(v) for v in args.chain.split(","))
    samples = 3 if args.quick else args.samples
    mesh = Mesh(np.array(devices[:tp]), ("tp",))
    sifar_jax.init(mesh)
    dtype = jnp.bfloat16
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((tp * args.tokens, args.hidden)), dtype)
    r = jnp.asarray(2 * rng.standard_normal((args.tokens, args.hidden)), dtype)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(args.hidden), dtype)
    args_ = (jax.device_put(x, NamedSharding(mesh, P("tp"))),
             jax.device_put(r, NamedSharding(mesh, P())), jax.device_put(w, NamedSharding(mesh, P())))
    results = {"host": common.host_tag(devices), "platform": platform, "tp": tp,
               "hidden": args.hidden, "tokens": args.tokens, "dtype": "bfloat16",
               "chain": [r1, r2], "samples": samples, "us_per_tail": {}}
    for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
        us = per_tail_us(mesh, variant, args_, r1, r2, samples)
        med = statistics.median(us)
        results["us_per_tail"][variant] = {"median": round(med, 3),
                                           "p10": round(common.percentile(us, 10), 3),
                                           "p90": round(common.percentile(us, 90), 3)}
        print(f"{variant:11s} {med:7.2f} us per tail (p10 {common.percentile(us, 10):.2f}, "
              f"p90 {common.percentile(us, 90):.2f})", flush=True)
    base = results["us_per_tail"].get("norm", {}).get("median")
    if base:
        for v, d in results["us_per_tail"].items():
            if v != "norm":
                print(f"{v:11s} {d['median'] - base:+7.2f} us over the norm alone", flush=True)
    sifar_jax.check()
    if args.out:
        print(f"wrote {common.write_json(Path(args.out), results)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
