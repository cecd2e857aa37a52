"""Probe: can a step take each weight as one array stacked over layers, without a copy?

A waited decode step pays the host ~0.5-1 us per argument array (bench.probes.dispatch_cost):
Llama-8B's 195 weight arrays cost ~0.1-0.2 ms per step, Qwen3-30B-A3B's ~435 ~0.4 ms
(docs/performance.md, Open). Stacking each parameter over the layers ([layers, ...]: 9 arrays)
would cut that, but only if XLA reads a layer's slice `w[l]` in place inside the matmul that
consumes it; a copy of the slice would add a weight's worth of traffic per layer. This compiles
a chain of Llama-shaped layers (the qkv, o, gate_up and down projections of two rows, as
models.tp.project runs them at batch 1) twice, with the weights stacked and as one array per
layer and projection, and reports:

    copies     instructions in the stacked executable's optimised HLO that write a layer-sized
               weight (a slice materialised: 0 means every matmul reads its slice in place)
    device us  per chain, back-to-back calls (the weights' floor at 4.3 TB/s beside it)
    call us    the host's time to dispatch one call (the arguments' cost)

    python -m bench.probes.stacked_weights             # one GPU: Llama-8B shapes, 8 layers
    python -m bench.probes.stacked_weights --quick     # CPU: small shapes (the code path)
"""

from __future__ import annotations

import argparse
import re
import time

PROJECTIONS = ("qkv", "o", "gate_up", "down")


def shapes(hidden: int, heads: int, kv_heads: int, head_dim: int, mlp: int) -> dict:
    """Each projection's weight shape, as models.attention / models.llama lay them out."""
    group = heads // kv_heads
    return {"qkv": (hidden, kv_heads, group + 2, head_dim), "o": (heads, head_dim, hidden),
            "gate_up": (hidden, 2, mlp), "down": (mlp, hidden)}


def layer(x, w: dict, heads: int, head_dim: int):
    """One layer's four projections on x [2, hidden] (no attention: its inputs and output only)."""
    import jax
    import jax.numpy as jnp

    qkv = jnp.einsum("bh,hkgd->bkgd", x, w["qkv"])
    q = qkv[:, :, :-2].reshape(x.shape[0], heads, head_dim)
    x = x + jnp.einsum("bhd,hdm->bm", q, w["o"])
    h = jnp.einsum("bh,hcf->bcf", x, w["gate_up"])
    return x + jnp.einsum("bf,fh->bh", jax.nn.silu(h[:, 0]) * h[:, 1], w["down"])


def layer_sized_writes(text: str, weight_shapes) -> list[str]:
    """Instructions of an optimised HLO module whose result has one of weight_shapes (HLO
    'bf16[4096,2,14336]' form, no layout) other than parameters, bitcasts and tuples."""
    found = []
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+\[[\d,]*\])(?:\{[^}]*\})?\s+([\w\-]+)\(",
                     line)
        if m and m.group(2) in weight_shapes and m.group(3) not in (
                "parameter", "bitcast", "tuple", "get-tuple-element"):
            found.append(line.strip()[:200])
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.stacked_weights", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="small shapes (CPU)")
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.hlo import hlo_shape

    dims = (256, 4, 2, 32, 512) if args.quick else (4096, 32, 8, 128, 14336)  # Llama-8B
    heads, head_dim = dims[1], dims[3]
    dtype = jnp.float32 if args.quick else jnp.bfloat16
    L = args.layers
    keys = iter(jax.random.split(jax.random.key(0), len(PROJECTIONS) + 1))
    stacked = {n: (jax.random.uniform(next(keys), (L, *s), jnp.float32, -1, 1) * s[0] ** -0.5
                   ).astype(dtype) for n, s in shapes(*dims).items()}
    separate = [{n: w[i] for n, w in stacked.items()} for i in range(L)]
    x = jax.random.normal(next(keys), (2, dims[0]), jnp.float32).astype(dtype)

    def chain_stacked(ws, x):
        for i in range(L):
            x = layer(x, {n: w[i] for n, w in ws.items()}, heads, head_dim)
        return x

    def chain_separate(ws, x):
        for w in ws:
            x = layer(x, w, heads, head_dim)
        return x

    exes = {"stacked": (jax.jit(chain_stacked).lower(stacked, x).compile(), stacked),
            "separate": (jax.jit(chain_separate).lower(separate, x).compile(), separate)}
    weight_shapes = {hlo_shape(dtype, s) for s in shapes(*dims).values()}
    copies = layer_sized_writes(exes["stacked"][0].as_text(), weight_shapes)
    y = {name: np.asarray(exe(ws, x), np.float32) for name, (exe, ws) in exes.items()}
    np.testing.assert_allclose(y["stacked"], y["separate"], rtol=1e-2, atol=1e-2)
    floor_us = sum(w.size * w.dtype.itemsize for w in stacked.values()) / 4.3e12 * 1e6
    print(f"{L} layers, weights {floor_us:.1f} us at 4.3 TB/s; stacked: {len(copies)} layer-sized "
          f"writes in the optimised HLO")
    for line in copies[:6]:
        print(f"  {line}")
    for _ in range(2):
        for name, (exe, ws) in exes.items():
            exe(ws, x).block_until_ready()
            t0 = time.perf_counter()
            calls = []
            for _ in range(args.calls):
                c0 = time.perf_counter()
                out = exe(ws, x)
                calls.append(time.perf_counter() - c0)
            out.block_until_ready()
            device = (time.perf_counter() - t0) / args.calls * 1e6
            print(f"{name:>9}: {len(jax.tree.leaves(ws)):>3} arrays, device {device:8.1f} us per "
                  f"chain, call {np.median(calls) * 1e6:6.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
