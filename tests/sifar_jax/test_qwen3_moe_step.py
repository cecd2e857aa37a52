"""sifar_jax.qwen3_moe_step (its CPU reference, ffi/step/qwen3_moe_step.cc) against a float64
numpy reference of the same step, with FP8 and bf16 weights and every kind of expert scale;
its top-k tie rule against jax.lax.top_k's; its checks and workspace size.

The numpy reference rounds to bf16 where the XLA decoder does (each projection's output, the
norms, the roped q and k, the attention output, the SwiGLU product, the router logits and
weights, the MoE sum, the residual stream) and computes everything else in float64; the op sums
in float32 in its kernels' orders. Measured (2026-12-07, these seeds, FP8 and bf16): h equal to
the reference's, logits within 1e-7 of the largest logit (the bf16 roundings absorb the float32
sums' differences); bound 1e-2 of the largest value (BOUND; skipping the q/k norms in the
reference gives 0.13). The chosen experts are the reference's; the test refuses a seed where the
reference's k-th and (k+1)-th probabilities are within bf16 rounding of each other (then the two
may rightly choose differently).

The cache's slots outside [start, pos] hold NaN: a read of one spreads to h.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import sifar_jax
from sifar_jax import moe_step
from sifar_jax.decode_step import HEAD_DIM

H, KV, G, I, E, K, L, S = 256, 2, 2, 128, 8, 2, 2, 16
POS, START = 6, 1
EPS = 1e-6
BOUND = 1e-2
D = HEAD_DIM
E4M3 = jnp.float8_e4m3fn


def rb(a):
    """Rounded to bf16, as float64."""
    return np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def _weights(rng, n, k, wdt, scale_kind, stack=0):
    """(weight [*(E,) n, k] of wdt, float32 scale, dense float64 [*(E,) n, k] = weight x scale)."""
    shape = ((stack,) if stack else ()) + (n, k)
    w = rng.uniform(-1, 1, shape) * (k ** -0.5)
    if wdt == "bf16":
        q = jnp.asarray(w, jnp.bfloat16)
        return q, jnp.ones((1,), jnp.float32), np.asarray(q, np.float64)
    count = {"tensor": 1, "expert": stack, "channel": (stack or 1) * n}[scale_kind]
    sc = rng.uniform(0.5, 1.5, count).astype(np.float32) * np.float32(8 / 448 / k ** 0.5)
    rows = shape[:-1] + (1,)  # one scale per row
    full = np.broadcast_to(sc.reshape((stack, 1, 1) if scale_kind == "expert" else
                                      rows if scale_kind == "channel" else (1,) * len(rows)),
                           rows).astype(np.float64)
    q = jnp.asarray(np.clip(w / full, -448, 448), E4M3)
    return q, jnp.asarray(sc), np.asarray(q, np.float64) * full


def _model(seed, wdt="fp8", scale_kind="channel", head=True, **dims):
    """(operands, head, dense float64 copies, dense head) of a random model; dims override the
    module's H, KV, G, I, E, L, S, POS, START."""
    d = {**dict(H=H, KV=KV, G=G, I=I, E=E, L=L, S=S, POS=POS, START=START), **dims}
    h_, kv, g, inter, e, n, s, pos, start = (d[k] for k in ("H", "KV", "G", "I", "E", "L", "S",
                                                            "POS", "START"))
    rng = np.random.default_rng(seed)
    nb = lambda n: jnp.asarray(rng.uniform(0.5, 1.5, n), jnp.bfloat16)  # noqa: E731
    layers, dense = [], []
    for _ in range(n):
        qkv, qkv_s, qkv_d = _weights(rng, kv * (g + 2) * D, h_, wdt, "channel")
        o, o_s, o_d = _weights(rng, h_, kv * g * D, wdt, "tensor")
        gu, gu_s, gu_d = _weights(rng, 2 * inter, h_, wdt, scale_kind, e)
        dn, dn_s, dn_d = _weights(rng, h_, inter, wdt, scale_kind, e)
        router = jnp.asarray(rng.normal(0, 2 * h_ ** -0.5, (e, h_)), jnp.bfloat16)
        layer = moe_step.Qwen3MoeLayer(nb(h_), qkv, qkv_s, nb(D), nb(D), o, o_s, nb(h_), router,
                                       gu, gu_s, dn, dn_s)
        layers.append(layer)
        dense.append(dict(qkv=qkv_d, o=o_d, gu=gu_d, dn=dn_d))
    angle = rng.uniform(0, 3, D // 2)
    angle = np.concatenate([angle, angle])
    rope = jnp.asarray(np.stack([np.cos(angle), np.sin(angle)]), jnp.float32)
    cache = rng.normal(0, 1, (n, 2, 1, kv, s, D))
    cache[..., :start, :] = np.nan
    cache[..., pos:, :] = np.nan
    x = jnp.asarray(rng.normal(0, 1, h_), jnp.bfloat16)
    hd = dense_head = None
    if head:
        hw, hs, dense_head = _weights(rng, 64, h_, wdt, "channel")
        hd = (hw, hs)
    ops = (x, rope, jnp.asarray([pos, start], jnp.int32), nb(h_), layers,
           jnp.asarray(cache, jnp.bfloat16))
    return ops, hd, dense, dense_head


def _norm(v, w):
    v = np.asarray(v, np.float64)
    inv = 1 / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + EPS)
    return rb(rb(v * inv) * np.asarray(w, np.float64))


def _rope(v, rope):
    c, s = np.asarray(rope, np.float64)
    rot = np.concatenate([-v[..., D // 2:], v[..., :D // 2]], axis=-1)
    return rb(v * c + rot * s)


def _select(logits):
    p = np.exp(logits - logits.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    ids = order[:K]
    w = p[ids] / p[ids].sum()
    tie = abs(p[order[K - 1]] - p[order[K]]) <= 2 ** -8 * p[order[K - 1]]
    return ids, rb(w), tie


def _ranks_sum(parts):
    """sifar's rule on per-rank partials [R, H] (each already a bf16 value): the rank-order sum,
    rounded to bf16 (in float64 here)."""
    return rb(np.sum(parts, axis=0))


def reference(ops, dense, head, ranks=1):
    """h [H], logits [V] (or None), new cache, ids [L, K], near-ties [L] in float64; ranks: a
    TP=ranks model's per-rank partials of o and the MoE block, summed by sifar's rule."""
    x, rope, pos, fnorm, layers, cache = ops
    kv = cache.shape[3]  # the model's shapes, from its operands
    g = layers[0].qkv.shape[0] // (kv * D) - 2
    inter = layers[0].gate_up.shape[1] // 2
    slot, start = (int(v) for v in np.asarray(pos))
    cache = np.asarray(cache, np.float64).copy()
    r = np.asarray(x, np.float64)
    ids_all, ties = [], []
    for li, (lay, dn) in enumerate(zip(layers, dense)):
        qkv = rb(dn["qkv"] @ _norm(r, lay.input_norm)).reshape(kv, g + 2, D)
        q = _rope(_norm(qkv[:, :g], lay.q_norm), rope)
        k = _rope(_norm(qkv[:, g], lay.k_norm), rope)
        cache[li, 0, 0, :, slot] = k
        cache[li, 1, 0, :, slot] = rb(qkv[:, g + 1])
        ks, vs = cache[li, 0, 0, :, start:slot + 1], cache[li, 1, 0, :, start:slot + 1]
        sc = np.einsum("kgd,ksd->kgs", q, ks) / np.sqrt(D)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        att = rb(np.einsum("kgs,ksd->kgd", p, vs)).reshape(-1)
        q_r = att.size // ranks
        r = rb(r + _ranks_sum([rb(dn["o"][:, j * q_r:(j + 1) * q_r] @ att[j * q_r:(j + 1) * q_r])
                               for j in range(ranks)]))
        xm = _norm(r, lay.post_norm)
        logits = rb(np.asarray(lay.router, np.float64) @ xm)
        ids, w, tie = _select(logits)
        i_r = inter // ranks
        moe = np.zeros((ranks, r.size))
        for e, we in zip(ids, w):
            gu = rb(dn["gu"][e] @ xm)
            gt, u = gu[:inter], gu[inter:]
            act = rb(gt / (1 + np.exp(-gt)) * u)
            for j in range(ranks):
                cols = slice(j * i_r, (j + 1) * i_r)
                moe[j] += rb(dn["dn"][e][:, cols] @ act[cols]) * we
        r = rb(r + _ranks_sum(rb(moe)))
        ids_all.append(ids)
        ties.append(tie)
    h = _norm(r, fnorm)
    return h, (None if head is None else head @ h), cache, np.array(ids_all), np.array(ties)


def _run(ops, head):
    x, rope, pos, fnorm, layers, cache = ops
    return sifar_jax.qwen3_moe_step(x, rope, pos, fnorm, layers, cache, kv_heads=KV, group=G,
                                    top_k=K, norm_topk_prob=True, eps=EPS, head=head,
                                    routing=True)


@pytest.mark.parametrize("wdt,scale_kind,seed", [
    ("fp8", "channel", 0), ("fp8", "expert", 1), ("fp8", "tensor", 2), ("bf16", "tensor", 3)])
def test_matches_float64_reference(wdt, scale_kind, seed):
    ops, hw, dense, dense_head = _model(seed, wdt, scale_kind)
    h, cache, logits, ids, weights = _run(ops, hw)
    want_h, want_logits, want_cache, want_ids, ties = reference(ops, dense, dense_head)
    assert not ties.any(), "a near-tie in the router at this seed: pick another"
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1, atol=2 ** -7)
    h = np.asarray(h, np.float64)
    assert np.isfinite(h).all()
    err = np.abs(h - want_h).max() / np.abs(want_h).max()
    assert err <= BOUND, err
    lg = np.asarray(logits, np.float64)
    assert np.abs(lg - want_logits).max() <= BOUND * np.abs(want_logits).max()
    got_cache = np.asarray(cache, np.float64)
    # the slot written is the reference's; every other slot (NaN poison included) as it was
    written = got_cache[..., POS, :]
    assert np.abs(written - want_cache[..., POS, :]).max() <= BOUND * np.abs(want_cache[..., POS, :]).max()
    keep = np.ones(S, bool)
    keep[POS] = False
    np.testing.assert_array_equal(got_cache[..., keep, :], np.asarray(ops[5], np.float64)[..., keep, :])


def test_without_head_and_ids_are_in_range():
    ops, _, dense, _ = _model(4, head=False)
    h, cache, ids, weights = _run(ops, None)
    assert ids.shape == (L, K) and weights.shape == (L, K)
    assert ((0 <= np.asarray(ids)) & (np.asarray(ids) < E)).all()
    want_h = reference(ops, dense, None)[0]
    assert np.abs(np.asarray(h, np.float64) - want_h).max() <= BOUND * np.abs(want_h).max()


def _with_router(ops, make):
    layers = [lay._replace(router=jnp.asarray(make(np.asarray(lay.router, np.float32)),
                                              jnp.bfloat16)) for lay in ops[4]]
    return (*ops[:4], layers, ops[5])


def test_ties_go_to_the_lower_expert_as_lax_top_k():
    """Experts with the same router row have the same probability: the lower index takes the
    earlier slot, as jax.lax.top_k orders equal values."""
    ops, _, _, _ = _model(5, head=False)
    same = _with_router(ops, lambda r: np.broadcast_to(r[0], r.shape))  # all E tie
    _, _, ids, weights = _run(same, None)
    np.testing.assert_array_equal(np.asarray(ids), [[0, 1]] * L)
    np.testing.assert_array_equal(np.asarray(weights), 0.5)
    # experts 3 and 6 the same row, every other expert its negation: {3, 6} or {0, 1, 2, 4,
    # 5, 7} tie on top, whichever side x . row is on
    pair = _with_router(ops, lambda r: np.where(np.isin(np.arange(E), [3, 6])[:, None], r[0], -r[0]))
    _, _, ids, weights = _run(pair, None)
    for row in np.asarray(ids).tolist():
        assert row in ([3, 6], [0, 1]), row
    np.testing.assert_array_equal(np.asarray(weights), 0.5)
    for top in (np.isin(np.arange(E), [3, 6]), ~np.isin(np.arange(E), [3, 6])):
        _, lax_ids = jax.lax.top_k(jnp.asarray(np.where(top, 0.4, 0.1)), K)
        assert np.asarray(lax_ids).tolist() in ([3, 6], [0, 1])


def test_workspace_and_checks():
    ops, _, _, _ = _model(6, head=False)
    want = moe_step.workspace_bytes(H, KV, G, I, L, E, K)
    base = sifar_jax.decode_step.workspace_bytes(H, KV, G, K * I, L)
    assert want == base + 256 + 256 + 4 * K * H  # logits [E], sel [2][L][K], y [K][H]
    with pytest.raises(ValueError, match="top_k"):
        _run_k(ops, E + 1)
    bad = list(ops[4])
    bad[1] = bad[1]._replace(router=bad[1].router[:, :H // 2])
    with pytest.raises(ValueError, match="layer 1 router"):
        _run((*ops[:4], bad, ops[5]), None)


def _run_k(ops, top_k):
    x, rope, pos, fnorm, layers, cache = ops
    return sifar_jax.qwen3_moe_step(x, rope, pos, fnorm, layers, cache, kv_heads=KV, group=G,
                                    top_k=top_k, norm_topk_prob=True, eps=EPS)


@pytest.mark.skipif(not any(d.platform == "gpu" for d in jax.devices()), reason="needs a GPU")
@pytest.mark.parametrize("wdt", ["fp8", "bf16"])
def test_gpu_kernel_against_cpu_reference(wdt):
    """The CUDA kernel against the CPU reference on the same operands (written 2026-12-07, not
    yet run: no GPU where it was written). Shapes that give the ring whole slabs (H 2048), a
    partial one (I 384), more experts than lanes (E 64) and top-8. Layer 0's new key and value
    are norms, a GEMV, the q/k norm and the RoPE: bit for bit. The chosen experts are the CPU's
    (expf may differ from the C library's by an ulp: only a near-tie could flip one, which a
    failure here would have to be checked for); h and the logits within 1e-2 of their largest;
    layer 0's expert weights bit for bit, later layers' within 5% of each weight: their router
    logits come from a residual stream the two sum in different orders, so one bf16 rounding of
    a logit can differ, and the softmax carries it (one H100, 2026-12-07, bf16 weights: layer 1's
    weights 4 of 8 apart, by up to 2%; FP8: equal)."""
    dims = dict(H=2048, KV=2, G=4, I=384, E=64, L=2, S=300, POS=257, START=3)
    ops, hw, _, _ = _model(7, wdt, "channel", **dims)
    out = {}
    for dev in (jax.devices("gpu")[0], jax.devices("cpu")[0]):
        x, rope, pos, fnorm, layers, cache, hd = jax.device_put((*ops, hw), dev)
        res = sifar_jax.qwen3_moe_step(x, rope, pos, fnorm, layers, cache, kv_heads=2, group=4,
                                       top_k=8, norm_topk_prob=True, eps=EPS, head=hd,
                                       routing=True)
        out[dev.platform] = [np.asarray(a) for a in res]
    (h_g, c_g, lg_g, ids_g, w_g), (h_c, c_c, lg_c, ids_c, w_c) = out["gpu"], out["cpu"]
    np.testing.assert_array_equal(c_g[0, :, :, :, 257].view(np.uint16),
                                  c_c[0, :, :, :, 257].view(np.uint16))
    # a difference here is a bug unless the two experts' probabilities are within an ulp or two
    np.testing.assert_array_equal(ids_g, ids_c)
    h_g, h_c = h_g.astype(np.float32), h_c.astype(np.float32)
    assert np.isfinite(h_c).all()
    assert np.abs(h_g - h_c).max() <= 1e-2 * np.abs(h_c).max()
    assert np.abs(lg_g - lg_c).max() <= 1e-2 * np.abs(lg_c).max()
    np.testing.assert_array_equal(w_g[0], w_c[0])
    assert (np.abs(w_g - w_c) <= 0.05 * np.abs(w_c)).all()


@pytest.mark.parametrize("ranks", [2, 4])
def test_virtual_ranks_match_float64_reference(ranks):
    """A TP=R model's step (the CPU reference's rank-order sums) against the float64 reference
    with per-rank partials (4 KV heads, so that 4 ranks split them); layer 0's new key and value
    are TP=1's bit for bit. Measured (2026-12-07): h equal to the R-rank reference's at R = 2
    and 4, and different from the TP=1 reference's in about half its values (by up to 0.03):
    the test tells the rank-order sums from TP=1's."""
    ops, hw, dense, dense_head = _model(8, KV=4)
    x, rope, pos, fnorm, layers, cache = ops
    h, cache_r, logits, ids, _ = sifar_jax.qwen3_moe_step_virtual_ranks(
        x, rope, pos, fnorm, layers, cache, kv_heads=4, group=G, top_k=K, norm_topk_prob=True,
        eps=EPS, ranks=ranks, head=hw, routing=True)
    want_h, want_logits, _, want_ids, ties = reference(ops, dense, dense_head, ranks)
    assert not ties.any()
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    h = np.asarray(h, np.float64)
    assert np.abs(h - want_h).max() <= BOUND * np.abs(want_h).max()
    x, rope, pos, fnorm, layers, cache = ops
    cache_1 = sifar_jax.qwen3_moe_step(x, rope, pos, fnorm, layers, cache, kv_heads=4, group=G,
                                       top_k=K, norm_topk_prob=True, eps=EPS)[1]
    np.testing.assert_array_equal(np.asarray(cache_r)[0, :, :, :, POS],
                                  np.asarray(cache_1)[0, :, :, :, POS])


def test_virtual_ranks_checks():
    ops, _, _, _ = _model(9, head=False)
    x, rope, pos, fnorm, layers, cache = ops
    kw = dict(kv_heads=KV, group=G, top_k=K, norm_topk_prob=True, eps=EPS)
    with pytest.raises(ValueError, match="ranks must be"):
        sifar_jax.qwen3_moe_step_virtual_ranks(x, rope, pos, fnorm, layers, cache, ranks=3, **kw)
    assert moe_step.workspace_bytes(H, KV, G, I, L, E, K, 2) > moe_step.workspace_bytes(
        H, KV, G, I, L, E, K)


@pytest.mark.skipif(not any(d.platform == "gpu" for d in jax.devices()), reason="needs a GPU")
@pytest.mark.parametrize("ranks", [2, 4])
def test_gpu_virtual_ranks_against_cpu_reference(ranks):
    """The CUDA kernel's virtual ranks (sets of blocks of one launch, the all-reduce phase
    between them) against the CPU reference at the same R: the experts and their weights equal,
    layer 0's new key and value bit for bit, h and the logits within 1e-2 of their largest; and
    `sifar` and `oneshot` inside give the same bits (they differ in when a rank waits, not in
    what it sums)."""
    dims = dict(H=2048, KV=4, G=2, I=384, E=64, L=2, S=300, POS=257, START=3)
    ops, hw, _, _ = _model(11, "fp8", "channel", **dims)
    out = {}
    for dev, allreduce in ((jax.devices("cpu")[0], "sifar"), (jax.devices("gpu")[0], "sifar"),
                           (jax.devices("gpu")[0], "oneshot")):
        x, rope, pos, fnorm, layers, cache, hd = jax.device_put((*ops, hw), dev)
        res = sifar_jax.qwen3_moe_step_virtual_ranks(
            x, rope, pos, fnorm, layers, cache, kv_heads=4, group=2, top_k=8,
            norm_topk_prob=True, eps=EPS, ranks=ranks, allreduce=allreduce, head=hd,
            routing=True)
        out[dev.platform, allreduce] = [np.asarray(a) for a in res]
    h_c, c_c, lg_c, ids_c, w_c = out["cpu", "sifar"]
    h_g, c_g, lg_g, ids_g, w_g = out["gpu", "sifar"]
    np.testing.assert_array_equal(c_g[0, :, :, :, 257].view(np.uint16),
                                  c_c[0, :, :, :, 257].view(np.uint16))
    np.testing.assert_array_equal(ids_g, ids_c)
    np.testing.assert_array_equal(w_g[0], w_c[0])
    assert (np.abs(w_g - w_c) <= 0.05 * np.abs(w_c)).all()  # as the test above says
    h_g32, h_c32 = h_g.astype(np.float32), h_c.astype(np.float32)
    assert np.isfinite(h_c32).all() and np.isfinite(lg_g).all()
    assert np.abs(h_g32 - h_c32).max() <= 1e-2 * np.abs(h_c32).max()
    assert np.abs(lg_g - lg_c).max() <= 1e-2 * np.abs(lg_c).max()
    for a, b in zip(out["gpu", "sifar"], out["gpu", "oneshot"]):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
