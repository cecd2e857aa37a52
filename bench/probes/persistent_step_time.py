"""Probe (leaves the tree in the next commit): sifar_jax.llama_step alone at Llama-8B FP8 shapes, by position."""
import json, sys, time
import numpy as np, jax, jax.numpy as jnp
import sifar_jax
tp = int(sys.argv[1]) if len(sys.argv) > 1 else 1
H, KV, G, F, L, S = 4096, 8 // tp, 4, 14336 // tp, 32, int(sys.argv[2]) if len(sys.argv) > 2 else 1024
key = jax.random.key(0)
def w(i, n, k):
    return (jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.bfloat16) * 32).astype(jnp.float8_e4m3fn)
def sc(i, n, k):
    return jax.random.uniform(jax.random.fold_in(key, 10**6 + i), (n,), jnp.float32, 0.5, 2) / (32 * k ** 0.5)
layers = []
for l in range(L):
    ones = jnp.ones((H,), jnp.bfloat16)
    nq = KV * (G + 2) * 128
    layers.append(sifar_jax.LlamaLayer(ones, w(4*l, nq, H), sc(4*l, nq, H), w(4*l+1, H, KV*G*128), sc(4*l+1, H, KV*G*128),
                                       ones, w(4*l+2, 2*F, H), sc(4*l+2, 2*F, H), w(4*l+3, H, F), sc(4*l+3, H, F)))
x = jax.random.normal(key, (H,), jnp.bfloat16)
rope = jnp.stack([jnp.ones(128), jnp.zeros(128)]).astype(jnp.float32)
cache = (jax.random.normal(key, (L, 2, 1, KV, S, 128), jnp.float32) * 0.5).astype(jnp.bfloat16)
f = jax.jit(lambda x, rope, pos, layers, cache: sifar_jax.llama_step(x, rope, pos, layers[0].input_norm, layers, cache,
            kv_heads=KV, group=G, eps=1e-5), donate_argnums=(4,))
out = {"tp": tp, "capacity": S}
for p in (0, 63, 1023, S - 1):
    pos = jnp.array([p, 0], jnp.int32)
    h, cache = f(x, rope, pos, layers, cache)
    h.block_until_ready()
    ts = []
    for r in range(3):
        t = time.perf_counter()
        for _ in range(50):
            h, cache = f(x, rope, pos, layers, cache)
        h.block_until_ready()
        ts.append((time.perf_counter() - t) / 50 * 1e3)
    out[f"pos{p}_ms"] = [round(v, 4) for v in ts]
    out[f"pos{p}_finite"] = bool(np.isfinite(np.asarray(h, np.float32)).all())
wbytes = L * (H * KV * (G + 2) * 128 + H * KV * G * 128 + 3 * H * F)
out["weight_GB"] = wbytes / 1e9
out["TBps_at_pos0"] = round(wbytes / (min(out["pos0_ms"]) * 1e-3) / 1e12, 3)
print(json.dumps(out), flush=True)
