"""The persistent step with virtual ranks (sifar_jax.llama_step_virtual_ranks): a TP=R model's
step as R sets of blocks of one launch, the all-reduce of o and down a phase of the kernel
(sifar: tagged words, speculative reads, dual buffers; oneshot: barriers across the ranks).

On the CPU the op's reference computes the same rank-order sums in loops: it is checked
against the XLA decoder at TP=R with sifar_psum (the same rule: bf16 partials, rank order in
float32, rounded once), and its failure report. On a GPU the kernel is checked against that
reference, under random skew (mis-speculation must not change a bit), with a rank that never
publishes (NaN, a clear error within the timeout, the next step exact).
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sifar_jax
from models import Decoder, make_mesh
from models.decoder.options import DecodeOptions
from models.llama import step as persistent
from models.registry import FAMILIES

LLAMA = FAMILIES["llama"]
BOUND = 2e-2  # of the largest logit: the TP=1 step's bound against the XLA step
needs_gpu = pytest.mark.skipif(not any(d.platform == "gpu" for d in jax.devices()),
                               reason="needs a GPU")


def _config(**kw):
    base = dict(dtype="bfloat16", hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=128,
                intermediate_size=512, num_layers=2, vocab_size=512, max_seq_len=64)
    base.update(kw)
    return LLAMA.preset("tiny", **base)


@pytest.fixture(scope="module")
def model():
    cfg = _config()
    return cfg, LLAMA.random_params(cfg, make_mesh(1), seed=5, quantize="fp8")


def _operands(cfg, params, cache_len=16, seed=0):
    """The op's operands for one token of `params` (TP=1 layout) and a random cache."""
    from flax import nnx

    m = nnx.merge(LLAMA.abstract_model(LLAMA.layout(cfg, 1).shapes)[0], params)
    x = m.embed[...][7]
    rope = jnp.asarray(np.random.default_rng(seed).uniform(-1, 1, (2, 128)), jnp.float32)
    layers = [persistent._layer_operands(b) for b in m.layers]
    cache = jnp.asarray(np.random.default_rng(seed + 1).normal(
        size=(cfg.num_layers, 2, 1, cfg.num_kv_heads, cache_len, 128)), jnp.bfloat16)
    return x, rope, m.norm.weight[...], layers, cache, persistent.head_operands(m, cfg)


def _kw(cfg):
    return dict(kv_heads=cfg.num_kv_heads, group=cfg.group_size, eps=cfg.rms_norm_eps)


@pytest.mark.parametrize("ranks", [2, 4])
def test_matches_the_tp_decoder(model, ranks, monkeypatch):
    """Teacher-forced logits of the persistent step at R virtual ranks (the CPU reference, or
    the kernel on a GPU) against the XLA decoder at TP=R with sifar_psum on R CPU devices."""
    cfg, params = model
    if len(jax.devices("cpu")) < ranks:
        pytest.skip(f"needs {ranks} CPU devices")
    seq = np.random.default_rng(ranks).integers(0, cfg.vocab_size, 16, dtype=np.int32)
    cpus = jax.devices("cpu")[:ranks]
    mesh_r = jax.sharding.Mesh(np.array(cpus), ("tp",))
    params_r = LLAMA.random_params(cfg, mesh_r, seed=5, quantize="fp8")
    want = Decoder(cfg, mesh_r, params_r, DecodeOptions(kv_layout="bhsd", step="xla",
                                                        allreduce="sifar"))
    want = np.asarray(want.teacher_forced_logits(seq[None])[0], np.float32)
    monkeypatch.setattr(persistent, "make_step_forward",
                        functools.partial(persistent.make_step_forward, virtual_ranks=ranks))
    calls = []
    real = sifar_jax.llama_step_virtual_ranks
    monkeypatch.setattr(sifar_jax, "llama_step_virtual_ranks",
                        lambda *a, **k: calls.append(k["ranks"]) or real(*a, **k))
    dec = Decoder(cfg, make_mesh(1), params, DecodeOptions(kv_layout="bhsd", step="persistent"))
    got = np.asarray(dec.teacher_forced_logits(seq[None])[0], np.float32)
    assert calls and set(calls) == {ranks}, "the virtual-rank step did not run"
    assert np.isfinite(got).all()
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= BOUND, err
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_layer0_cache_equals_tp1(model):
    """Ranks change only the sums after o and down: layer 0's new key and value (norm, qkv,
    RoPE of the embedding) are TP=1's bit for bit; h is close but is another rounding."""
    cfg, params = model
    x, rope, fnorm, layers, cache, head = _operands(cfg, params)
    pos = jnp.array([5, 0], jnp.int32)
    h1, c1, lg1 = sifar_jax.llama_step(x, rope, pos, fnorm, layers, cache, head=head, **_kw(cfg))
    h2, c2, lg2, st = sifar_jax.llama_step_virtual_ranks(x, rope, pos, fnorm, layers, cache,
                                                         head=head, ranks=2, **_kw(cfg))
    assert not sifar_jax.check_step_status(st).failed
    np.testing.assert_array_equal(np.asarray(c1[0]).view(np.uint16),
                                  np.asarray(c2[0]).view(np.uint16))
    h1, h2 = np.asarray(h1, np.float32), np.asarray(h2, np.float32)
    assert np.isfinite(h2).all() and np.abs(h2 - h1).max() <= 5e-2 * np.abs(h1).max()


def test_absent_rank_fails_clearly_and_the_next_step_is_exact(model):
    cfg, params = model
    x, rope, fnorm, layers, cache, head = _operands(cfg, params)
    pos = jnp.array([5, 0], jnp.int32)
    kw = dict(head=head, ranks=2, timeout_s=0.05, **_kw(cfg))
    good = sifar_jax.llama_step_virtual_ranks(x, rope, pos, fnorm, layers, cache, **kw)
    t0 = time.perf_counter()
    h, _, logits, st = jax.block_until_ready(sifar_jax.llama_step_virtual_ranks(
        x, rope, pos, fnorm, layers, cache, absent_rank=1, **kw))
    elapsed = time.perf_counter() - t0
    assert np.isnan(np.asarray(h, np.float32)).all() and np.isnan(np.asarray(logits)).all()
    with pytest.raises(sifar_jax.SifarError, match=r"phase 1 \(layer 0's o\) timed out .* "
                                                   r"waiting for rank 1"):
        sifar_jax.check_step_status(st)
    assert elapsed < 5.0, elapsed  # bounded: the timeout, not a hang
    again = sifar_jax.llama_step_virtual_ranks(x, rope, pos, fnorm, layers, cache, **kw)
    for a, b in zip(good[:3], again[:3]):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    assert not sifar_jax.check_step_status(again[3]).failed


def test_errors(model):
    cfg, params = model
    x, rope, fnorm, layers, cache, head = _operands(cfg, params)
    pos = jnp.array([5, 0], jnp.int32)
    call = functools.partial(sifar_jax.llama_step_virtual_ranks, x, rope, pos, fnorm, layers,
                             cache, **_kw(cfg))
    with pytest.raises(ValueError, match="4 KV heads do not split over 3 ranks"):
        call(ranks=3)
    with pytest.raises(ValueError, match="ranks must be an int in"):
        call(ranks=9)
    with pytest.raises(ValueError, match="allreduce must be one of"):
        call(ranks=2, allreduce="twoshot")
    with pytest.raises(ValueError, match="absent_rank"):
        call(ranks=2, absent_rank=2)
    with pytest.raises(ValueError, match="skew_ns in"):
        call(ranks=2, skew_ns=6 * 10**9)
    for bad in (0, 6.0):
        with pytest.raises(ValueError, match=r"timeout_s must be in \(0, 5.0\]"):
            call(ranks=2, timeout_s=bad)


# ---------------------------------------------------------------- GPU ----

def _gpu_cpu(fn, ops):
    return {d.platform: fn(*jax.device_put(ops, d)) for d in (jax.devices("gpu")[0],
                                                               jax.devices("cpu")[0])}


@needs_gpu
@pytest.mark.parametrize("allreduce", ["sifar", "oneshot"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_gpu_against_the_cpu_reference(ranks, allreduce):
    """The kernel at R virtual ranks against the CPU reference at slot 0 (as the TP=1 test:
    layer 0's key and value bit for bit; h within an ulp's reach of expf), widths that give the
    ring whole and partial slabs (hidden 2048, FFN 2560 / R)."""
    cfg = _config(hidden_size=2048, num_heads=16, num_kv_heads=4, intermediate_size=2560)
    params = LLAMA.random_params(cfg, make_mesh(1), seed=4, quantize="fp8")
    ops = _operands(cfg, params)
    pos = jnp.array([0, 0], jnp.int32)

    def run(x, rope, fnorm, layers, cache, head, pos):
        h, c, lg, st = sifar_jax.llama_step_virtual_ranks(
            x, rope, pos, fnorm, layers, cache, head=head, ranks=ranks, allreduce=allreduce,
            **_kw(cfg))
        return (np.asarray(h, np.float32), np.asarray(c[:, :, :, :, 0]), np.asarray(lg),
                sifar_jax.check_step_status(st))
    out = _gpu_cpu(run, (*ops, pos))
    (h_g, s_g, lg_g, st_g), (h_c, s_c, lg_c, _) = out["gpu"], out["cpu"]
    np.testing.assert_array_equal(s_g[0].view(np.uint16), s_c[0].view(np.uint16))
    assert np.isfinite(h_c).all() and (h_c != 0).mean() > 0.9
    assert (h_g != h_c).mean() <= 0.01, (h_g != h_c).mean()
    assert np.abs(h_g - h_c).max() <= 1e-2 * np.abs(h_c).max()
    assert np.abs(lg_g - lg_c).max() <= 1e-2 * np.abs(lg_c).max()


@needs_gpu
@pytest.mark.parametrize("allreduce", ["sifar", "oneshot"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_gpu_skewed_phases_change_no_bit(ranks, allreduce):
    """Steps with a random delay of every block before it publishes (up to 20 us), in one jit
    loop, against the unskewed step's bits: 0 mismatches; sifar must have re-read stale words
    (the skew reached the speculation). SIFAR_STEP_STRESS_PHASES sets the all-reduce phases
    (default 4,000; 1,000,000 on the device run)."""
    cfg = _config(num_layers=4)
    params = LLAMA.random_params(cfg, make_mesh(1), seed=6, quantize="fp8")
    x, rope, fnorm, layers, cache, head = _operands(cfg, params)
    pos = jnp.array([9, 0], jnp.int32)
    phases = int(os.environ.get("SIFAR_STEP_STRESS_PHASES", "4000"))
    steps = max(1, phases // (2 * cfg.num_layers))
    kw = dict(head=head, ranks=ranks, allreduce=allreduce, **_kw(cfg))
    h0, c0, lg0, st0 = sifar_jax.llama_step_virtual_ranks(x, rope, pos, fnorm, layers, cache, **kw)
    assert not sifar_jax.check_step_status(st0).failed

    @jax.jit
    def loop(cache):
        def body(_, carry):
            cache, bad, retried, failed = carry
            h, cache, lg, st = sifar_jax.llama_step_virtual_ranks(
                x, rope, pos, fnorm, layers, cache, skew_ns=20_000, **kw)
            same = (jnp.all(jax.lax.bitcast_convert_type(h, jnp.uint16)
                            == jax.lax.bitcast_convert_type(h0, jnp.uint16))
                    & jnp.all(jax.lax.bitcast_convert_type(lg, jnp.uint32)
                              == jax.lax.bitcast_convert_type(lg0, jnp.uint32)))
            return cache, bad + (~same), retried + st[4], failed + st[0]
        z = jnp.uint32(0)
        return jax.lax.fori_loop(0, steps, body, (cache, jnp.int32(0), z, z))
    t0 = time.perf_counter()
    c, bad, retried, failed = jax.block_until_ready(loop(cache))
    print(f"ranks {ranks} {allreduce}: {steps * 2 * cfg.num_layers} phases in "
          f"{time.perf_counter() - t0:.1f} s, {int(bad)} mismatching steps, {int(retried)} "
          f"re-reads, {int(failed)} failures")
    assert int(failed) == 0 and int(bad) == 0
    np.testing.assert_array_equal(np.asarray(c).view(np.uint16), np.asarray(c0).view(np.uint16))
    if allreduce == "sifar":
        assert int(retried) > 0, "no stale word was ever read: the skew did not reach the reads"


@needs_gpu
@pytest.mark.parametrize("allreduce", ["sifar", "oneshot"])
def test_gpu_absent_rank_fails_within_the_timeout(allreduce):
    cfg = _config(num_layers=4)
    params = LLAMA.random_params(cfg, make_mesh(1), seed=6, quantize="fp8")
    x, rope, fnorm, layers, cache, head = _operands(cfg, params)
    pos = jnp.array([9, 0], jnp.int32)
    kw = dict(head=head, ranks=2, allreduce=allreduce, timeout_s=0.1, **_kw(cfg))
    good = jax.block_until_ready(
        sifar_jax.llama_step_virtual_ranks(x, rope, pos, fnorm, layers, cache, **kw))
    t0 = time.perf_counter()
    h, _, logits, st = jax.block_until_ready(sifar_jax.llama_step_virtual_ranks(
        x, rope, pos, fnorm, layers, cache, absent_rank=1, **kw))
    elapsed = time.perf_counter() - t0
    assert np.isnan(np.asarray(h, np.float32)).all() and np.isnan(np.asarray(logits)).all()
    with pytest.raises(sifar_jax.SifarError, match="timed out .* waiting for rank 1"):
        sifar_jax.check_step_status(st)
    assert elapsed < 2.0, elapsed
    again = sifar_jax.llama_step_virtual_ranks(x, rope, pos, fnorm, layers, cache, **kw)
    for a, b in zip(good[:3], again[:3]):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    assert not sifar_jax.check_step_status(again[3]).failed
