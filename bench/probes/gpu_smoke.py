"""Development check on a GPU host: correctness of every algorithm, then a
first latency read at both levels.  `python -m bench.probes.gpu_smoke` (not a test).
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

ALGS = ["oneshot", "twoshot", "oneshot_db", "sifar_flag", "sifar", "sifar_push"]


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


def sweep_poll(mesh, n):
    """sifar's polling depth and gap are runtime knobs: time each setting."""
    from sifar_jax import _ext
    comm = sifar_jax.communicators("tp")[0]
    for nbytes in (8192, 32768):
        x = jax.random.normal(jax.random.key(1), (n, nbytes // 2), jnp.bfloat16)
        fns = {}
        for alg in ("sifar", "sifar_push"):
            for level, (r1, r2) in (("kernel", (10, 2000)), ("jit", (10, 200))):
                for r in (r1, r2):
                    if level == "kernel":
                        body = lambda v, r=r, alg=alg: sifar_jax.benchmarking.psum_repeated(v, "tp", r, algorithm=alg)
                    else:
                        def body(v, r=r, alg=alg):
                            for _ in range(r):
                                v = sifar_jax.sifar_psum(v, "tp", algorithm=alg)
                            return v
                    fns[alg, level, r] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
        for alg, depth, gap in (("sifar", 1, 0), ("sifar", 2, 300), ("sifar", 4, 100), ("sifar", 4, 50),
                                ("sifar_push", 1, 0), ("sifar_push", 2, 100)):
            _ext.lib.set_poll(comm.comm_id, depth, gap)
            out = []
            for level, (r1, r2) in (("kernel", (10, 2000)), ("jit", (10, 200))):
                before = sifar_jax.stats()[alg]
                t1, t2 = timeit(fns[alg, level, r1], x, 30), timeit(fns[alg, level, r2], x, 30)
                after = sifar_jax.stats()[alg]
                rate = (after["retries"] - before["retries"]) / max(1, after["calls"] - before["calls"])
                out.append(f"{level} {(t2 - t1) / (r2 - r1) * 1e6:6.2f} us (retries/call {rate:.2f})")
            print(f"{alg:10s} depth={depth} gap={gap:4d} bytes={nbytes}: " + " | ".join(out), flush=True)
    _ext.lib.set_poll(comm.comm_id, 1, 0)


def latency(mesh, n, nbytes, alg, level, r_small=10, r_big=1000):
    x = jax.random.normal(jax.random.key(1), (n, nbytes // 2), jnp.bfloat16)
    def make(r):
        if level == "kernel":
            body = lambda v: sifar_jax.benchmarking.psum_repeated(v, "tp", r, algorithm=alg)
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
    gpus = [d for d in jax.devices() if d.platform == "gpu"] or jax.devices("cpu")
    n = 2
    mesh = Mesh(np.array(gpus[:n]), ("tp",))
    sifar_jax.init(mesh)
    if "--skip-correctness" not in sys.argv:
        run_correctness(mesh, n)
    print(sifar_jax.stats(), flush=True)
    sweep_poll(mesh, n)
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
    y = np.full((n, 4096), np.nan)
    with sifar_jax.testing.timeout(0.5), sifar_jax.testing.drop_rank("tp", 1):
        try:  # the CPU backend raises here; GPUs return NaN and check() raises
            y = np.asarray(chain(x).astype(jnp.float32))
        except Exception as e:  # noqa: BLE001
            print("drop: the call raised:", str(e)[:200], flush=True)
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
