"""Probe (issue 41): the per-call cost of sifar_jax.row_parallel in a jit program with named
shardings against a bare sifar_psum inside one shard_map, the same chain of projections.
Run: python -m sifar_jax.launch -n 2 --share-gpu -- python bench/probe_rowpar_cost.py"""
import time
import numpy as np
import sifar_jax
from sifar_jax import distributed
distributed.initialize()
import jax, jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("tp",)); n = mesh.size
sifar_jax.init(mesh)
K, L, REPS = 4096, 64, 30
rng = np.random.default_rng(0)
w = jax.make_array_from_callback((K, K), NamedSharding(mesh, P("tp", None)),
                                 lambda i: (rng.standard_normal((K, K)) / 64).astype(jnp.bfloat16)[i])
x = jax.make_array_from_callback((1, K), NamedSharding(mesh, P(None, "tp")),
                                 lambda i: np.ones((1, K), jnp.bfloat16)[i])

@jax.jit
def helper(x, w):
    for _ in range(L):
        x = sifar_jax.row_parallel(x, w, mesh=mesh) * 0.5
    return x

def bare_body(xl, wl):
    r = jax.lax.axis_index("tp")
    for _ in range(L):
        y = sifar_jax.sifar_psum(xl @ wl, "tp") * 0.5
        xl = jax.lax.dynamic_slice_in_dim(y, r * (K // n), K // n, axis=1)
    return y
bare = jax.jit(jax.shard_map(bare_body, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P()))

def t(f):
    jax.block_until_ready(f(x, w))
    ts = []
    for _ in range(REPS):
        t0 = time.perf_counter(); jax.block_until_ready(f(x, w)); ts.append(time.perf_counter() - t0)
    return np.median(ts) / L * 1e6
a = np.asarray(helper(x, w).addressable_shards[0].data, np.float32)
b = np.asarray(bare(x, w).addressable_shards[0].data, np.float32)
print("same bits:", a.tobytes() == b.tobytes())
for rnd in range(3):
    print(f"round {rnd}: row_parallel {t(helper):.2f} us/call, bare sifar_psum {t(bare):.2f} us/call")
sifar_jax.check(); print("calls", sifar_jax.stats()["sifar"])
