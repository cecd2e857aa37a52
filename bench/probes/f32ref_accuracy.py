"""Probe: is the persistent step's distance from the XLA step (the 8B-shapes slow test) its own
error, or two bf16 trajectories' errors added? Both bf16 steps against a float32 reference (the
XLA step with float32 activations on the same FP8 weights and the same bf16 cache values), at
Llama-3.1-8B shapes, random FP8 weights (seed 11), teacher-forced from random caches as the test.
  python f32ref_accuracy.py ref OUT          the XLA bf16 step and the float32 reference -> OUT
  python f32ref_accuracy.py variant TAG OUT  the persistent step of this module against both
"""
import os, sys, time
import numpy as np
import jax, jax.numpy as jnp
from models import Decoder, make_mesh
from models.families import FAMILIES
from models.options import DecodeOptions
from models.quant import is_fp8

LLAMA = FAMILIES["llama"]
STARTS = (0, 1000, 8191, 16370)
mode, out = sys.argv[1], sys.argv[-1]
t0 = time.time()
TINY = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=512,
            num_layers=2, vocab_size=512) if os.environ.get("PROBE_TINY") else {}
if TINY:
    STARTS = (0, 40)
cfg = LLAMA.preset("llama3_8b", max_seq_len=16384, **TINY)
mesh = make_mesh(1)
params = LLAMA.random_params(cfg, mesh, seed=11, quantize="fp8")


def run(dec, f32=False):
    rng, res = np.random.default_rng(0), {}
    for start in STARTS:
        seq = rng.integers(0, cfg.vocab_size, 8, dtype=np.int32)
        dec.reset(128 if TINY else 16384)
        dec.randomize_cache(start)
        if f32:  # the bf16 steps' cache values, exactly
            a = dec.seq.arrays["cache"]
            dec.seq.arrays["cache"] = jax.device_put(a.astype(jnp.bfloat16).astype(jnp.float32), a.sharding)
        dec.seek(start, seq[:1])
        res[start] = np.stack([np.asarray(dec.step(np.array([t])), np.float32)[0] for t in seq[1:]])
    return res


def err(a, ref):
    return float(np.abs(a - ref).max() / np.abs(ref).max())


opts = lambda step: DecodeOptions(kv_layout="bhsd", step=step)
if mode == "ref":
    xla = run(Decoder(cfg, mesh, params, opts("xla")))
    np.savez(os.path.join(out, "xla.npz"), **{str(s): v for s, v in xla.items()})
    cfg32 = LLAMA.preset("llama3_8b", max_seq_len=16384, dtype="float32", **TINY)
    p32 = jax.tree_util.tree_map(lambda a: a if is_fp8(a) else a.astype(jnp.float32), params,
                                 is_leaf=is_fp8)
    del params
    ref = run(Decoder(cfg32, mesh, p32, opts("xla")), f32=True)
    np.savez(os.path.join(out, "ref.npz"), **{str(s): v for s, v in ref.items()})
    for s in STARTS:
        print(f"f32ref xla-vs-ref start {s}: {err(xla[s], ref[s]):.3e}  (largest |ref| "
              f"{np.abs(ref[s]).max():.2f})", flush=True)
else:
    tag = sys.argv[2]
    p = run(Decoder(cfg, mesh, params, opts("persistent")))
    xla, ref = np.load(os.path.join(out, "xla.npz")), np.load(os.path.join(out, "ref.npz"))
    for s in STARTS:
        x, r = xla[str(s)], ref[str(s)]
        print(f"f32ref {tag} start {s}: vs xla {err(p[s], x):.3e}, vs ref {err(p[s], r):.3e} "
              f"(xla vs ref {err(x, r):.3e}); argmax equal to ref {(p[s].argmax(-1) == r.argmax(-1)).mean():.2f}",
              flush=True)
print(f"f32ref {mode} done in {time.time() - t0:.0f} s", flush=True)
