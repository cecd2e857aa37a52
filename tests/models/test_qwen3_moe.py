"""The Qwen3-MoE family against Hugging Face transformers' Qwen3MoeForCausalLM (tiny random model,
float32, TP 1, 2 and 4 on host CPU devices), across all-reduce implementations and expert
implementations, and its loader, config checks and registration."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from models import Decoder, make_mesh, registry
from models.decoder.options import DecodeOptions
from models.qwen3_moe import QWEN3_MOE, Qwen3MoeConfig
from models.qwen3_moe import model as qwen3_moe
from models.qwen3_moe.hf import to_hf_tensors

PROMPT, STEPS = 8, 4  # prefill length, then teacher-forced decode steps
NEW = 8  # greedy tokens compared across all-reduce variants


def _need(n):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices, have {len(jax.devices())} (conftest sets XLA_FLAGS)")


def _hf_model(seed: int, **overrides):
    """Qwen3MoeForCausalLM with random weights at scales that make every part matter: norm gains
    1 +- 0.2 (not ones), linear weights std 1/sqrt(fan_in), a router sharp enough that the top-k
    choice is far from ties, embedding std 1."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    c = Qwen3MoeConfig.tiny()
    kw = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=96,
              num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
              num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, num_experts=c.num_experts,
              num_experts_per_tok=c.num_experts_per_tok,
              moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
              rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_seq_len,
              rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
              tie_word_embeddings=False)
    kw.update(overrides)
    config = transformers.Qwen3MoeConfig(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # RMSNorm gains
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                scale = 4.0 if name.endswith("mlp.gate.weight") else 1.0
                p.copy_(torch.randn_like(p) * scale / p.shape[-1] ** 0.5)
    return model


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(tokens[None], dtype=torch.long)).logits[0].double().numpy()


def _hf_greedy(model, prompt: np.ndarray, n: int) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model.generate(torch.as_tensor(prompt[None], dtype=torch.long), max_new_tokens=n,
                             do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].numpy()


# float32 against float64 or torch's float32: JAX runs float32 dots as TF32 on GPUs (its
# default precision), exactly on the CPU.
F32_RTOL = 5e-3 if jax.default_backend() == "gpu" else 1e-4


def assert_close(got, want, rtol=F32_RTOL):
    # relative to the logits' scale: float32 here and in torch over a 2-layer model
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(checkpoint dir written by save_pretrained, HF model, sequence, HF logits of it)."""
    model = _hf_model(seed=0)
    path = tmp_path_factory.mktemp("qwen3_moe_tiny")
    model.save_pretrained(str(path))
    seq = np.random.default_rng(7).integers(0, model.config.vocab_size, PROMPT + STEPS,
                                            dtype=np.int32)
    return str(path), model, seq, _hf_logits(model, seq)


@pytest.fixture(scope="module")
def loaded(hf):
    """tp -> (mesh, config, params), loaded once per TP size."""
    cache = {}

    def get(tp):
        _need(tp)
        if tp not in cache:
            mesh = make_mesh(tp)
            cache[tp] = (mesh, *QWEN3_MOE.load_hf_checkpoint(hf[0], mesh))
        return cache[tp]

    return get


def _prefill_and_steps(dec, seq) -> np.ndarray:
    """Logits [PROMPT + STEPS, vocab]: a prefill of the prompt, then one decode step per token."""
    out = [np.asarray(dec.prefill(seq[None, :PROMPT]))[0]]
    out += [np.asarray(dec.step(seq[t:t + 1])) for t in range(PROMPT, PROMPT + STEPS)]
    return np.concatenate(out)


# ---- against transformers ------------------------------------------------------------------------

@pytest.mark.parametrize("tp,impl", [(1, "gather"), (2, "gather"), (4, "gather"), (2, "matvec")])
def test_logits_match_transformers(hf, loaded, tp, impl):
    """Prefill (8 tokens: the dense-over-experts path of "gather") and teacher-forced decode
    steps (1 token: the gathered experts) against HF's forward, at TP 1, 2 and 4 (TP=4 > 2 KV
    heads: each KV head on 2 ranks; each expert split 4 ways)."""
    path, _, seq, want = hf
    mesh, config, params = loaded(tp)
    assert config == Qwen3MoeConfig.tiny()  # the checkpoint's config.json is the tiny preset
    dec = Decoder(config.replace(moe_impl=impl), mesh, params)
    assert dec.family is QWEN3_MOE
    assert_close(_prefill_and_steps(dec, seq), want)


def test_tied_head_and_other_shapes_match_transformers(tmp_path):
    """A second config: tied embeddings, head_dim 32 != hidden / heads, top-3 without
    renormalisation, rope theta 1e6."""
    _need(2)
    model = _hf_model(seed=1, tie_word_embeddings=True, head_dim=32, num_experts_per_tok=3,
                      norm_topk_prob=False, rope_parameters={"rope_type": "default",
                                                             "rope_theta": 1e6})
    model.save_pretrained(str(tmp_path))
    mesh = make_mesh(2)
    config, params = QWEN3_MOE.load_hf_checkpoint(str(tmp_path), mesh)
    assert config.tie_word_embeddings and "lm_head" not in params
    assert (config.head_dim, config.num_experts_per_tok, config.norm_topk_prob) == (32, 3, False)
    seq = np.random.default_rng(3).integers(0, config.vocab_size, PROMPT + STEPS, dtype=np.int32)
    assert_close(_prefill_and_steps(Decoder(config, mesh, params), seq), _hf_logits(model, seq))


def _sifar_missing():
    try:
        import sifar_jax
    except Exception as e:  # noqa: BLE001 - not built
        return f"import sifar_jax failed: {e!r}"
    return None if hasattr(sifar_jax, "psum_add_rmsnorm") else "sifar_jax has no fused call"


@pytest.fixture
def sifar_clean():
    """One communicator per device and axis name: start and end with none."""
    import sifar_jax

    sifar_jax.shutdown()
    yield
    sifar_jax.shutdown()


@pytest.mark.skipif(_sifar_missing() is not None, reason=str(_sifar_missing()))
def test_every_allreduce_gives_transformers_greedy_tokens(hf, loaded, sifar_clean):
    """TP=2: lax.psum (with XLA's attention and with the Pallas decode kernel), sifar, sifar
    fused with the residual add and RMSNorm, and the in-decoder one-shot baseline
    (sifar:oneshot) produce HF's greedy tokens, each in another decode loop
    (so every loop runs the MoE too, at no extra compile)."""
    _, model, seq, _ = hf
    mesh, config, params = loaded(2)
    prompt = seq[:PROMPT]
    want = _hf_greedy(model, prompt, NEW)
    variants = {"psum": (dict(allreduce="psum"), "on_device"),
                "psum+pallas": (dict(allreduce="psum", attn_impl="pallas", kv_layout="bhsd"),
                                "stream"),
                "sifar": (dict(allreduce="sifar"), "pipelined"),
                "sifar+fused": (dict(allreduce="sifar", fused=True), "stream"),
                "sifar:oneshot": (dict(allreduce="sifar", algorithm="oneshot"), "sync")}
    got = {}
    for label, (kw, loop) in variants.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dec = Decoder(config, mesh, params, DecodeOptions(**kw))
            got[label] = dec.generate(prompt[None], NEW, loop=loop)[0]
        fallbacks = [str(w.message) for w in caught if "falling back" in str(w.message)]
        assert not fallbacks, f"{label} fell back, so it tested nothing: {fallbacks}"
    for label, tokens in got.items():
        np.testing.assert_array_equal(tokens, want, err_msg=label)


# ---- the expert implementations ----------------------------------------------------------------------

@pytest.mark.parametrize("tokens", [1, 16])
def test_expert_implementations_agree(tokens):
    """gather (N*k < E: gathered slices; else every expert, weighted), dense and matvec give the
    same outputs, and the same as a per-token NumPy loop over the chosen experts."""
    e, h, i, k = 8, 64, 32, 2
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, h)).astype(np.float32)
    router = (rng.standard_normal((h, e)) / 4).astype(np.float32)
    gate_up = (rng.standard_normal((e, h, 2, i)) / 8).astype(np.float32)
    down = (rng.standard_normal((e, i, h)) / 6).astype(np.float32)
    w, ids = qwen3_moe.route(jnp.asarray(x), jnp.asarray(router), k, True)
    w, ids = np.asarray(w), np.asarray(ids)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    want = np.zeros((tokens, h))
    for n in range(tokens):
        for j in range(k):
            g = x[n].astype(np.float64) @ gate_up[ids[n, j]].reshape(h, 2 * i)
            a = g[:i] / (1 + np.exp(-g[:i])) * g[i:]
            want[n] += w[n, j] * (a @ down[ids[n, j]])
    args = tuple(map(jnp.asarray, (x, w, ids, gate_up, down)))
    fns = (qwen3_moe.experts_gather, qwen3_moe.experts_dense,
           lambda *a: qwen3_moe.experts(*a, impl="gather", rows=2),  # two-row products
           *(lambda *a, impl=impl: qwen3_moe.experts(*a, impl=impl)
             for impl in qwen3_moe.MOE_IMPLS))
    for got in jax.jit(lambda *a: [fn(*a) for fn in fns])(*args):  # one compile
        assert_close(np.asarray(got), want, rtol=F32_RTOL if jax.default_backend() == "gpu" else 2e-5)


@pytest.mark.parametrize("impl", ["gather"])
def test_decoding_reads_only_the_chosen_experts(impl):
    """At one token the dots of "gather" see the k chosen experts' slices, never a whole expert
    table."""
    e, h, i, k = 8, 64, 32, 2
    jaxpr = jax.make_jaxpr(lambda *a: qwen3_moe.experts(*a, impl=impl))(
        jnp.zeros((1, h)), jnp.zeros((1, k)), jnp.zeros((1, k), jnp.int32),
        jnp.zeros((e, h, 2, i)), jnp.zeros((e, i, h)))
    eqns = jaxpr.eqns[0].params["jaxpr"].eqns if len(jaxpr.eqns) == 1 else jaxpr.eqns
    dots = [eq for eq in eqns if eq.primitive.name == "dot_general"]
    assert len(dots) >= 2
    for eq in dots:
        for v in eq.invars:
            assert v.aval.shape[:1] != (e,), eq


# ---- the loader ------------------------------------------------------------------------------------

def _same_params(a, b):
    la, lb = (jax.tree_util.tree_flatten_with_path(p)[0] for p in (a, b))
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def test_fused_expert_layout_and_round_trip(hf, loaded, tmp_path):
    """transformers 5's fused expert tensors (its state_dict as is) load to the same parameters
    as the per-expert checkpoint; our writer gives back HF's tensors in both layouts."""
    path, model, _, _ = hf
    mesh, config, params = loaded(2)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state  # transformers 5's layout
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    (fused_dir / "config.json").write_text(open(f"{path}/config.json").read())
    save_file(state, str(fused_dir / "model.safetensors"))
    _, from_fused = QWEN3_MOE.load_hf_checkpoint(str(fused_dir), mesh)
    _same_params(from_fused, params)

    from safetensors.numpy import load_file

    per_expert = load_file(f"{path}/model.safetensors")
    assert to_hf_tensors(params, config).keys() == per_expert.keys()
    for name, tensor in to_hf_tensors(params, config).items():
        np.testing.assert_array_equal(tensor, per_expert[name], err_msg=name)
    for name, tensor in to_hf_tensors(params, config, fused_experts=True).items():
        np.testing.assert_array_equal(tensor, state[name], err_msg=name)

    QWEN3_MOE.save_hf_checkpoint(params, config, str(tmp_path / "ours"), num_shards=2)
    config2, again = QWEN3_MOE.load_hf_checkpoint(str(tmp_path / "ours"), mesh)
    assert config2 == config
    _same_params(again, params)


def test_missing_tensor_is_named(hf, tmp_path):
    _need(2)
    path = hf[0]
    from safetensors.numpy import load_file

    tensors = load_file(f"{path}/model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(f"{path}/config.json").read())
    from models.weights.checkpoint import CheckpointError

    with pytest.raises(CheckpointError,
                       match=r"no tensor 'model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight'"):
        QWEN3_MOE.load_hf_checkpoint(str(tmp_path), make_mesh(2))


@pytest.mark.parametrize("change,match", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"shared_expert_intermediate_size": 128}, "shared expert"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"num_experts": 0}, "num_experts"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "biases"),
    ({"model_type": "qwen2_moe"}, "qwen2_moe"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "yarn"),
])
def test_unsupported_configs_are_refused(change, match):
    d = {**Qwen3MoeConfig.tiny().to_hf_config(), **change}
    with pytest.raises(NotImplementedError, match=match):
        Qwen3MoeConfig.from_hf_config(d)


def test_config_checks():
    assert Qwen3MoeConfig.from_hf_config(Qwen3MoeConfig.tiny().to_hf_config()) == Qwen3MoeConfig.tiny()
    # transformers 5 writes num_local_experts
    d = Qwen3MoeConfig.tiny().to_hf_config()
    d["num_local_experts"] = d.pop("num_experts")
    assert Qwen3MoeConfig.from_hf_config(d).num_experts == 8
    with pytest.raises(ValueError, match="moe_impl"):
        Qwen3MoeConfig.tiny(moe_impl="dense")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Qwen3MoeConfig.tiny(num_experts_per_tok=9)
    with pytest.raises(ValueError, match="moe_intermediate_size=30"):
        qwen3_moe.check_tp(Qwen3MoeConfig.tiny(moe_intermediate_size=30), 4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        qwen3_moe.check_tp(Qwen3MoeConfig.tiny(), 3)


# ---- the family, the presets, the CLI ------------------------------------------------------------------

def test_family_is_found_by_config_preset_and_checkpoint(hf):
    assert registry.FAMILIES["qwen3_moe"] is QWEN3_MOE
    assert registry.family_of(Qwen3MoeConfig.tiny()) is QWEN3_MOE
    assert registry.preset("qwen3_moe_tiny") == Qwen3MoeConfig.tiny()
    assert registry.preset("qwen3_30b_a3b") == Qwen3MoeConfig.qwen3_30b_a3b()
    assert registry.family_for_checkpoint(hf[0]) is QWEN3_MOE


def test_qwen3_30b_a3b_shapes_and_active_bytes():
    config = Qwen3MoeConfig.qwen3_30b_a3b()
    _, abstract = QWEN3_MOE.abstract_model(config)  # no allocation
    total = sum(a.size for a in jax.tree.leaves(abstract))
    assert total == 30_532_122_624  # the 30.5B Qwen publishes
    for tp in (1, 2, 4, 8):
        qwen3_moe.check_tp(config, tp)
    # a batch-1 step reads attention, norms, router, 8 of 128 experts and the LM head, plus one
    # embedding row: 3.0B parameters (Qwen's "3.3B activated" counts the whole embedding table)
    H, V, L = 2048, 151936, 48
    attn = H * (32 + 2 * 4) * 128 + 32 * 128 * H + 2 * 128
    experts = 8 * 3 * H * 768
    active = L * (attn + 2 * H + H * 128 + experts) + H + H + V * H
    assert QWEN3_MOE.step_weight_bytes(QWEN3_MOE.layout(config, 1)) == 2 * active
    assert round(active / 1e9, 1) == 3.0 and 3.3e9 < active - H + V * H < 3.4e9
    # TP=2 halves everything split (attention heads, experts, LM head), not the replicated rest
    replicated = L * (2 * 128 + 2 * H + H * 128) + H + H
    want = 2 * ((active - replicated) // 2 + replicated)
    assert QWEN3_MOE.step_weight_bytes(QWEN3_MOE.layout(config, 2)) == want


def test_bench_decode_takes_the_moe_preset_and_its_active_bytes():
    """bench.decode --preset qwen3_30b_a3b: the family's tp check, --moe-impl, and the weights a
    batch-1 step reads (the memory floor) counted over the routed experts only."""
    from bench.decode import settings as bd

    args = bd.parse_args(["--preset", "qwen3_30b_a3b", "--tp", "2", "--moe-impl", "gather",
                          "--allreduce", "psum"])
    s = bd.settings(args, "gpu", 2)
    config = s.config
    assert isinstance(config, Qwen3MoeConfig) and config.moe_impl == "gather"
    assert s.tp == (2,) and config.dtype == "bfloat16"
    active = QWEN3_MOE.step_weight_bytes(QWEN3_MOE.layout(config, 2))  # what bench.decode counts
    _, abstract = QWEN3_MOE.abstract_model(config)
    everything = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract))
    assert 0.04 < active / everything < 0.06  # ~3B of 30.5B, halved by TP=2
    with pytest.raises(SystemExit, match="not an MoE"):
        bd.settings(bd.parse_args(["--preset", "tiny", "--moe-impl", "gather"]), "cpu", 2)
    with pytest.raises(SystemExit, match="moe_intermediate_size"):
        bd.settings(bd.parse_args(["--preset", "qwen3_moe_tiny", "--tp", "3"]), "cpu", 8)
