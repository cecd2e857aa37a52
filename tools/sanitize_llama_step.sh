#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck and synccheck on sifar_jax.llama_step's persistent
# kernel (ffi/step/cuda_llama_step.cu), one GPU: 2 layers of a small Llama (hidden 2048, 2 KV
# heads of 4 query heads, FFN 2560: the weight ring's whole slabs, a partial one and slots past
# a block's rows; FP8 per-channel and per-tensor scales), a cache of 16384
# slots, at slots 0, 63, 64, 1023 and 16383 (one key range per head up to every range the grid
# holds), and one left-padded (first slot 40); an FP8 LM head of 1000 rows after the last
# layer; then as 2 virtual ranks with the all-reduce inside (sifar and oneshot) at slots 0 and
# 1023 (the all-reduce's waits get 5 s: the sanitizer slows the kernel); then the same weights
# as bf16 (TP=1 and 2 ranks with sifar, slots 0 and 1023). Every buffer is its own allocation
# (XLA_PYTHON_CLIENT_ALLOCATOR=platform), so memcheck sees an access past any of them.
#   bash tools/sanitize_llama_step.sh    (from any directory; sifar-jax installed, or built into src/)
set -uo pipefail
cd "$(dirname "$0")/.."
read -r -d '' CODE <<'PY'
import jax, jax.numpy as jnp, numpy as np
import sifar_jax
rng = np.random.default_rng(0)
H, KV, G, F, L, S = 2048, 2, 4, 2560, 2, 16384
def w(n, k):
    return jnp.asarray(np.clip(rng.standard_normal((n, k)) * 100, -448, 448), jnp.float8_e4m3fn)
def s(n, k, per_channel=True):
    return jnp.asarray(rng.uniform(0.5, 2, (n if per_channel else 1,)) / (100 * k ** 0.5), jnp.float32)
norm = lambda: jnp.asarray(rng.uniform(0.5, 1.5, H), jnp.bfloat16)
nq = KV * (G + 2) * 128
layers = [sifar_jax.LlamaLayer(norm(), w(nq, H), s(nq, H, l == 0), w(H, KV * G * 128), s(H, KV * G * 128),
                               norm(), w(2 * F, H), s(2 * F, H), w(H, F), s(H, F, l == 1)) for l in range(L)]
x = jnp.asarray(rng.standard_normal(H), jnp.bfloat16)
rope = jnp.asarray(np.stack([np.cos(np.arange(128)), np.sin(np.arange(128))]), jnp.float32)
cache = jnp.asarray(rng.standard_normal((L, 2, 1, KV, S, 128)), jnp.bfloat16)
V = 1000  # an FP8 head of per-row scales: the ring's last GEMV
head = (w(V, H), s(V, H))
f = jax.jit(lambda pos, cache: sifar_jax.llama_step(x, rope, pos, norm(), layers, cache,
                                                    kv_heads=KV, group=G, eps=1e-5, head=head))
for p, first in ((0, 0), (63, 0), (64, 0), (1023, 0), (16383, 0), (100, 40)):
    h, cache, logits = f(jnp.array([p, first], jnp.int32), cache)
    assert np.isfinite(np.asarray(h, np.float32)).all() and np.isfinite(np.asarray(logits)).all(), p
for ar in ("sifar", "oneshot"):
    g = jax.jit(lambda pos, cache: sifar_jax.llama_step_virtual_ranks(
        x, rope, pos, norm(), layers, cache, kv_heads=KV, group=G, eps=1e-5, head=head, ranks=2,
        allreduce=ar, timeout_s=5.0))
    for p in (0, 1023):
        h, cache, logits, st = g(jnp.array([p, 0], jnp.int32), cache)
        sifar_jax.check_step_status(st)
        assert np.isfinite(np.asarray(h, np.float32)).all() and np.isfinite(np.asarray(logits)).all(), (ar, p)
# bf16 weights (the kernels with 8-weight chunks): the same values as bf16, TP=1 and 2 ranks
bf = lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float8_e4m3fn else a
layers16 = [sifar_jax.LlamaLayer(*(bf(a) for a in layer)) for layer in layers]
head16 = (bf(head[0]), head[1])
for p in (0, 1023):
    h, cache, logits = sifar_jax.llama_step(x, rope, jnp.array([p, 0], jnp.int32), norm(), layers16,
                                            cache, kv_heads=KV, group=G, eps=1e-5, head=head16)
    assert np.isfinite(np.asarray(h, np.float32)).all() and np.isfinite(np.asarray(logits)).all(), ("bf16", p)
    h, cache, logits, st = sifar_jax.llama_step_virtual_ranks(
        x, rope, jnp.array([p, 0], jnp.int32), norm(), layers16, cache, kv_heads=KV, group=G,
        eps=1e-5, head=head16, ranks=2, allreduce="sifar", timeout_s=5.0)
    sifar_jax.check_step_status(st)
    assert np.isfinite(np.asarray(h, np.float32)).all() and np.isfinite(np.asarray(logits)).all(), ("bf16 ranks", p)
print("sanitize_llama_step: all calls ran (6 slots, 2 virtual ranks x 2 all-reduces x 2 slots; "
      "bf16 weights at TP=1 and 2 ranks x 2 slots; outputs finite)")
PY
source tools/sanitize_run.sh
sanitize_python "$CODE"
