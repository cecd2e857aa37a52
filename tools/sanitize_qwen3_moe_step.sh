#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck and synccheck on sifar_jax.qwen3_moe_step's persistent
# kernel (ffi/step/cuda_qwen3_moe_step.cu), one GPU: 2 layers of a small Qwen3-MoE (hidden 2048,
# 4 KV heads of 2 query heads, 64 experts of FFN 384, top-8: the ring's whole slabs, a partial
# one, more experts than a warp's lanes), FP8 per-channel and per-expert scales (o per tensor), a
# cache of 2048 slots at slots 0, 63, 64 and 2047 and one left-padded (first slot 40), an FP8
# LM head of 1000 rows; then as 2 and 4 virtual ranks (sifar and oneshot inside) at slots 0 and
# 1023; then the same weights as bf16 (TP=1 and 2 ranks). Every buffer is its own allocation
# (XLA_PYTHON_CLIENT_ALLOCATOR=platform), so memcheck sees an access past any of them.
#   bash tools/sanitize_qwen3_moe_step.sh    (from any directory; sifar-jax installed, or built into src/)
set -uo pipefail
cd "$(dirname "$0")/.."
read -r -d '' CODE <<'PY'
import jax, jax.numpy as jnp, numpy as np
import sifar_jax
rng = np.random.default_rng(0)
H, KV, G, I, E, K, L, S = 2048, 4, 2, 384, 64, 8, 2, 2048
def w(*shape):
    return jnp.asarray(np.clip(rng.standard_normal(shape) * 100, -448, 448), jnp.float8_e4m3fn)
def s(n, k):
    return jnp.asarray(rng.uniform(0.5, 2, (n,)) / (100 * k ** 0.5), jnp.float32)
norm = lambda n=H: jnp.asarray(rng.uniform(0.5, 1.5, n), jnp.bfloat16)
nq = KV * (G + 2) * 128
scales = (E * 2 * I, E, 1)  # gate_up's per channel, per expert, per tensor (one per layer)
layers = [sifar_jax.Qwen3MoeLayer(
    norm(), w(nq, H), s(nq, H), norm(128), norm(128), w(H, KV * G * 128), s(1, KV * G * 128),
    norm(), jnp.asarray(rng.standard_normal((E, H)) / H ** 0.5, jnp.bfloat16),
    w(E, 2 * I, H), s(scales[l], H), w(E, H, I), s((E * H, E)[l], I)) for l in range(L)]
x = jnp.asarray(rng.standard_normal(H), jnp.bfloat16)
rope = jnp.asarray(np.stack([np.cos(np.arange(128)), np.sin(np.arange(128))]), jnp.float32)
cache = jnp.asarray(rng.standard_normal((L, 2, 1, KV, S, 128)), jnp.bfloat16)
V = 1000
head = (w(V, H), s(V, H))
kw = dict(kv_heads=KV, group=G, top_k=K, norm_topk_prob=True, eps=1e-6, head=head)
def finite(*a):
    return all(np.isfinite(np.asarray(v, np.float32)).all() for v in a)
for p, first in ((0, 0), (63, 0), (64, 0), (2047, 0), (100, 40)):
    h, cache, logits = sifar_jax.qwen3_moe_step(x, rope, jnp.array([p, first], jnp.int32), norm(),
                                                layers, cache, **kw)
    assert finite(h, logits), p
for r in (2, 4):
    for ar in ("sifar", "oneshot"):
        for p in (0, 1023):
            h, cache, logits = sifar_jax.qwen3_moe_step_virtual_ranks(
                x, rope, jnp.array([p, 0], jnp.int32), norm(), layers, cache, ranks=r,
                allreduce=ar, **kw)
            assert finite(h, logits), (r, ar, p)
bf = lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float8_e4m3fn else a
layers16 = [sifar_jax.Qwen3MoeLayer(*(bf(a) for a in layer)) for layer in layers]
kw16 = dict(kw, head=(bf(head[0]), head[1]))
for p in (0, 1023):
    h, cache, logits = sifar_jax.qwen3_moe_step(x, rope, jnp.array([p, 0], jnp.int32), norm(),
                                                layers16, cache, **kw16)
    assert finite(h, logits), ("bf16", p)
    h, cache, logits = sifar_jax.qwen3_moe_step_virtual_ranks(
        x, rope, jnp.array([p, 0], jnp.int32), norm(), layers16, cache, ranks=2, **kw16)
    assert finite(h, logits), ("bf16 ranks", p)
print("sanitize_qwen3_moe_step: all calls ran (5 slots; 2 and 4 virtual ranks x 2 all-reduces x "
      "2 slots; bf16 weights at TP=1 and 2 ranks x 2 slots; outputs finite)")
PY
source tools/sanitize_run.sh
sanitize_python "$CODE"
