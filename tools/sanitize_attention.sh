#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck and synccheck on the decode attention's Pallas kernels
# (models/core/pallas_attention.py: the splits' kernel and their merge; the XLA merge where the
# splits are not a power of two), small cases on one GPU: float32 and bfloat16, groups of 1, 4 and 8
# query heads, rows starting past slot 0, a bucket smaller than the cache, the last layer of the
# cache array. Every buffer is its
# own allocation (XLA_PYTHON_CLIENT_ALLOCATOR=platform), so memcheck sees an access past any.
#   bash tools/sanitize_attention.sh     (from the repository root; no build needed)
set -uo pipefail
cd "$(dirname "$0")/.."
read -r -d '' CODE <<'PY'
import jax, jax.numpy as jnp, numpy as np
from models.core.pallas_attention import decode_attention
rng = np.random.default_rng(0)
for dt in (jnp.float32, jnp.bfloat16):
    for b, kv, g, cap, n, pos in ((1, 2, 4, 256, 256, 255), (2, 1, 8, 512, 512, 300),
                                  (1, 2, 1, 1024, 128, 70), (1, 1, 4, 384, 384, 200)):
        q = jnp.asarray(rng.standard_normal((b, kv, g, 64)), dt)
        # the keys and values in the last of 3 layers of the cache array: an access past
        # them is past the buffer's end, where memcheck sees it
        cache = jnp.asarray(rng.standard_normal((3, 2, b, kv, cap, 64)), dt)
        start = jnp.asarray(np.arange(b) * 5, jnp.int32)
        out = decode_attention(q, cache, 2, jnp.int32(pos), start, n)
        assert out is not None and bool(jnp.isfinite(out).all())
print("sanitize_attention: all calls ran")
PY
source tools/sanitize_run.sh
sanitize_python "$CODE"
