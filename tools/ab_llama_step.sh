#!/usr/bin/env bash
# A/B of the persistent step (sifar_jax.llama_step) between builds on ONE GPU, from the
# repository root, everything written under $OUT:
#   git archive <commit> | gzip > .before/A.tar.gz     (one tarball per variant: A, B, ...)
#   OUT=/tmp/ab bash tools/ab_llama_step.sh A [B ...]  (on the device: carry .before)
#   OUT=/tmp/ab bash tools/ab_llama_step.sh            (this tree alone)
#   OUT=/tmp/ab bash tools/ab_llama_step.sh SIFAR_STEP_L2_AHEAD=0   (a variant NAME=VALUE: this
#                                                       tree run with that environment setting)
# Each .before/<V>.tar.gz and this tree (variant "this") are built for sm_90 in .validate/
# (in parallel, always: a warm device keeps the last call's module in src/sifar_jax), then
# timed in AB_ROUNDS rounds of alternating processes: the op alone at Llama-8B FP8 shapes with
# the head (AB_SHAPES=tiny: a small config, which is how the CPU test runs the Python below),
# TP=1 at slot 1000 of a 2K cache and slot 16000 of a 16K cache, 2 and 4 virtual ranks (sifar),
# each the min and median of 5 jitted loops of 64 steps; AB_WEIGHTS=bf16: bf16 weights (the
# FP8 weights' bytes twice over), else FP8 per channel. The weights are jit arguments, never
# closed over (JAX embeds a closed-over array in the HLO as a constant: 8 GB of them compile
# for minutes). One step's outputs at slot 1000 are saved per variant and compared with the
# first variant's, bit for bit. Logged line by line to $OUT/ab.log, so a cut call keeps its
# lines. Multicast is never run.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/ab-llama-step}; PY=${PYTHON:-python3}; W=$PWD/.validate
mkdir -p "$OUT" "$W"; LOG=$OUT/ab.log; T0=$(date +%s)
log() { echo "=== +$(( $(date +%s) - T0 ))s $*" | tee -a "$LOG"; }
variants=("$@" this)
JOBS=$(( $(nproc) / ${#variants[@]} )); (( JOBS > 0 )) || JOBS=1

source tools/build_tree.sh  # build_tree SRC BUILD_DIR
src_of() { [[ $1 == this || $1 == *=* ]] && echo "$PWD" || echo "$W/ab-$1"; }
log "building ${variants[*]}"
for v in "${variants[@]}"; do
  [[ $v == *=* ]] && continue  # this tree, another environment
  if [[ $v != this ]]; then
    rm -rf "$W/ab-$v" && mkdir -p "$W/ab-$v" && tar -xzf ".before/$v.tar.gz" -C "$W/ab-$v" ||
      { log "no .before/$v.tar.gz"; exit 1; }
  fi
  build_tree "$(src_of "$v")" "$W/ab-build-$v" | tee -a "$LOG" &
done
wait
for rnd in $(seq "${AB_ROUNDS:-2}"); do
  for v in "${variants[@]}"; do
    s=$(src_of "$v")
    setting=(); [[ $v == *=* ]] && setting=("$v")
    AB_TAG=${v//=/-} AB_OUT=$OUT timeout 300 env ${setting[@]+"${setting[@]}"} PYTHONPATH="$s/src:$s" "$PY" - <<'PY' 2>&1 |
import os, time
import jax, jax.numpy as jnp, numpy as np
import sifar_jax

tag, out = os.environ.get("AB_TAG", "this"), os.environ.get("AB_OUT", "/tmp")
if os.environ.get("AB_SHAPES", "8b") == "tiny":  # the CPU test's config: every case, quickly
    H, KV, G, F, L, V, S, LONG, POS, POS_LONG, N = 256, 4, 2, 512, 2, 512, 64, 256, 40, 200, 2
else:  # Llama-3.1-8B
    H, KV, G, F, L, V, S, LONG, POS, POS_LONG, N = 4096, 8, 4, 14336, 32, 128256, 2048, 16384, 1000, 16000, 64
keys = jax.random.split(jax.random.key(0), 8)


def fp8(key, n, k):  # random weights of a unit-variance output: e4m3 and per-channel scales,
    if os.environ.get("AB_WEIGHTS") == "bf16":  # or bf16 and a scale of one
        w = jax.random.normal(key, (n, k), jnp.float32) / k ** 0.5
        return w.astype(jnp.bfloat16), jnp.ones((1,), jnp.float32)
    w = (jax.random.normal(key, (n, k), jnp.float32) * 100).clip(-448, 448).astype(jnp.float8_e4m3fn)
    return w, jnp.full((n,), 1 / (100 * k ** 0.5), jnp.float32)


norm = jnp.ones((H,), jnp.bfloat16)
layers = []
for l in range(L):
    kl = jax.random.split(jax.random.fold_in(keys[0], l), 4)
    layers.append(sifar_jax.LlamaLayer(norm, *fp8(kl[0], KV * (G + 2) * 128, H),
                                       *fp8(kl[1], H, KV * G * 128), norm, *fp8(kl[2], 2 * F, H),
                                       *fp8(kl[3], H, F)))
weights = (layers, fp8(keys[1], V, H))
x = jax.random.normal(keys[2], (H,), jnp.float32).astype(jnp.bfloat16)
rope = jnp.ones((2, 128), jnp.float32)


def cache_of(slots, key):
    return jax.random.normal(key, (L, 2, 1, KV, slots, 128), jnp.float32).astype(jnp.bfloat16)


def step(pos, ranks=1):
    kw = dict(kv_heads=KV, group=G, eps=1e-5)
    if ranks == 1:
        return lambda c, ws: sifar_jax.llama_step(x, rope, pos, norm, ws[0], c, head=ws[1], **kw)
    return lambda c, ws: sifar_jax.llama_step_virtual_ranks(
        x, rope, pos, norm, ws[0], c, head=ws[1], ranks=ranks, allreduce="sifar", **kw)


def timed(f, cache):
    loop = jax.jit(lambda c, ws, n: jax.lax.fori_loop(0, n, lambda _, c: f(c, ws)[1], c),
                   static_argnums=2)
    c = jax.block_until_ready(loop(cache, weights, 2))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        c = jax.block_until_ready(loop(c, weights, N))
        ts.append((time.perf_counter() - t0) / N)
    return min(ts) * 1e3, float(np.median(ts)) * 1e3


pos, pos_long = jnp.array([POS, 0], jnp.int32), jnp.array([POS_LONG, 0], jnp.int32)
cache = cache_of(S, keys[3])
h, c1, logits = jax.jit(step(pos))(cache, weights)
np.savez(os.path.join(out, f"ab-{tag}.npz"), h=np.asarray(h, np.float32),
         slot=np.asarray(c1[:, :, :, :, POS], np.float32), logits=np.asarray(logits))
cases = [("tp1", step(pos), cache), ("tp1-long", step(pos_long), None),
         ("ranks2", step(pos, 2), cache), ("ranks4", step(pos, 4), cache)]
for name, f, c in cases:
    lo, med = timed(f, c if c is not None else cache_of(LONG, keys[4]))
    print(f"ab {tag} {name}: {lo:.3f} ms min, {med:.3f} median", flush=True)
print(f"ab_llama_step: all calls ran ({tag})")
PY
      grep --line-buffered -E "^ab|Error|error" | tee -a "$LOG"
  done
done
"$PY" - "$OUT" "${variants[@]//=/-}" <<'PY' 2>&1 | tee -a "$LOG"
import os, sys
import numpy as np
out, vs = sys.argv[1], sys.argv[2:]
d = {v: np.load(os.path.join(out, f"ab-{v}.npz")) for v in vs if os.path.exists(os.path.join(out, f"ab-{v}.npz"))}
base = vs[0]
for v in vs[1:]:
    if base in d and v in d:
        same = {k: bool(np.array_equal(d[base][k], d[v][k])) for k in d[v].files}
        print(f"bits {v} against {base}: {same}, finite {bool(np.isfinite(d[v]['logits']).all())}")
PY
log done
