#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck and synccheck on sifar_jax.fp8_matvec's CUDA kernels,
# small cases on one GPU: rows 1, 3, 8; a row tail; K of 9 chunks and 14336; K splits;
# per-tensor, per-channel and 128x128 scales; more row groups than blocks; an expert stack;
# the row kernel (one x row) at every lanes value, with two rows per thread (N 4100: 1-2 rounds
# of row groups per block), and a K too large for it to stage.
# Every buffer is its own allocation (XLA_PYTHON_CLIENT_ALLOCATOR=platform), so memcheck sees
# an access past any of them.
#   bash tools/sanitize_fp8_matvec.sh    (from any directory; sifar-jax installed, or built into src/)
set -uo pipefail
cd "$(dirname "$0")/.."
read -r -d '' CODE <<'PY'
import math
import jax, jax.numpy as jnp, numpy as np
from sifar_jax import fp8_matvec as f8
rng = np.random.default_rng(0)
def operands(m, k, n, e, dt, block):
    lead = () if e is None else (e,)
    x = jnp.asarray(rng.standard_normal((m, k)), dt)
    w = jnp.asarray(np.clip(rng.standard_normal(lead + (n, k)) * 100, -448, 448), jnp.float8_e4m3fn)
    s = jnp.asarray(rng.uniform(0.5, 2, lead + (math.ceil(n / block[0]), math.ceil(k / block[1]))),
                    jnp.float32)
    return x, w, s
cases = [(1, 144, 77, (77, 144), None), (3, 14336, 40, (128, 128), None),
         (8, 4096, 300, (1, 4096), (16, 2)), (1, 14336, 90, (128, 128), (8, 1)),
         (2, 144, 70, (1, 144), (4, 8)), (1, 256, 8 * 2 * 132 * 2 + 5, (1, 256), (32, 1)),
         (1, 1216, 37, (128, 128), (4, 8)), (1, 1200, 100, (1, 1200), (16, 2)),
         (1, 32768, 8, (1, 32768), None), (1, 1200, 4100, (128, 128), (16, 2))]
for dt in ("float32", "bfloat16"):
    for m, k, n, block, plan in cases:
        x, w, s = operands(m, k, n, None, dt, block)
        for pdl in (True, False):
            jax.block_until_ready(f8.fp8_matvec(x, w, s, block=block, impl="kernel", plan=plan,
                                                pdl=pdl, prefetch=pdl))
    x, w, s = operands(3, 768, 64, 4, dt, (1, 768))
    jax.block_until_ready(f8.fp8_matvec(x, w, s, jnp.asarray([0, 3, 9], jnp.int32), block=(1, 768),
                                        impl="kernel"))
print("sanitize_fp8_matvec: all calls ran")
PY
source tools/sanitize_run.sh
sanitize_python "$CODE"
