#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck and synccheck on our single-GPU CUDA kernels, small
# cases on one GPU: sifar_jax.matvec (every lanes width, split and unsplit K, a column tail,
# clipped ids, the MoE experts' two calls) and sifar_jax.decode_attention (both cache layouts,
# one and several chunks, chunks longer than a block step, GQA groups 1-8, per-sequence start
# slots, pos past the bucket). Every buffer is its own allocation
# (XLA_PYTHON_CLIENT_ALLOCATOR=platform), so memcheck sees an access past any of them.
#   bash bench/probes/sanitize_kernels.sh [matvec] [attention]   (default: both; from the
#   repository root, sifar-jax installed)
set -uo pipefail
export XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS="--xla_gpu_enable_command_buffer="
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
read -r -d '' MATVEC <<'PY'
import jax, jax.numpy as jnp, numpy as np
from sifar_jax import matvec as mv
from models import qwen3_moe
rng = np.random.default_rng(0)
for dt in ("float32", "bfloat16"):
    x = jnp.asarray(rng.standard_normal((3, 130)), dt)
    w = jnp.asarray(rng.standard_normal((4, 130, 264)), dt)
    ids = jnp.asarray([0, 3, 9], jnp.int32)  # 9: clipped to 3
    for plan in ((32, 1), (64, 3), (128, 5), (256, 2)):
        jax.block_until_ready(mv.matvec(x, w, ids, impl="kernel", plan=plan))
    xs = jnp.asarray(rng.standard_normal((2, 64)), dt)
    wts = jnp.asarray(rng.random((2, 3)), dt)
    e_ids = jnp.asarray([[0, 4, 5], [2, 2, 1]], jnp.int32)
    gate_up = jnp.asarray(rng.standard_normal((6, 64, 2, 24)), dt)
    down = jnp.asarray(rng.standard_normal((6, 24, 64)), dt)
    jax.block_until_ready(qwen3_moe.experts_matvec(xs, wts, e_ids, gate_up, down))
print("sanitize matvec: all calls ran")
PY
read -r -d '' ATTENTION <<'PY'
import jax, jax.numpy as jnp, numpy as np
from sifar_jax import attention as att
rng = np.random.default_rng(0)
# (B, KV, G, D, S, length, pos, splits, start)
cases = [(1, 2, 4, 128, 300, 256, 200, 4, None), (2, 2, 8, 64, 96, 96, 95, 1, [0, 40]),
         (2, 1, 3, 128, 1200, 1100, 1050, 3, [5, 0]), (1, 2, 1, 32, 64, 32, 50, 2, None)]
for dt in ("float32", "bfloat16"):
    for layout in ("bhsd", "bshd"):
        for b, kv, g, d, s, n, pos, splits, start in cases:
            qkv = jnp.asarray(rng.standard_normal((b, kv, g + 2, d)), dt)
            shape = (b, kv, s, d) if layout == "bhsd" else (b, s, kv, d)
            kc, vc = (jnp.asarray(rng.standard_normal(shape), dt) for _ in range(2))
            cos, sin = jnp.cos(jnp.arange(d) / d), jnp.sin(jnp.arange(d) / d)
            st = None if start is None else jnp.asarray(start, jnp.int32)
            jax.block_until_ready(att.decode_attention(qkv, kc, vc, pos, cos, sin, length=n,
                                  start=st, layout=layout, impl="kernel", splits=splits))
print("sanitize attention: all calls ran")
PY
ops=("$@")
[ ${#ops[@]} -gt 0 ] || ops=(matvec attention)
fail=0
for op in "${ops[@]}"; do
  case "$op" in
    matvec) CODE="$MATVEC" ;;
    attention) CODE="$ATTENTION" ;;
    *) echo "unknown op $op (matvec, attention)"; exit 2 ;;
  esac
  for tool in memcheck racecheck synccheck; do
    echo "=== $op: compute-sanitizer --tool $tool"
    compute-sanitizer --tool "$tool" --error-exitcode 7 python3 -c "$CODE" 2>&1 \
      | grep -v "^[WIE][0-9]\{4\}" | tail -4
    rc=${PIPESTATUS[0]}
    echo "$op $tool exit status $rc"
    [ "$rc" -eq 0 ] || fail=1
  done
done
exit $fail
