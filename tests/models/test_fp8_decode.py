"""Both decoders with FP8 weights (models/quantize.py), end to end on CPU (XLA's dequantize-and-
dot path of sifar_jax.fp8_matvec), at TP 1, 2 and 4 with every all-reduce (lax.psum, sifar,
sifar fused with the residual add and RMSNorm).

The reference is the same decoder on the dequantized weights (the FP8 values x their scales in
the model's dtype) at TP=1 with lax.psum. Measured on these tiny configs (random weights), as a
share of the largest logit over 12 teacher-forced steps:
  float32 models, every TP and all-reduce: FP8 vs dequantized <= 5.4e-7 (float32 sums of the
    same weights, in another order); bound 1e-5;
  bfloat16 Llama, TP=2: FP8 vs dequantized 8.3e-3 (the dequantized weights are rounded to
    bf16, the FP8 path multiplies them exactly); bound 2e-2. FP8 vs the bf16 model it was
    quantized from: 5.8e-2 (e4m3's 3 mantissa bits); bound 1e-1.
Greedy tokens of the FP8 decoder equal the dequantized one's.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from models import Decoder, dequantize_params, make_mesh, quantize_params
from models.decoder.options import DecodeOptions
from models.registry import FAMILIES
from models.weights.types import Fp8Weight, is_quantized

PROMPT, STEPS = 4, 8
VARIANTS = {"psum": dict(allreduce="psum"), "sifar": dict(allreduce="sifar"),
            "fused": dict(allreduce="sifar", fused=True)}


def _config(name, dtype="float32"):
    family = FAMILIES[name]
    if name == "llama":
        return family, family.preset("tiny", dtype=dtype)
    # an expert width of 64: 16 columns per rank at TP=4 (fp8_matvec contracts multiples of 16)
    return family, family.preset("qwen3_moe_tiny", dtype=dtype, moe_intermediate_size=64)


SEQ = np.random.default_rng(3).integers(0, 256, PROMPT + STEPS, dtype=np.int32)


@pytest.fixture(scope="module")
def models():
    """(family name, tp) -> (family, config, mesh, FP8 params). The values do not depend on tp
    (random_params; quantization where they lie is bit-identical, tested below)."""
    cache = {}

    def get(name, tp):
        if len(jax.devices()) < tp:
            pytest.skip(f"needs {tp} devices")
        if (name, tp) not in cache:
            family, config = _config(name)
            mesh = make_mesh(tp)
            cache[name, tp] = (family, config, mesh,
                               family.random_params(config, mesh, seed=1, quantize="fp8"))
        return cache[name, tp]

    return get


@pytest.fixture(scope="module")
def reference(models):
    """name -> the dequantized weights' decoder at TP=1, lax.psum: its teacher-forced logits
    [PROMPT + STEPS, vocab], prefill logits [PROMPT, vocab] and greedy tokens."""
    cache = {}

    def get(name):
        if name not in cache:
            _, config, mesh, fp8 = models(name, 1)
            dec = Decoder(config, mesh, dequantize_params(fp8, config))
            cache[name] = (dec.teacher_forced_logits(SEQ[None])[0], *_prefill_and_greedy(dec))
        return cache[name]

    return get


def _prefill_and_greedy(dec):
    dec.reset()
    logits = np.asarray(dec.prefill(SEQ[None, :PROMPT]))[0]
    return logits, dec.generate(SEQ[None, :PROMPT], 6)


def _rel(got, want):
    return np.abs(got - want).max() / np.abs(want).max()


@pytest.fixture
def sifar_clean():
    import sifar_jax

    sifar_jax.shutdown()
    yield
    sifar_jax.shutdown()


CASES = [(n, 1, "psum") for n in FAMILIES] + [(n, tp, v) for n in FAMILIES for tp in (2, 4)
                                              for v in VARIANTS]


@pytest.mark.parametrize("name,tp,variant", CASES, ids=[f"{n}-tp{t}-{v}" for n, t, v in CASES])
def test_fp8_decoder_equals_its_dequantized_weights(models, reference, name, tp, variant,
                                                    sifar_clean):
    """Teacher-forced decode steps of the FP8 decoder against the dequantized one's at TP=1."""
    _, config, mesh, fp8 = models(name, tp)
    want = reference(name)[0]
    dec = Decoder(config, mesh, fp8, DecodeOptions(**VARIANTS[variant]))
    err = _rel(dec.teacher_forced_logits(SEQ[None])[0], want)
    print(f"{name} TP={tp} {variant}: FP8 vs dequantized {err:.2e}")
    assert 0 < err < 1e-5, err  # not 0: the FP8 path really ran


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fp8_prefill_and_greedy_tokens(models, reference, name):
    """TP=2: the prefill's logits (several tokens per call) and the greedy tokens."""
    _, config, mesh, fp8 = models(name, 2)
    _, want, tokens = reference(name)
    got, got_tokens = _prefill_and_greedy(Decoder(config, mesh, fp8))
    assert 0 < _rel(got, want) < 1e-5
    np.testing.assert_array_equal(got_tokens, tokens)


def test_bf16_llama_fp8_against_dequantized_and_the_bf16_model():
    family, config = _config("llama", "bfloat16")
    mesh = make_mesh(2)
    dense = family.random_params(config, mesh, seed=1)
    fp8 = quantize_params(dense, family)
    deq = dequantize_params(fp8, config)
    got, ref, bf16 = (Decoder(config, mesh, p).teacher_forced_logits(SEQ[None])[0]
                      for p in (fp8, deq, dense))
    print(f"bf16 Llama TP=2: FP8 vs dequantized {_rel(got, ref):.2e}, vs bf16 {_rel(got, bf16):.2e}")
    assert _rel(got, ref) < 2e-2
    assert 0 < _rel(got, bf16) < 1e-1


@pytest.mark.parametrize("name,tp", [("llama", 4), ("qwen3_moe", 2)])
def test_quantized_where_they_lie_bit_identical_to_unsharded(name, tp):
    """Sharded weights quantized by one jit each (row-parallel ones: a max over the shards) give
    the same bits as the unsharded weights quantized on one device; norms, embedding, router
    stay as they were."""
    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} devices")
    family, config = _config(name)
    one = quantize_params(family.random_params(config, make_mesh(1)), family)
    dense = family.random_params(config, make_mesh(tp))
    many = quantize_params(dense, family)
    assert is_quantized(many) and not is_quantized(dense)
    fp8 = lambda a: isinstance(a, Fp8Weight)  # noqa: E731
    names = {jax.tree_util.keystr(p)
             for p, a in jax.tree_util.tree_flatten_with_path(many, is_leaf=fp8)[0] if fp8(a)}
    layer = "['layers'][0]"
    proj = {"llama": ["['attn']['qkv']", "['attn']['o']", "['mlp']['gate_up']", "['mlp']['down']"],
            "qwen3_moe": ["['attn']['qkv']", "['attn']['o']", "['moe']['gate_up']",
                          "['moe']['down']"]}[name]
    assert names == {"['lm_head']"} | {f"['layers'][{i}]{p}" for i in range(config.num_layers)
                                         for p in proj}, names
    assert layer + proj[0] in names
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    w = many["lm_head"]
    assert w.q.sharding.spec == jax.sharding.PartitionSpec("tp", None)


def test_step_bytes_and_footprint_count_fp8(models):
    from models.decoder import footprint

    family, config, mesh, fp8 = models("llama", 2)
    deq = dequantize_params(fp8, config)
    layout = family.layout(config, 2)
    dense_bytes, fp8_bytes = (family.step_weight_bytes(layout, p) for p in (deq, fp8))
    assert dense_bytes == family.step_weight_bytes(layout)  # float32 dense
    h, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    qkv = h * (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    o, mlp = config.num_heads * config.head_dim * h, 3 * h * f
    per_layer = (qkv + o + mlp) // 2 + 4 * ((qkv + mlp) // h // 2 + h)  # e4m3 + f32 scales
    head = h * v // 2 + 4 * v // 2
    norms = 4 * h * (2 * config.num_layers + 1)
    assert fp8_bytes == config.num_layers * per_layer + head + norms + 4 * h  # + one embed row
    est = footprint.estimate(family, config, 2, 1, 64, quantize="fp8")
    assert est.weights == sum(jax.tree.leaves(family.local_bytes(fp8, 2)))
    assert est.weights < footprint.estimate(family, config, 2, 1, 64).weights / 2
