"""Probe: what XLA adds to a chain of sifar fp8_matvec calls (one H200)."""
# Run on a GPU host from the repository root (built into src/): PYTHONPATH=src:. python bench/probes/fp8_xla_chain.py cb
# and again with XLA_FLAGS=--xla_gpu_enable_command_buffer= (tag nocb).
import os, sys, time, statistics, re
import jax, jax.numpy as jnp
from sifar_jax import fp8_matvec as f8
sys.path.insert(0, ".")
from bench import gemv

def timed(fn, args, reps=20, inner=5):
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(reps):
        t0 = time.perf_counter(); r = None
        for _ in range(inner): r = fn(*args)
        jax.block_until_ready(r); out.append((time.perf_counter() - t0) / inner)
    return statistics.median(out) * 1e3

key = jax.random.key(0)
def mk(n, k, i):
    q = (jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.bfloat16) * 32).astype(jnp.float8_e4m3fn)
    return q, jnp.full((n, 1), 1 / (32 * k ** 0.5), jnp.float32)
tag = sys.argv[1] if len(sys.argv) > 1 else ""
# (b) 128 o-shaped calls, no slices
sq = [mk(4096, 4096, i) for i in range(128)]
x = jax.random.normal(key, (1, 4096), jnp.bfloat16)
def sq_chain(x, ws, **kw):
    h = x
    for q, s in ws: h = f8.fp8_matvec(h, q, s, impl="kernel", **kw)
    return h
f = jax.jit(sq_chain)
print(f"{tag} square chain 128 x (4096x4096): {timed(f, (x, sq)):.4f} ms", flush=True)
f2 = jax.jit(lambda x, ws: sq_chain(x, ws, pdl=False))
print(f"{tag} square chain no pdl: {timed(f2, (x, sq)):.4f} ms", flush=True)
txt = f.lower(x, sq).compile().as_text()
print(tag, "custom-calls", txt.count("custom_call_target=\"sifar"), "fusions", len(re.findall(r"= \S+ fusion\(", txt)),
      "command_buffer", txt.count("command_buffer"), "copies", len(re.findall(r" copy\(", txt)))
del sq
# (a) the bench chain (with slices)
lw = [[mk(n, k, 1000 + 4 * i + j) for j, (_, k, n) in enumerate(gemv.shapes(1))] for i in range(32)]
x2 = jax.random.normal(key, (1, 14336), jnp.bfloat16)
proj = lambda h, w: f8.fp8_matvec(h, w[0], w[1], impl="kernel")
g = jax.jit(lambda x, ws: gemv.chain(proj, ws, x, 1))
print(f"{tag} bench chain tp1: {timed(g, (x2, lw)):.4f} ms", flush=True)
txt = g.lower(x2, lw).compile().as_text()
print(tag, "custom-calls", txt.count("custom_call_target=\"sifar"), "fusions", len(re.findall(r"= \S+ fusion\(", txt)),
      "command_buffer", txt.count("command_buffer"), "slices", txt.count("slice("), "copies", len(re.findall(r" copy\(", txt)))
open(os.environ.get("OUT", "/tmp") + f"/chain_hlo{tag}.txt", "w").write(txt)
# (c) the chain with XLA's slices replaced by a pad-free layout: take h[:, :k] as the kernel's own read
# (not possible without an op change: skip)
