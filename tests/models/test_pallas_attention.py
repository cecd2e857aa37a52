"""models.core.pallas_attention: a decoding step's attention through JAX's Pallas flash-decoding
kernel (Pallas' interpreter off GPUs), against a float64 reference and in the decoder against the
einsums (tiny preset, 8 host CPU devices from conftest.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sifar_jax
from models import LOOPS, Decoder, LlamaConfig, make_mesh, random_params
from models.core.pallas_attention import (SMEM_BUDGET, applies, decode_attention,
                                          pipeline_stages, split_length)
from models.decoder.options import DecodeOptions, default_attn_impl


def _reference(q, k, v, pos, start):
    """float64 attention of q [B, KV, G, D] over slots start[b]..pos of k/v [B, KV, S, D]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, kv, g, d = q.shape
    out = np.zeros((b, kv, g, d))
    for r in range(b):
        keys, vals = k[r, :, start[r]:pos + 1], v[r, :, start[r]:pos + 1]  # [KV, n, D]
        s = np.einsum("kgd,knd->kgn", q[r], keys) / np.sqrt(d)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[r] = np.einsum("kgn,knd->kgd", p / p.sum(-1, keepdims=True), vals)
    return out.reshape(b, kv * g, d)


LAYER = 1  # the layer the tests' caches hold their keys and values in


def _cache(k, v, dtype, layers: int = 3):
    """k and v [B, KV, S, D] as layer LAYER of a whole cache array [layers, 2, B, KV, S, D]
    whose other layers hold NaN: a read of any of them would reach the output."""
    c = np.full((layers, 2) + np.shape(k), np.nan, np.float32)
    c[LAYER, 0], c[LAYER, 1] = k, v
    return jnp.asarray(c, dtype)


# On GPUs the kernel's float32 dots run as TF32 (Triton's default): a float32 bound of ~1e-3.
F32_TOL = 5e-3 if jax.default_backend() == "gpu" else 2e-5


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, F32_TOL), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("b,kv,g,cap,n,pos", [
    (1, 2, 4, 256, 256, 255),  # the whole cache, last slot
    (1, 2, 1, 1024, 128, 0),  # one slot seen; the bucket smaller than the cache
    (2, 1, 8, 512, 512, 300),  # splits past pos return at once
    (3, 4, 2, 128, 64, 40),
    (2, 1, 4, 4096, 4096, 3000),  # 64 splits of 64 slots, row 1 from slot 300
    (1, 2, 4, 3072, 3072, 3071),  # a capacity that is no power of two: 24 splits of 128
    (1, 1, 2, 1536, 1024, 700),
    (1, 1, 32, 256, 256, 200),  # two programs of 16 query heads per split
    (1, 2, 6, 256, 256, 130)])  # a group that is no power of two: XLA's merge
def test_kernel_matches_float64(dtype, tol, b, kv, g, cap, n, pos):
    rng = np.random.default_rng(cap + pos)
    d = 64
    q = rng.uniform(-2, 2, (b, kv, g, d))
    k, v = rng.uniform(-2, 2, (2, b, kv, cap, d))
    start = np.minimum(np.arange(b) * (300 if cap == 4096 else 7), pos).astype(np.int32)
    # Slots a row does not see hold large garbage, which must not reach its output (finite: the
    # kernel masks their scores; it loads the blocks that hold pos or start).
    k[:, :, pos + 1:] = v[:, :, pos + 1:] = 1e4
    for r in range(b):
        k[r, :, : start[r]] = v[r, :, : start[r]] = -1e4
    got = decode_attention(jnp.asarray(q, dtype), _cache(k, v, dtype), LAYER, jnp.int32(pos),
                           jnp.asarray(start), n)
    assert got is not None and got.shape == (b, kv * g, d)
    want = _reference(np.asarray(jnp.asarray(q, dtype), np.float64),
                      np.asarray(jnp.asarray(k, dtype), np.float64),
                      np.asarray(jnp.asarray(v, dtype), np.float64), pos, start)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, F32_TOL), (jnp.bfloat16, 3e-2)])
def test_blocks_before_a_rows_start_are_masked_whole(dtype, tol):
    """32 rows x kv heads: 4 splits of 256 slots, 2 kernel blocks each. A row starting at 140 or
    400 begins a split with a block it sees none of (its running maximum and sums must be
    discarded by the next block's correction), one starting at 700 skips two splits."""
    b, kv, g, cap, d, pos = 4, 8, 2, 1024, 64, 900
    assert split_length(cap, cap, b * kv) == 256
    rng = np.random.default_rng(3)
    q = rng.uniform(-2, 2, (b, kv, g, d))
    k, v = rng.uniform(-2, 2, (2, b, kv, cap, d))
    start = np.array([0, 140, 400, 700], np.int32)
    k[:, :, pos + 1:] = v[:, :, pos + 1:] = 1e4
    for r in range(b):
        k[r, :, : start[r]] = v[r, :, : start[r]] = -1e4
    got = decode_attention(jnp.asarray(q, dtype), _cache(k, v, dtype), LAYER, jnp.int32(pos),
                           jnp.asarray(start), cap)
    want = _reference(*(np.asarray(jnp.asarray(a, dtype), np.float64) for a in (q, k, v)),
                      pos, start)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)


def test_a_row_that_sees_no_slot_gets_zeros_not_nan():
    """start > pos (never asked by the decoder): the merge's denominator is floored."""
    q = jnp.ones((2, 1, 4, 64))
    k = np.ones((2, 1, 256, 64))
    got = decode_attention(q, _cache(k, k, jnp.float32), LAYER, jnp.int32(5),
                           jnp.asarray([0, 10], jnp.int32), 256)
    assert np.isfinite(np.asarray(got)).all() and not np.asarray(got)[1].any()


def test_split_length_needs_an_even_split_of_the_cache():
    assert split_length(1024, 1024) == 64 and split_length(16384, 16384) == 1024
    assert split_length(4096, 64) == 64  # a small bucket: one split of it
    assert split_length(3072, 3072) == 128  # a power of two (Triton's blocks), 24 splits
    assert split_length(1000, 1024) is None  # 1000 slots do not split into parts of 64
    assert split_length(1 << 17, 1024) == 64  # a small fill of a large cache: the bucket's parts
    assert split_length(8, 8) is None and split_length(16, 16) == 16  # the kernel's floor: 16
    # fewer kv heads (TP=2's 4 per rank) or more rows: as many programs in more or fewer parts
    assert split_length(16384, 16384, rows_heads=4) == 512
    assert split_length(16384, 16384, rows_heads=32) == 4096
    assert split_length(1024, 1024, rows_heads=4) == 64  # MIN_SPLIT
    q = jnp.zeros((1, 1, 1, 16))
    kc = np.zeros((1, 1, 1000, 16))
    assert decode_attention(q, _cache(kc, kc, jnp.float32), LAYER, jnp.int32(3), None, 1000) is None


def test_pipelined_blocks_fit_in_shared_memory():
    assert pipeline_stages(128, 128, 2) == 3  # Llama's heads in bf16: 3 x 64 KB
    for block_k, d, itemsize in ((128, 256, 2), (128, 128, 4), (64, 64, 2), (16, 512, 4)):
        stages = pipeline_stages(block_k, d, itemsize)
        assert 1 <= stages and stages * 2 * block_k * d * itemsize <= SMEM_BUDGET
    # where not even one key and one value block fit, the einsums run
    big = _cache(*np.zeros((2, 1, 1, 256, 512)), jnp.float32)  # 2 x 64 x 512 x 4 B = 256 KB
    assert not applies(jnp.zeros((1, 1, 4, 512), jnp.float32), big, 256)


def test_the_kernel_applies_to_power_of_two_heads_in_the_cache_dtype():
    kc = _cache(*np.zeros((2, 1, 1, 256, 64)), jnp.bfloat16)
    assert applies(jnp.zeros((1, 1, 4, 64), jnp.bfloat16), kc, 256)
    assert not applies(jnp.zeros((1, 1, 4, 64), jnp.float32), kc, 256)  # another dtype
    k80 = _cache(*np.zeros((2, 1, 1, 256, 80)), jnp.bfloat16)
    assert not applies(jnp.zeros((1, 1, 4, 80), jnp.bfloat16), k80, 256)  # head size 80
    assert decode_attention(jnp.zeros((1, 1, 4, 80), jnp.bfloat16), k80, LAYER, jnp.int32(3),
                            None, 256) is None


def test_attn_impl_is_checked_and_defaults_to_xla_off_gpus():
    with pytest.raises(ValueError, match="attn_impl must be one of"):
        DecodeOptions(attn_impl="flash")
    assert default_attn_impl(make_mesh(1)) == ("pallas" if jax.default_backend() == "gpu"
                                              else "xla")


PROMPT = np.array([5, 17, 3, 250, 99, 7, 42, 128], np.int32)


@functools.lru_cache(maxsize=None)
def _params(tp):
    config = LlamaConfig.tiny()
    mesh = make_mesh(tp)
    return config, mesh, random_params(config, mesh, seed=5)


def _pallas_calls(dec, kind):
    """Pallas kernels in the jaxpr of the decoder's step ("step") or of a 4-token prefill."""
    if kind == "step":
        _, fn, args, _ = dec.exes.step_spec(dec.seq.bucket(dec.seq.pos + 1), "greedy")
    else:
        _, fn, args, _ = dec.exes.prefill_spec(dec.seq.bucket(dec.seq.pos + 4), 4, "greedy")
    return _count(jax.make_jaxpr(fn)(dec.weights.leaves, dec.state, *args).jaxpr, "pallas_call")


def _count(jaxpr, name: str) -> int:
    """Equations of primitive `name` in jaxpr and every jaxpr it calls, once per call site."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for sub in _params_jaxprs(eqn.params):
            n += _count(sub, name)
    return n


def _params_jaxprs(params):
    for v in params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if hasattr(x, "eqns"):
                yield x
            elif hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
                yield x.jaxpr


@pytest.mark.parametrize("tp,allreduce", [(1, "psum"), (2, "psum"), (2, "sifar")])
def test_decoder_gives_the_einsums_tokens_in_every_loop(tp, allreduce):
    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} devices")
    config, mesh, params = _params(tp)
    got, kernels = {}, {}
    for impl in ("xla", "pallas"):
        sifar_jax.shutdown()
        dec = Decoder(config, mesh, params, DecodeOptions(kv_layout="bhsd", attn_impl=impl),
                      allreduce=allreduce, max_seq_len=256)
        got[impl] = {loop: dec.generate(PROMPT, 12, loop=loop, chunk=4) for loop in LOOPS}
        dec.start(PROMPT)
        got[impl]["logits"] = np.asarray(dec.step(dec.token()))
        kernels[impl] = (_pallas_calls(dec, "step"), _pallas_calls(dec, "prefill"))
    sifar_jax.shutdown()
    for loop in LOOPS:
        np.testing.assert_array_equal(got["pallas"][loop], got["xla"][loop], err_msg=loop)
    # (step, prefill): per layer the kernel and the merge of its splits
    assert kernels == {"xla": (0, 0), "pallas": (2 * config.num_layers, 0)}
    tol = 1e-4 if jax.default_backend() == "cpu" else F32_TOL  # (TF32 in the kernel on GPUs)
    np.testing.assert_allclose(got["pallas"]["logits"], got["xla"]["logits"], atol=tol, rtol=tol)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the default is pallas on GPUs only")
def test_gpu_default_decoder_attends_through_the_kernel():
    """On a GPU the default decoder's step holds two Pallas kernels per layer (the splits and
    their merge), its prefill none."""
    config, mesh, params = _params(1)
    dec = Decoder(config, mesh, params, max_seq_len=256)
    assert dec.attn_impl == "pallas" and dec.kv_layout == "bhsd"
    dec.start(PROMPT)
    assert (_pallas_calls(dec, "step"), _pallas_calls(dec, "prefill")) == (2 * config.num_layers, 0)
