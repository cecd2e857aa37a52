"""Development check on a GPU host: correctness of every algorithm, then a
first latency read at both levels.  `python -m bench.gpu_smoke` (not a test).
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import sifar_jax

ALGS = ["oneshot", "twoshot", "oneshot_db", "sifar_flag", "sifar"]


def f64_ref(x):
    return np.asarray(x.astype(jnp.float32)).astype(np.float64).sum(0)


def run_correctness(mesh, n):
    bad = 0
    for alg in ALGS:
        for dt in (jnp.float32, jnp.bfloat16, jnp.float16):
            for elems in (1, 7, 8, 1000, 4096, 16384 // jnp.dtype(dt).itemsize * 2):
                x = jax.random.normal(jax.random.key(elems), (n, elems), dt) + 3
                fn = jax.jit(jax.shard_map(lambda v: sifar_jax.sifar_psum(v, "tp", algorithm=alg),
                                           mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
                ps = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "tp"),
                                           mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
                y = np.asarray(fn(x).astype(jnp.float32))
                yp = np.asarray(ps(x).astype(jnp.float32))
                ref = f64_ref(x)
                tol = 1e-5 if dt == jnp.float32 else 1e-2
                same = all((y[i] == y[0]).all() for i in range(n))
                err = np.abs(y - ref).max() / (np.abs(ref).max())
                errp = np.abs(y - yp).max() / (np.abs(ref).max())
                ok = same and err < tol and np.isfinite(y).all()
                bad += not ok
                if not ok:
                    print(f"FAIL {alg} {jnp.dtype(dt).name} {elems}: identical={same} err={err:.2e} vs_psum={errp:.2e}", flush=True)
    print(f"correctness: {'ALL OK' if bad == 0 else f'{bad} FAILURES'}", flush=True)
    return bad


def timeit(fn, x, iters=50):
    fn(x).block_until_ready()
    fn(x).block_until_ready()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(x).block_until_ready()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def latency(mesh, n, nbytes, alg, level, r_small=10, r_big=1000):
    x = jax.random.normal(jax.random.key(1), (n, nbytes // 2), jnp.bfloat16)
    def make(r):
        if level == "kernel":
            body = lambda v: sifar_jax.sifar_psum(v, "tp", algorithm=alg, _repeat=r)
        else:
            def body(v):
                for _ in range(r):
                    v = jax.lax.psum(v, "tp") if alg == "lax.psum" else sifar_jax.sifar_psum(v, "tp", algorithm=alg)
                return v
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    if level == "jit":
        r_big = 200
    t1, t2 = timeit(make(r_small), x), timeit(make(r_big), x)
    return (t2 - t1) / (r_big - r_small) * 1e6


def main():
    print("jax", jax.__version__, jax.devices(), flush=True)
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    n = 2
    mesh = Mesh(np.array(gpus[:n]), ("tp",))
    sifar_jax.init(mesh)
    if "--skip-correctness" not in sys.argv:
        run_correctness(mesh, n)
    print(sifar_jax.stats(), flush=True)
    rows = []
    for nbytes in (8192, 32768):
        for level in ("kernel", "jit"):
            for alg in ALGS + (["lax.psum"] if level == "jit" else []):
                us = latency(mesh, n, nbytes, alg, level)
                rows.append(dict(alg=alg, level=level, bytes=nbytes, us=us))
                print(f"{level:6s} {nbytes:6d} {alg:11s} {us:8.2f} us", flush=True)
    sifar_jax.check()
    # Skew: force mis-speculation, every result must stay exact.
    x = jax.random.normal(jax.random.key(2), (n, 4096), jnp.bfloat16)
    def make_chain(alg):
        def body(v):
            for _ in range(100):  # data-dependent, so XLA cannot merge them
                v = sifar_jax.sifar_psum(v, "tp", algorithm=alg) * 0.5
            return v
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    chain = make_chain("sifar")
    ref = np.asarray(make_chain("oneshot")(x))
    before = sifar_jax.stats()["sifar"]["retries"]
    mism = 0
    with sifar_jax.testing.inject_skew(20):
        for _ in range(100):
            mism += int((np.asarray(chain(x)) != ref).sum())
    print("skew: mismatches", mism, "retries", sifar_jax.stats()["sifar"]["retries"] - before, flush=True)
    # A rank that never arrives: bounded timeout, clear error, no hang.
    t = time.time()
    with sifar_jax.testing.timeout(0.5), sifar_jax.testing.drop_rank("tp", 1):
        y = np.asarray(chain(x).astype(jnp.float32))
    try:
        sifar_jax.check()
        print("drop: check() did NOT raise", flush=True)
    except sifar_jax.SifarError as e:
        print(f"drop: {time.time() - t:.2f}s nan={np.isnan(y[0]).all()} error: {e}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "smoke.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
