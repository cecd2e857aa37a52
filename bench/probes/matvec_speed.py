"""Probe: how fast do a decode step's batch-1 products stream their weights, with XLA's dots
(one row, or two rows with the first kept: Decoder(gemm_rows=2)) and with sifar_jax.matvec (our
split-K kernel, at several grid sizes)?

One jit runs a chain of `--layers` layers, each with its own weights (so every layer's bytes
come from HBM, not L2), and the wall time per layer is the median over runs, in microseconds
and in TB/s of weight bytes read:
  dense: Llama-3.1-8B's qkv / o / gate_up / down at TP=1 and at TP=2's per-rank shapes;
  moe:   Qwen3-30B-A3B's chosen experts (top-8 of 128, gate_up and down) at TP=1 and TP=2,
         with models.qwen3_moe's "gather" (rows 1 and 2) and "matvec" implementations.
Each variant's first layer is checked against a float64 reference of the same inputs.

    python -m bench.probes.matvec_speed                 # one GPU
    python -m bench.probes.matvec_speed --quick         # CPU: small shapes, runs the code only
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import sifar_jax.matvec as mv
from models import qwen3_moe

DENSE = {"llama8b_tp1": [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)],
         "llama8b_tp2": [(4096, 3072), (2048, 4096), (4096, 14336), (7168, 4096)]}
MOE = {"qwen30b_tp1": dict(experts=128, hidden=2048, width=768, top_k=8),
       "qwen30b_tp2": dict(experts=128, hidden=2048, width=384, top_k=8)}
QUICK_DENSE = {"tiny": [(64, 96), (96, 64)]}
QUICK_MOE = {"tiny_moe": dict(experts=8, hidden=64, width=32, top_k=2)}


def time_fn(fn, args, runs: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


class plan_limits:
    """sifar_jax.matvec's plan limits set while a variant is traced: "528" (blocks) or
    "528/0.1" (blocks / the partial sums' largest share of the weight bytes)."""

    def __init__(self, spec: str | None):
        target, _, share = (spec or "").partition("/")
        self.new = dict(TARGET_BLOCKS=int(target) if target else mv.TARGET_BLOCKS,
                        MAX_PARTIAL_SHARE=float(share) if share else mv.MAX_PARTIAL_SHARE)

    def __enter__(self):
        self.old = {k: getattr(mv, k) for k in self.new}
        for k, v in self.new.items():
            setattr(mv, k, v)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            setattr(mv, k, v)


def dense_variant(name: str, target: str | None):
    """f(x, weights) -> every layer's outputs: each weight [K, N] times x[:, :K]."""
    def f(x, weights):
        outs = []
        for w in weights:
            xk = x[:, : w.shape[0]]
            if name == "xla1":
                outs.append(xk @ w)
            elif name == "xla2":
                outs.append((jnp.broadcast_to(xk, (2, xk.shape[1])) @ w)[:1])
            else:
                with plan_limits(target):
                    outs.append(mv.matvec(xk, w))
        return outs
    return jax.jit(f)


def moe_variant(name: str, target: str | None):
    """f(x, weights, ids, layers) -> every layer's partial MoE output."""
    def f(x, weights, ids, layers):
        outs = []
        for gate_up, down in layers:
            if name == "matvec":
                with plan_limits(target):
                    outs.append(qwen3_moe.experts_matvec(x, weights, ids, gate_up, down))
            else:
                rows = 2 if name == "gather2" else 1
                outs.append(qwen3_moe.experts_gather(x, weights, ids, gate_up, down, rows))
        return outs
    return jax.jit(f)


def rel_err(got, want) -> float:
    got = np.asarray(got, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def measure(set_name: str, variant: str, f, fargs, want, nbytes: int, args) -> dict:
    """One variant: its first layer's error against float64, its time per layer; printed."""
    err = rel_err(f(*fargs)[0], want)
    sec = time_fn(f, fargs, args.runs)
    r = dict(set=set_name, variant=variant, us_per_layer=sec / args.layers * 1e6,
             tb_per_s=nbytes / sec / 1e12, rel_err=err)
    print(f"{set_name:12s} {variant:12s} {r['us_per_layer']:8.1f} us/layer "
          f"{r['tb_per_s']:5.2f} TB/s  rel err {err:.1e}", flush=True)
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.matvec_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--targets", default="264,528,1056,528/0.1",
                   help="matvec plan limits to try, comma-separated: blocks per call, or "
                        "blocks/largest share of partial sums (sifar_jax.matvec.matvec_plan)")
    p.add_argument("--only", choices=("dense", "moe"), default=None)
    p.add_argument("--quick", action="store_true", help="small shapes (CPU)")
    p.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.runs = 2, 2
    dt = jnp.float32 if args.quick else jnp.bfloat16
    key = jax.random.PRNGKey(0)
    targets = args.targets.split(",")
    variants_d = ["xla1", "xla2"] + [f"matvec@{t}" for t in targets]
    variants_m = ["gather1", "gather2"] + [f"matvec@{t}" for t in targets]
    results = []
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)

    for set_name, shapes in ({} if args.only == "moe" else
                             (QUICK_DENSE if args.quick else DENSE)).items():
        kx, key = jax.random.split(key)
        kmax = max(k for k, _ in shapes)
        x = jax.random.normal(kx, (1, kmax), jnp.float32).astype(dt)
        weights = []
        for _ in range(args.layers):
            for k, n in shapes:
                kw, key = jax.random.split(key)
                weights.append((jax.random.normal(kw, (k, n), jnp.float32) * k ** -0.5)
                               .astype(dt))
        nbytes = sum(w.size * w.dtype.itemsize for w in weights)
        want = np.asarray(x[:, : shapes[0][0]], np.float64) @ np.asarray(weights[0], np.float64)
        for v in variants_d:
            name, _, t = v.partition("@")
            f = dense_variant(name, t or None)
            results.append(measure(set_name, v, f, (x, weights), want, nbytes, args))
        del weights

    for set_name, m in ({} if args.only == "dense" else
                        (QUICK_MOE if args.quick else MOE)).items():
        e, h, i, k = m["experts"], m["hidden"], m["width"], m["top_k"]
        kx, kr, key = jax.random.split(key, 3)
        x = jax.random.normal(kx, (1, h), jnp.float32).astype(dt)
        ids = jax.random.permutation(kr, e)[:k].reshape(1, k).astype(jnp.int32)
        weights = jnp.full((1, k), 1.0 / k, dt)
        layers = []
        for _ in range(args.layers):
            k1, k2, key = jax.random.split(key, 3)
            layers.append(((jax.random.normal(k1, (e, h, 2, i), jnp.float32) * h ** -0.5)
                           .astype(dt),
                           (jax.random.normal(k2, (e, i, h), jnp.float32) * i ** -0.5)
                           .astype(dt)))
        nbytes = args.layers * k * (h * 2 * i + i * h) * jnp.dtype(dt).itemsize  # chosen only
        gu = np.asarray(layers[0][0], np.float64)[np.asarray(ids[0])]
        dn = np.asarray(layers[0][1], np.float64)[np.asarray(ids[0])]
        hh = np.einsum("h,khcf->kcf", np.asarray(x[0], np.float64), gu)
        act = hh[:, 0] / (1 + np.exp(-hh[:, 0])) * hh[:, 1]
        want = (np.einsum("kf,kfh->kh", act, dn) * np.asarray(weights[0], np.float64)[:, None]
                ).sum(0)[None]
        for v in variants_m:
            name, _, t = v.partition("@")
            f = moe_variant(name, t or None)
            results.append(measure(set_name, v, f, (x, weights, ids, layers), want, nbytes,
                                   args))
        del layers
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                           layers=args.layers, results=results), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
