"""Probe: fp32 summation orders of the persistent step's attention scores (old: 4-term lane
partials + 5-step butterfly; new: one lane's sequential 128-term FMA chain) against float64,
and how often the bf16-rounded attention outputs differ between them. One head group, G=4."""
import numpy as np
import ml_dtypes
rng = np.random.default_rng(0)
bf = ml_dtypes.bfloat16
D, G = 128, 4
def rb(x): return x.astype(bf).astype(np.float32)
res = {}
for n in (64, 1000, 16000):
    q = rb(rng.standard_normal((G, D)).astype(np.float32))
    k = rb(rng.standard_normal((n, D)).astype(np.float32))
    v = rb(rng.standard_normal((n, D)).astype(np.float32))
    scale = np.float32(1 / np.sqrt(D))
    # old: lane l holds dims 4l..4l+3, partial = fma chain of 4, then butterfly xor 16,8,4,2,1
    part = np.zeros((G, n, 32), np.float32)
    for t in range(4):
        part = (part + q[:, None, t::4][:, :, :32] * k[None, :, t::4][:, :, :32]).astype(np.float32)
    # dims of lane l are 4l+t: rebuild with the right layout
    qq = q.reshape(G, 32, 4); kk = k.reshape(n, 32, 4)
    part = np.zeros((G, n, 32), np.float32)
    for t in range(4):
        part = (part + qq[None, :, :, t].transpose(1, 0, 2) * kk[None, :, :, t]).astype(np.float32)
    for off in (16, 8, 4, 2, 1):
        part = (part + part[:, :, np.arange(32) ^ off]).astype(np.float32)
    s_old = (part[:, :, 0] * scale).astype(np.float32)
    s_new = np.zeros((G, n), np.float32)
    for d in range(D):
        s_new = (s_new + q[:, d:d + 1] * k[None, :, d]).astype(np.float32)
    s_new = (s_new * scale).astype(np.float32)
    s64 = (q.astype(np.float64) @ k.T.astype(np.float64)) * (1 / np.sqrt(D))
    out = {}
    for name, s in (("old", s_old), ("new", s_new), ("f64", s64)):
        s = s.astype(np.float64 if name == "f64" else np.float32)
        m = s.max(1, keepdims=True); e = np.exp(s - m)
        o = (e @ v.astype(e.dtype)) / e.sum(1, keepdims=True)
        out[name] = o
    err = {k_: float(np.abs(out[k_] - out["f64"]).max() / np.abs(out["f64"]).max()) for k_ in ("old", "new")}
    serr = {"old": float(np.abs(s_old - s64).max()), "new": float(np.abs(s_new - s64).max())}
    flips = float((rb(out["old"].astype(np.float32)) != rb(out["new"].astype(np.float32))).mean())
    print(f"keys {n}: score err vs f64 old {serr['old']:.2e} new {serr['new']:.2e}; output rel err old {err['old']:.2e} new {err['new']:.2e}; bf16 outputs differing {flips:.4f}")
