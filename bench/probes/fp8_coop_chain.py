"""Probe driver: the FP8 GEMV chain as one cooperative custom call against sifar_jax.fp8_matvec's
chain (bench.gemv's), same weights; bits compared, times in one process."""
import ctypes, json, os, sys, time
import numpy as np
import jax, jax.numpy as jnp
sys.path.insert(0, os.getcwd())
from bench import gemv
from sifar_jax import fp8_matvec as f8

lib = ctypes.cdll.LoadLibrary(os.path.join(os.path.dirname(__file__), "libcoop.so"))
jax.ffi.register_ffi_target("probe_coop_chain", jax.ffi.pycapsule(lib.CoopChain), platform="CUDA")
out = {"command_buffers": os.environ.get("XLA_FLAGS", "default")}
for tp in (1, 2):
    key = jax.random.key(tp)
    ws = []
    for i in range(32):
        lw = []
        for j, (_, k, n) in enumerate(gemv.shapes(tp)):
            q = (jax.random.normal(jax.random.fold_in(key, 4 * i + j), (n, k), jnp.bfloat16) * 32).astype(jnp.float8_e4m3fn)
            lw.append((q, jax.random.uniform(jax.random.fold_in(key, 999 + 4 * i + j), (n, 1), jnp.float32, 0.5, 2) / (32 * k ** 0.5)))
        ws.append(lw)
    x = jax.random.normal(key, (1, 14336), jnp.bfloat16)
    proj = lambda h, w: f8.fp8_matvec(h, w[0], w[1], impl="kernel")
    ref_fn = jax.jit(lambda x, ws: gemv.chain(proj, ws, x, tp))
    ref = np.asarray(ref_fn(x, ws)).reshape(-1)
    wflat = jnp.concatenate([jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(-1) for lw in ws for q, _ in lw])
    sflat = jnp.concatenate([s.reshape(-1) for lw in ws for _, s in lw])
    jax.block_until_ready((wflat, sflat))
    nmax = 28672 // tp
    call = jax.ffi.ffi_call("probe_coop_chain", (jax.ShapeDtypeStruct((2 * nmax,), jnp.bfloat16),
                                                 jax.ShapeDtypeStruct((4096,), jnp.bfloat16)))
    coop_fn = jax.jit(lambda w, s, x: call(w, s, x[0, :4096], tp=np.int64(tp), layers=np.int64(32))[1])
    try:
        got = np.asarray(coop_fn(wflat, sflat, x))
        out[f"tp{tp}_bits_equal"] = bool((got.view(np.uint16) == ref.view(np.uint16)).all())
        out[f"tp{tp}_mismatches"] = int((got.view(np.uint16) != ref.view(np.uint16)).sum())
        out[f"tp{tp}_max_abs_diff"] = float(np.abs(got.astype(np.float32) - ref.astype(np.float32)).max())
        out[f"tp{tp}_finite"] = bool(np.isfinite(got.astype(np.float32)).all())
        for r in range(2):
            out[f"tp{tp}_coop_ms_{r}"] = gemv.timed(coop_fn, (wflat, sflat, x)) * 1e3
            out[f"tp{tp}_calls_ms_{r}"] = gemv.timed(ref_fn, (x, ws)) * 1e3
    except Exception as e:  # noqa: BLE001
        out[f"tp{tp}_error"] = repr(e)[:400]
    print(json.dumps(out), flush=True)
    del ws, wflat, sflat
