"""Probe: XLA's side of bench/probes/gemv_cluster.cu. How fast do XLA's batch-1 projections
stream Llama-8B's TP=1 weights, per projection (chains of 32 dependent dots of one kind, each
with its own weight) and as a 32-layer chain of the four (qkv, o, gate_up, down), at 1 and 2
rows? Device-bound: the jitted chain is called back to back and waited for once.

    python -m bench.probes.gemv_cluster_xla            # one GPU (14 GB of weights)
    python -m bench.probes.gemv_cluster_xla --quick    # CPU: small shapes, 2 layers
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def to_k(y, k: int):
    """The next dot's input [rows, k] from y: its first k columns, or y repeated (down)."""
    n = y.shape[1]
    if n >= k:
        return y[:, :k]
    return jnp.concatenate([y] * (k // n) + ([y[:, :k % n]] if k % n else []), axis=1)


def timeit(f, args, calls: int) -> float:
    """Median seconds per call over 5 runs of `calls` back-to-back calls."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / calls)
    return float(np.median(ts))


def chain_args(module: str, doc: str, argv, with_tp: bool = False) -> tuple[int, ...]:
    """A chain probe's command line: (layers, back-to-back calls per timing, shape divisor), and
    with_tp: the tensor parallelism whose per-rank shapes it runs (--tp)."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--calls", type=int, default=30, help="back-to-back calls per timing")
    p.add_argument("--quick", action="store_true", help="shapes / 64, 2 layers, 2 calls (CPU)")
    if with_tp:
        p.add_argument("--tp", type=int, choices=(1, 2), default=1,
                       help="run one rank's shapes at this tensor parallelism (no all-reduce)")
    args = p.parse_args(argv)
    out = (2, 2, 64) if args.quick else (args.layers, args.calls, 1)
    return out + (args.tp,) if with_tp else out


def main(argv=None) -> int:
    layers, calls, div = chain_args("bench.probes.gemv_cluster_xla", __doc__, argv)
    shapes = {k: (a // div, b // div) for k, (a, b) in SHAPES.items()}
    w = {kind: [(jax.random.normal(jax.random.key(i * 7 + j), s, jnp.float32) * 0.02
                 ).astype(jnp.bfloat16) for i in range(layers)]
         for j, (kind, s) in enumerate(shapes.items())}
    hidden, ffn = shapes["o"][0], shapes["down"][0]

    def chain(kind):
        k_next = ffn if kind == "down" else hidden

        def f(ws, x):
            for wi in ws:
                x = to_k(x @ wi, k_next)
            return x
        return jax.jit(f)

    def all_layers(ws, x):
        for i in range(layers):
            x = to_k(x @ ws["qkv"][i], hidden)
            x = x @ ws["o"][i]
            x = to_k(x @ ws["gate_up"][i], ffn)
            x = x @ ws["down"][i]
        return x

    for rows in (1, 2):
        for kind, (k, n) in shapes.items():
            t = timeit(chain(kind), (w[kind], jnp.full((rows, k), 0.5, jnp.bfloat16)), calls)
            print(f"XLA {kind:8s} rows {rows}: {t / layers * 1e6:8.2f} us per projection "
                  f"({k * n * 2 / (t / layers) / 1e12:.2f} TB/s)", flush=True)
        t = timeit(jax.jit(all_layers), (w, jnp.full((rows, hidden), 0.5, jnp.bfloat16)), calls)
        total = sum(k * n * 2 for k, n in shapes.values()) * layers
        print(f"XLA LAYER CHAIN rows {rows}: {t * 1e3:.3f} ms, {t / layers * 1e6:.2f} us per "
              f"layer, {total / t / 1e12:.2f} TB/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
