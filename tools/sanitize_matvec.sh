#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck and synccheck on sifar_jax.matvec's CUDA kernels
# (every lanes width, split and unsplit K, a column tail, clipped ids, the MoE experts' two
# calls), small cases on one GPU. Every buffer is its own allocation
# (XLA_PYTHON_CLIENT_ALLOCATOR=platform), so memcheck sees an access past any of them.
#   bash tools/sanitize_matvec.sh        (from any directory; sifar-jax installed, or built into src/)
set -uo pipefail
cd "$(dirname "$0")/.."
read -r -d '' CODE <<'PY'
import jax, jax.numpy as jnp, numpy as np
from sifar_jax import matvec as mv
from models.qwen3_moe import model as qwen3_moe
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
print("sanitize_matvec: all calls ran")
PY
source tools/sanitize_run.sh
sanitize_python "$CODE"
