"""The persistent step at TP >= 2 in the decoder (DecodeOptions(step="persistent"),
models/llama/step.py): sifar_jax.llama_step(axis_name="tp") inside jax.shard_map, one rank per
device, each on its shard of the decoder's own parameters and cache, the all-reduce after o and
down a phase of the op ("sifar" or "oneshot": DecodeOptions.step_allreduce).

On CPU host devices the op's C++ reference runs across the devices (threads as ranks), which is
what step="persistent" asks for there (step="auto" never runs it). Checked on the small preset
the step serves (llama_step_tiny: bf16, head_dim 128), FP8 and bf16 rows, TP = 2 and 4:

* the decoder's logits and cache are those of the same model's step as virtual ranks
  (sifar_jax.llama_step_virtual_ranks on the unsharded params, one device) bit for bit;
* against the XLA decoder at the same TP: within BOUND (tests/models/test_persistent.py's, for
  TP = 1), greedy tokens equal up to the first near-tie;
* warm-up compiles everything Decoder.stream needs; where the step cannot serve the decoder,
  step="persistent" is a ValueError saying why, and "auto" on the CPU runs the XLA step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sifar_jax
from models import Decoder, to_rows
from models.core.attention import rope_cos_sin, rope_inv_freq
from models.decoder.options import DecodeOptions
from models.llama import step as persistent
from models.registry import FAMILIES
from tests.models.test_persistent import BOUND

LLAMA = FAMILIES["llama"]
STEPS = 6  # teacher-forced tokens of the bit-for-bit test


def _mesh(n: int) -> jax.sharding.Mesh:
    cpus = jax.devices("cpu")
    if len(cpus) < n:
        pytest.skip(f"needs {n} CPU devices")
    return jax.sharding.Mesh(np.array(cpus[:n]), ("tp",))


@pytest.fixture(autouse=True)
def clean():
    """No communicator before or after: the Decoder sets up the step's own."""
    sifar_jax.shutdown()
    yield
    try:
        sifar_jax.shutdown()
    except Exception:  # noqa: BLE001 - a test provoked a failure: start clean
        sifar_jax.comm.wait_for_effects()
        sifar_jax.shutdown()


def _params(cfg, mesh, weights: str, seed: int = 1):
    if weights == "fp8":
        return LLAMA.random_params(cfg, mesh, seed=seed, quantize="fp8")
    return to_rows(LLAMA.random_params(cfg, mesh, seed=seed), cfg, donate=True)


def _decoder(cfg, mesh, params, step="persistent", **kw):
    return Decoder(cfg, mesh, params, DecodeOptions(step=step, **kw))


def _spy(monkeypatch):
    """The keywords of every sifar_jax.llama_step traced."""
    calls, real = [], sifar_jax.llama_step
    monkeypatch.setattr(sifar_jax, "llama_step", lambda *a, **k: calls.append(k) or real(*a, **k))
    return calls


def _virtual_ranks(cfg, layout, params, seq, cache_shape, ranks: int, allreduce: str):
    """Logits [T, vocab] and the last cache of the model's step as `ranks` virtual ranks on one
    device, fed seq from slot 0 (the unsharded params, the TP=R layout's shapes)."""
    cpu = jax.devices("cpu")[0]
    model = nnx.merge(LLAMA.abstract_model(layout.shapes)[0], jax.device_put(params, cpu))
    layers = [persistent._layer_operands(b) for b in model.layers]
    head = persistent.head_operands(model, cfg)
    inv_freq = rope_inv_freq(cfg)
    cache = jax.device_put(jnp.zeros(cache_shape, jnp.bfloat16), cpu)
    kw = dict(kv_heads=layout.shapes.num_kv_heads, group=layout.shapes.group_size,
              eps=cfg.rms_norm_eps, head=head, ranks=ranks, allreduce=allreduce)
    out = []
    for t, tok in enumerate(seq):
        cos, sin = rope_cos_sin(jnp.array([t]), inv_freq)
        _, cache, logits, st = sifar_jax.llama_step_virtual_ranks(
            model.embed[...][int(tok)], jnp.concatenate([cos, sin]), jnp.array([t, 0], jnp.int32),
            model.norm.weight[...], layers, cache, **kw)
        assert not sifar_jax.check_step_status(st).failed
        out.append(np.asarray(logits))
    return np.stack(out), np.asarray(cache)


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("allreduce", ["sifar", "oneshot"])
@pytest.mark.parametrize("weights", ["fp8", "bf16"])
@pytest.mark.parametrize("tp", [2, 4])
def test_equals_the_virtual_ranks_bit_for_bit(tp, weights, allreduce, monkeypatch):
    """With allreduce="psum" (no sifar all-reduce of its own): the step sets up sifar_jax's
    communicator itself; every rank ran its 2 phases a layer per step."""
    cfg = LLAMA.preset("llama_step_tiny")
    mesh = _mesh(tp)
    params = _params(cfg, mesh, weights)
    calls = _spy(monkeypatch)
    dec = _decoder(cfg, mesh, params, allreduce="psum", step_allreduce=allreduce)
    assert dec.step_kind == "persistent" and dec.step_reason is None
    assert sifar_jax.communicators("tp"), "the step's communicator was not set up"
    seq = np.random.default_rng(tp).integers(0, cfg.vocab_size, STEPS, dtype=np.int32)
    dec.reset(STEPS)
    before = sifar_jax.stats()[allreduce]["calls"]
    got = np.stack([np.asarray(dec.step(np.array([t])))[0] for t in seq])
    sifar_jax.check()
    assert calls and {(k["axis_name"], k["allreduce"]) for k in calls} == {("tp", allreduce)}
    assert sifar_jax.stats()[allreduce]["calls"] - before == tp * 2 * cfg.num_layers * STEPS
    want, cache = _virtual_ranks(cfg, dec.layout, params, seq, dec.state["cache"].shape, tp,
                                 allreduce)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(_bits(got), _bits(want))
    np.testing.assert_array_equal(_bits(dec.state["cache"]), _bits(cache))


def test_more_ranks_than_kv_heads_bit_for_bit():
    """tp=4 > num_kv_heads=2: each rank holds a copy of one KV head with its share of the
    group's query heads (the decoder's replicated layout); the op runs that layout's model."""
    cfg = LLAMA.preset("llama_step_tiny", num_kv_heads=2)
    mesh = _mesh(4)
    params = _params(cfg, mesh, "fp8")
    dec = _decoder(cfg, mesh, params)
    assert dec.layout.kv_replicas == 2 and dec.step_kind == "persistent"
    seq = np.random.default_rng(9).integers(0, cfg.vocab_size, 4, dtype=np.int32)
    dec.reset(4)
    got = np.stack([np.asarray(dec.step(np.array([t])))[0] for t in seq])
    want, _ = _virtual_ranks(cfg, dec.layout, params, seq, dec.state["cache"].shape, 4, "sifar")
    np.testing.assert_array_equal(_bits(got), _bits(want))


def _near_tie_or_equal(ref, prompt, got, want):
    """Greedy tokens equal up to the first near-tie: a step whose top-2 margin (the XLA step's
    logits on the same tokens) is within BOUND of the largest logit, which bf16 roundings may
    break either way."""
    diff = np.flatnonzero(got != want)
    if diff.size:
        lx = ref.teacher_forced_logits(np.concatenate([prompt, want[:diff[0]]])[None])[0][-1]
        top = np.sort(lx)[-2:]
        assert top[1] - top[0] <= BOUND * np.abs(lx).max(), (diff[0], top, np.abs(lx).max())


@pytest.mark.parametrize("weights, tie", [("fp8", False), ("bf16", False), ("bf16", True)])
@pytest.mark.parametrize("tp", [2, 4])
def test_matches_the_xla_decoder(tp, weights, tie):
    """Teacher-forced logits within BOUND of the XLA decoder's at the same TP (sifar_psum);
    greedy tokens equal up to the first near-tie. A tied head runs in XLA on the op's h, each
    rank on its vocabulary rows of the embedding."""
    if tie and tp == 4:
        pytest.skip("the tied head's split is the same at any TP: one size is enough")
    cfg = LLAMA.preset("llama_step_tiny", tie_word_embeddings=tie)
    mesh = _mesh(tp)
    params = _params(cfg, mesh, weights, seed=2)
    seq = np.random.default_rng(7).integers(0, cfg.vocab_size, 16, dtype=np.int32)
    ref = _decoder(cfg, mesh, params, "xla", kv_layout="bhsd", allreduce="sifar")
    dec = _decoder(cfg, mesh, params, allreduce="sifar")
    assert dec.step_kind == "persistent"
    want = ref.teacher_forced_logits(seq[None])[0]
    got = dec.teacher_forced_logits(seq[None])[0]
    assert np.isfinite(got).all()
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 0 < err <= BOUND, err
    prompt = seq[:4]
    _near_tie_or_equal(ref, prompt, dec.generate(prompt, 12)[0], ref.generate(prompt, 12)[0])


def test_nothing_compiles_after_warmup(monkeypatch):
    """Decoder.warmup compiles the TP=2 step with the rest: requests within its limits through
    Decoder.stream compile nothing more and trace no further step."""
    cfg = LLAMA.preset("llama_step_tiny")
    mesh = _mesh(2)
    calls = _spy(monkeypatch)
    dec = _decoder(cfg, mesh, _params(cfg, mesh, "fp8"), step_allreduce="oneshot")
    dec.warmup(8, 16, loops=("stream",))
    traced = len(calls)
    assert traced
    rng = np.random.default_rng(1)
    for n in (3, 8):
        toks = list(dec.stream(rng.integers(0, cfg.vocab_size, n, dtype=np.int32), 16))
        assert len(toks) == 16
    assert dec.compiles_after_warmup == 0 and len(calls) == traced
    sifar_jax.check()


@pytest.mark.parametrize("change, words", [
    (dict(dtype="float32"), "dtype=float32"),
    (dict(options=dict(batch_size=2)), "batch_size=2: the persistent step decodes one sequence"),
    (dict(options=dict(kv_layout="bshd")), "kv_layout='bshd'"),
    (dict(options=dict(slot_bytes=1024, allreduce="sifar")), "slot_bytes=1024"),
    (dict(weights="einsum"), "models.to_rows"),
    (dict(num_heads=32, num_kv_heads=1), "16 query heads per KV head (tp=2 > num_kv_heads=1"),
])
def test_persistent_where_it_cannot_serve_is_a_clear_error(change, words):
    """step="persistent" where the step cannot serve the decoder: ValueError at construction,
    the reason in it (no silent fallback); "auto" runs the XLA step and says the same."""
    change = dict(change)
    options, weights = change.pop("options", {}), change.pop("weights", "fp8")
    cfg = LLAMA.preset("llama_step_tiny", **change)
    mesh = _mesh(2)
    params = LLAMA.random_params(cfg, mesh, seed=0,
                                 quantize=None if weights == "einsum" else "fp8")
    with pytest.raises(ValueError, match="step='persistent' cannot run this decoder") as e:
        _decoder(cfg, mesh, params, **options)
    assert words in str(e.value), e.value
    auto = _decoder(cfg, mesh, params, "auto", **options)
    assert auto.step_kind == "xla" and auto.step_reason.startswith("auto: ")


def test_auto_on_cpu_runs_the_xla_step(monkeypatch):
    """"auto" (the default) never runs the CPU reference: on host devices the XLA step runs,
    and the Decoder says why; no llama_step is traced."""
    cfg = LLAMA.preset("llama_step_tiny")
    mesh = _mesh(2)
    calls = _spy(monkeypatch)
    dec = Decoder(cfg, mesh, _params(cfg, mesh, "fp8"), DecodeOptions(kv_layout="bhsd"))
    assert DecodeOptions().step == "auto"
    assert dec.step_kind == "xla" and "CUDA kernel" in dec.step_reason
    assert dec.step_choice.make_forward is None
    dec.generate(np.array([1, 2, 3], np.int32), 3)
    assert not calls
