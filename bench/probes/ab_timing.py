"""Probe (leaves the tree): the op alone at TP=1 (slot 1000, and slot 16000 of a 16K cache) and as 2 and 4 virtual ranks, for the driver's abn step (an A/B of builds; bits saved per tag and compared).
Random FP8 weights at Llama-8B shapes, slot 1000. Run from the repository root, sifar_jax built for CUDA."""
import time
import jax, jax.numpy as jnp, numpy as np
import sifar_jax
H, KV, G, F, L, S, V = 4096, 8, 4, 14336, 32, 2048, 128256
k = jax.random.split(jax.random.key(0), 8)
def w(key, n, kk):
    return (jax.random.normal(key, (n, kk), jnp.float32) * 100).clip(-448, 448).astype(jnp.float8_e4m3fn)
def sc(n, kk):
    return jnp.full((n,), 1 / (100 * kk ** 0.5), jnp.float32)
norm = jnp.ones((H,), jnp.bfloat16)
nq = KV * (G + 2) * 128
layers = []
for l in range(L):
    kl = jax.random.split(jax.random.fold_in(k[0], l), 4)
    layers.append(sifar_jax.LlamaLayer(norm, w(kl[0], nq, H), sc(nq, H), w(kl[1], H, KV * G * 128),
                                       sc(H, KV * G * 128), norm, w(kl[2], 2 * F, H), sc(2 * F, H),
                                       w(kl[3], H, F), sc(H, F)))
head = (w(k[1], V, H), sc(V, H))
x = jax.random.normal(k[2], (H,), jnp.float32).astype(jnp.bfloat16)
rope = jnp.ones((2, 128), jnp.float32)
cache = jax.random.normal(k[3], (L, 2, 1, KV, S, 128), jnp.float32).astype(jnp.bfloat16)
pos = jnp.array([1000, 0], jnp.int32)
kw = dict(kv_heads=KV, group=G, eps=1e-5, head=head)

def timed(step, n=64):
    @jax.jit
    def loop(cache, ws, n):
        def body(_, c):
            return step(c, ws)
        return jax.lax.fori_loop(0, n, body, cache)
    ws = (layers, head)
    c = jax.block_until_ready(loop(cache, ws, 2))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter(); c = jax.block_until_ready(loop(c, ws, n)); ts.append((time.perf_counter() - t0) / n)
    return min(ts) * 1e3, float(np.median(ts)) * 1e3


import sys
def tp1(c, ws):
    return sifar_jax.llama_step(x, rope, pos, norm, ws[0], c, kv_heads=KV, group=G, eps=1e-5, head=ws[1])[1]
def r2(c, ws):
    return sifar_jax.llama_step_virtual_ranks(x, rope, pos, norm, ws[0], c, kv_heads=KV, group=G,
        eps=1e-5, head=ws[1], ranks=2, allreduce="sifar")[1]
tag = sys.argv[1]
import os
out = jax.jit(lambda c, ws: sifar_jax.llama_step(x, rope, pos, norm, ws[0], c, kv_heads=KV, group=G, eps=1e-5, head=ws[1]))(cache, (layers, head))
np.savez(os.path.join(os.environ.get("OUT", "/tmp"), f"ab_{tag}.npz"), h=np.asarray(out[0].astype(jnp.float32)),
         kv=np.asarray(out[1][:, :, :, :, 1000].astype(jnp.float32)), logits=np.asarray(out[2]))
def rk(ranks, ar):
    return lambda c, ws: sifar_jax.llama_step_virtual_ranks(x, rope, pos, norm, ws[0], c, kv_heads=KV, group=G,
        eps=1e-5, head=ws[1], ranks=ranks, allreduce=ar)[1]
cache16 = jax.random.normal(k[4], (L, 2, 1, KV, 16384, 128), jnp.float32).astype(jnp.bfloat16)
pos16 = jnp.array([16000, 0], jnp.int32)
def tp1_16k(c, ws):
    return sifar_jax.llama_step(x, rope, pos16, norm, ws[0], c, kv_heads=KV, group=G, eps=1e-5, head=ws[1])[1]
def timed16(step, n=32):
    @jax.jit
    def loop(cache, ws, n):
        return jax.lax.fori_loop(0, n, lambda _, c: step(c, ws), cache)
    ws = (layers, head)
    c = jax.block_until_ready(loop(cache16, ws, 2)); ts = []
    for _ in range(5):
        t0 = time.perf_counter(); c = jax.block_until_ready(loop(c, ws, n)); ts.append((time.perf_counter() - t0) / n)
    return min(ts) * 1e3, float(np.median(ts)) * 1e3
lo, med = timed16(tp1_16k)
print(f"probe_time {tag} tp1-16k: {lo:.3f} ms min, {med:.3f} median", flush=True)
del cache16
for name, f in (("tp1", tp1), ("r2-sifar", r2), ("r4-sifar", rk(4, "sifar")), ("tp1", tp1)):
    lo, med = timed(f)
    print(f"probe_time {tag} {name}: {lo:.3f} ms min, {med:.3f} median", flush=True)
