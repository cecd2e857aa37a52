"""Probe (leaves the tree): ncu target: the TP=1 op at Llama-8B FP8 shapes (slot 1000), 3 calls; run under ncu by the driver's ncu step.
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


f = jax.jit(lambda c: sifar_jax.llama_step(x, rope, pos, norm, layers, c, kv_heads=KV, group=G, eps=1e-5, head=head)[1])
c = cache
for _ in range(3):
    c = jax.block_until_ready(f(c))
print("probe_ncu: ran", flush=True)
