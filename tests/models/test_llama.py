"""The Flax Llama decoder against an independent float64 NumPy forward pass, and across TP sizes
and all-reduce implementations (tiny preset, float32, 8 host CPU devices from conftest.py)."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from models import LLAMA, Decoder, LlamaConfig, load_hf_checkpoint, make_mesh
from models.core.attention import Attention, Step, rope_inv_freq
from models.core.sharding import kv_replicas
from models.core.tp import make_allreduce
from models.decoder.capacity import prompt_bucket
from models.decoder.options import DecodeOptions
from models.llama import model as llama
from models.llama.hf import to_hf_tensors as hf_tensors

# The tiny preset as a Hugging Face config.json, written out by hand so the parser is tested too.
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 4, "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 128,
    "torch_dtype": "float32", "hidden_act": "silu",
}
STEPS = 64


def _need(n):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices, have {len(jax.devices())} (conftest sets XLA_FLAGS)")


def _sifar_missing():
    try:
        import sifar_jax
    except Exception as e:  # not built yet, or no extension for this platform
        return f"import sifar_jax failed: {e!r}"
    if not hasattr(sifar_jax, "sifar_psum"):
        return "sifar_jax has no sifar_psum yet"
    return None


# ---- independent reference (HF layout, float64, full causal forward, no cache) ------------------

def random_hf_weights(cfg: dict, seed: int, tied: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    H, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = H // nh

    def lin(out, inp):
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm():  # random, never all ones, so a swapped norm weight is caught
        return (1.0 + 0.2 * rng.standard_normal(H)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32),
         "model.norm.weight": norm()}
    if not tied:
        w["lm_head.weight"] = lin(V, H)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = lin(nh * d, H)
        w[p + "self_attn.k_proj.weight"] = lin(nkv * d, H)
        w[p + "self_attn.v_proj.weight"] = lin(nkv * d, H)
        w[p + "self_attn.o_proj.weight"] = lin(H, nh * d)
        w[p + "mlp.gate_proj.weight"] = lin(F, H)
        w[p + "mlp.up_proj.weight"] = lin(F, H)
        w[p + "mlp.down_proj.weight"] = lin(H, F)
        w[p + "input_layernorm.weight"] = norm()
        w[p + "post_attention_layernorm.weight"] = norm()
    return w


def ref_inv_freq(cfg: dict) -> np.ndarray:
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / cfg["rope_theta"] ** (np.arange(0, d, 2) / d)
    s = cfg.get("rope_scaling")
    if not s:
        return freqs
    out = []
    for f in freqs:  # the Llama 3.1 reference recipe, one frequency at a time
        wavelen = 2 * np.pi / f
        orig = s["original_max_position_embeddings"]
        if wavelen < orig / s["high_freq_factor"]:
            out.append(f)
        elif wavelen > orig / s["low_freq_factor"]:
            out.append(f / s["factor"])
        else:
            smooth = (orig / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            out.append((1 - smooth) * f / s["factor"] + smooth * f)
    return np.array(out)


def ref_logits(w: dict, cfg: dict, tokens: np.ndarray) -> np.ndarray:
    """tokens [T] -> logits [T, vocab], float64."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    H, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, eps, T = H // nh, cfg["rms_norm_eps"], len(tokens)

    def rms(x, g):
        return g * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)

    def rope(x):  # x [T, heads, d]; rotate_half convention
        ang = np.arange(T)[:, None] * ref_inv_freq(cfg)[None, :]
        cos = np.cos(np.concatenate([ang, ang], -1))[:, None, :]
        sin = np.sin(np.concatenate([ang, ang], -1))[:, None, :]
        rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
        return x * cos + rot * sin

    x = w["model.embed_tokens.weight"][tokens]
    causal = np.tril(np.ones((T, T), bool))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, nh, d))
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, d))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, d)
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)  # HF repeat_kv
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
        s = np.where(causal, s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", pr, v).reshape(T, nh * d)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T


# float32 against float64: JAX's default matmul precision runs float32 dots as TF32 on GPUs (10
# mantissa bits: measured 8e-4 of the logits' scale on an H200), exactly on the CPU.
F32_RTOL = 5e-3 if jax.default_backend() == "gpu" else 1e-4


def assert_close_ref(got, want, rtol=F32_RTOL):
    # relative to the logits' scale: float32 vs float64 over a 2-layer model
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


# ---- fixtures ---------------------------------------------------------------------------------------

def _write_checkpoint(path, cfg, weights):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(weights, str(path / "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    weights = random_hf_weights(HF_CONFIG, seed=1)
    path = _write_checkpoint(tmp_path_factory.mktemp("tiny"), HF_CONFIG, weights)
    return path, weights


@pytest.fixture(scope="module")
def loaded(hf):
    """tp -> (mesh, config, params), loaded once per TP size."""
    cache = {}

    def get(tp):
        _need(tp)
        if tp not in cache:
            mesh = make_mesh(tp)
            config, params = load_hf_checkpoint(hf[0], mesh)
            cache[tp] = mesh, config, params
        return cache[tp]

    return get


@pytest.fixture(scope="module")
def sequence():
    return np.random.default_rng(7).integers(0, HF_CONFIG["vocab_size"], STEPS, dtype=np.int32)


@pytest.fixture(scope="module")
def reference(hf, sequence):
    return ref_logits(hf[1], HF_CONFIG, sequence)


@pytest.fixture(scope="module")
def baseline(loaded, sequence):
    """TP=1 lax.psum: teacher-forced logits of every step, and greedy tokens."""
    mesh, config, params = loaded(1)
    dec = Decoder(config, mesh, params)
    return dec.teacher_forced_logits(sequence[None]), dec.generate(sequence[None, :8], STEPS)


# ---- tests ------------------------------------------------------------------------------------------

def test_hf_config_is_tiny_preset():
    assert LlamaConfig.from_hf_config(HF_CONFIG) == LlamaConfig.tiny()


def test_rope_frequencies_match_reference():
    for cfg in (HF_CONFIG, LlamaConfig.llama3_8b().to_hf_config()):
        config = LlamaConfig.from_hf_config(cfg)
        np.testing.assert_allclose(rope_inv_freq(config), ref_inv_freq(cfg), rtol=1e-6)
    # the tiny preset exercises all three regimes of the Llama 3 scaling
    inv, base = ref_inv_freq(HF_CONFIG), ref_inv_freq({**HF_CONFIG, "rope_scaling": None})
    ratio = base / inv
    assert (ratio == 1).any() and (np.isclose(ratio, 4.0)).any()
    assert ((ratio > 1) & ~np.isclose(ratio, 4.0)).any()


@pytest.mark.parametrize("tp,attn", [(1, "xla"), (2, "xla"), (8, "xla"), (1, "pallas"),
                                     (8, "pallas")])  # tp=8 > num_kv_heads=4: each KV head on 2 ranks
def test_prefill_and_decode_match_numpy_reference(loaded, sequence, reference, tp, attn):
    """attn="pallas": the steps attend through JAX's Pallas decode kernel (its interpreter off
    GPUs; the bhsd cache layout it reads)."""
    mesh, config, params = loaded(tp)
    kw = dict(attn_impl="pallas", kv_layout="bhsd") if attn == "pallas" else {}
    dec = Decoder(config, mesh, params, DecodeOptions(**kw))
    n_prompt, n_steps = 8, 8
    prefill = np.asarray(dec.prefill(sequence[None, :n_prompt]))[0]
    assert_close_ref(prefill, reference[:n_prompt])
    for t in range(n_prompt, n_prompt + n_steps):
        step = np.asarray(dec.step(sequence[t:t + 1]))[0]
        assert_close_ref(step, reference[t])


def test_batch_of_two_matches_reference(hf, loaded):
    mesh, config, params = loaded(2)
    seqs = np.random.default_rng(3).integers(0, 256, (2, 12), dtype=np.int32)
    dec = Decoder(config, mesh, params, batch_size=2)
    got = np.concatenate([np.asarray(dec.prefill(seqs[:, :6]))] +
                         [np.asarray(dec.step(seqs[:, t]))[:, None] for t in range(6, 12)], axis=1)
    for b in range(2):
        assert_close_ref(got[b], ref_logits(hf[1], HF_CONFIG, seqs[b]))


def test_tied_embeddings_match_reference(tmp_path):
    _need(2)
    cfg = {**HF_CONFIG, "tie_word_embeddings": True}
    weights = random_hf_weights(cfg, seed=5, tied=True)
    mesh = make_mesh(2)
    config, params = load_hf_checkpoint(_write_checkpoint(tmp_path, cfg, weights), mesh)
    assert config.tie_word_embeddings and "lm_head" not in params
    tokens = np.random.default_rng(4).integers(0, 256, 16, dtype=np.int32)
    got = Decoder(config, mesh, params).teacher_forced_logits(tokens[None])[0]
    assert_close_ref(got, ref_logits(weights, cfg, tokens))


def _check_against_baseline(baseline, reference, sequence, config, mesh, params, **kw):
    logits0, tokens0 = baseline
    dec = Decoder(config, mesh, params, DecodeOptions(**kw))
    logits = dec.teacher_forced_logits(sequence[None])
    assert logits.shape == (1, STEPS, config.vocab_size)
    # same logits as TP=1 at every one of the 64 steps, up to float32 summation order
    scale = np.abs(logits0).max()
    for t in range(STEPS):
        np.testing.assert_allclose(logits[0, t], logits0[0, t], rtol=2e-5, atol=2e-6 * scale,
                                   err_msg=f"step {t}")
    assert_close_ref(logits[0], reference)
    np.testing.assert_array_equal(dec.generate(sequence[None, :8], STEPS), tokens0)


@pytest.mark.parametrize("tp", [2, 4])
def test_psum_tp_matches_single_device(baseline, reference, loaded, sequence, tp):
    mesh, config, params = loaded(tp)
    _check_against_baseline(baseline, reference, sequence, config, mesh, params, allreduce="psum")


@pytest.fixture
def sifar_clean():
    """sifar_jax allows one communicator per device and axis name: start and end each test with
    none, since the TP=2 and TP=4 meshes share devices."""
    import sifar_jax

    sifar_jax.shutdown()
    yield
    sifar_jax.shutdown()


@pytest.mark.skipif(_sifar_missing() is not None, reason=str(_sifar_missing()))
@pytest.mark.parametrize("tp", [2, 4])
def test_sifar_tp_matches_single_device(baseline, reference, loaded, sequence, tp, sifar_clean):
    mesh, config, params = loaded(tp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _check_against_baseline(baseline, reference, sequence, config, mesh, params,
                                allreduce="sifar", algorithm="auto")
    fallbacks = [str(w.message) for w in caught if "falling back" in str(w.message)]
    assert not fallbacks, f"sifar fell back to lax.psum, so this tested nothing: {fallbacks}"


def test_identity_allreduce_is_the_switch(loaded, sequence):
    tokens = sequence[None, :8]
    mesh, config, params = loaded(1)
    psum1 = Decoder(config, mesh, params).teacher_forced_logits(tokens)
    ident1 = Decoder(config, mesh, params, allreduce="identity").teacher_forced_logits(tokens)
    np.testing.assert_array_equal(ident1, psum1)  # a sum over one device is the identity
    mesh, config, params = loaded(2)
    ident2 = Decoder(config, mesh, params, allreduce="identity").teacher_forced_logits(tokens)
    assert np.isfinite(ident2).all() and not np.allclose(ident2, psum1, atol=1e-2)


def test_state_is_donated_and_updated_in_place(loaded):
    mesh, config, params = loaded(2)
    dec = Decoder(config, mesh, params)
    dec.start(np.array([[1, 2, 3]], np.int32))
    old = jax.tree.leaves(dec.state)
    pointers = [s.data.unsafe_buffer_pointer() for a in old for s in a.addressable_shards]
    dec.advance(2)
    assert all(a.is_deleted() for a in old), "decode state was not donated"
    new = jax.tree.leaves(dec.state)
    # every per-step buffer (cache, token, position, key, flags) keeps its address
    assert [s.data.unsafe_buffer_pointer() for a in new for s in a.addressable_shards] == pointers
    assert dec.state["tok"].shape == (1, 1) and dec.state["tok"].sharding.is_fully_replicated
    assert int(dec.state["pos"]) == prompt_bucket(3) + 2  # the prompt left-padded to its bucket


def test_kv_heads_replicated_when_tp_exceeds_them(loaded, hf):
    """tp=8 > num_kv_heads=4: the layout of an 8-KV-head model, each head copied to 2 ranks,
    and the checkpoint is read back unchanged."""
    mesh, config, params = loaded(8)
    assert kv_replicas(config, 8) == 2
    assert params["layers"][0]["attn"]["qkv"].shape == (128, 8, 1 + 2, 16)
    tensors = hf_tensors(params, config)
    for name, want in hf[1].items():
        np.testing.assert_array_equal(tensors[name], want, err_msg=name)


def test_shard_map_checks_varying_axes(loaded):
    """check_vma=True: shard_map checks every out_spec against the values' varying axes."""
    mesh, config, params = loaded(2)
    layout = LLAMA.layout(config, 2)
    fwd = LLAMA.make_forward(layout, mesh)
    cache = LLAMA.init_cache(layout, mesh, 1, 64)
    jaxpr = jax.make_jaxpr(fwd)(params, cache, np.zeros((1, 1), np.int32),
                                np.zeros(1, np.int32), {})
    maps = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    assert maps and all(e.params["check_vma"] for e in maps)
    # With the Pallas decode kernel (its results carry no varying axes) only a one-token call
    # is traced without the check; a prefill keeps it.
    fwd = LLAMA.make_forward(layout, mesh, DecodeOptions(attn_impl="pallas", kv_layout="bhsd"))
    cache = LLAMA.init_cache(layout, mesh, 1, 64, kv_layout="bhsd")
    for t, want in ((1, False), (4, True)):
        jaxpr = jax.make_jaxpr(fwd)(params, cache, np.zeros((1, t), np.int32),
                                    np.arange(t, dtype=np.int32), {})
        maps = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
        assert maps and all(e.params["check_vma"] is want for e in maps), t


def test_errors(loaded):
    mesh, config, params = loaded(1)
    with pytest.raises(ValueError, match="num_kv_heads"):
        llama.check_tp(config, 3)
    with pytest.raises(ValueError, match="num_heads"):
        llama.check_tp(config, 16)
    _need(8)
    with pytest.raises(ValueError, match="tp=8 layout"):
        Decoder(config, make_mesh(8), params)  # TP=1 parameters on an 8-way mesh
    with pytest.raises(ValueError, match="allreduce"):
        make_allreduce("nccl")
    with pytest.raises(ValueError, match="slot_bytes"):
        DecodeOptions(slot_bytes=1 << 16)  # psum has no slot
    dec = Decoder(config, mesh, params, max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len"):
        dec.prefill(np.zeros((1, 9), np.int32))


def test_llama3_8b_shapes():
    config = LlamaConfig.llama3_8b()
    _, abstract = LLAMA.abstract_model(config)  # no allocation
    assert sum(a.size for a in jax.tree.leaves(abstract)) == 8_030_261_248
    for tp in (1, 2, 4, 8):
        llama.check_tp(config, tp)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_matches_numpy_with_and_without_qk_norm(qk_norm):
    """The shared attention (one rank holding every head) against float64 NumPy: GQA, rotary
    embeddings, causal mask, and with qk_norm Qwen3's RMSNorm over head_dim on each query and key
    head before the rotation."""
    config = LlamaConfig.tiny()
    H, d, g, kv, T = config.hidden_size, config.head_dim, config.group_size, config.num_kv_heads, 6
    attn = Attention(config, rngs=nnx.Rngs(0), qk_norm=qk_norm)
    rng = np.random.default_rng(9)
    wq, wk = (1.0 + 0.3 * rng.standard_normal(d)).astype(np.float32), \
        (1.0 + 0.3 * rng.standard_normal(d)).astype(np.float32)
    if qk_norm:
        attn.q_norm.weight[...] = jnp.asarray(wq)
        attn.k_norm.weight[...] = jnp.asarray(wk)
    x = rng.standard_normal((1, T, H)).astype(np.float32)
    layers, layer = 3, 1  # the one cache array of three layers ("bshd"), this attention layer 1
    cache = jnp.full((layers, 2, 1, 16, kv, d), 0.25)
    step = Step.at(config, jnp.arange(T, dtype=jnp.int32))
    got, new_cache = attn(jnp.asarray(x), cache, layer, step)

    def rms(a, w):
        return w * a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + config.rms_norm_eps)

    def rope(a):  # a [T, ..., d]
        ang = np.arange(T)[:, None] * ref_inv_freq(HF_CONFIG)[None, :]
        ang = np.concatenate([ang, ang], -1).reshape(T, *([1] * (a.ndim - 2)), d)
        return a * np.cos(ang) + np.concatenate([-a[..., d // 2:], a[..., :d // 2]], -1) * np.sin(ang)

    qkv = np.einsum("th,hkgd->tkgd", x[0].astype(np.float64), np.asarray(attn.qkv[...], np.float64))
    q, k, v = qkv[:, :, :g], qkv[:, :, g], qkv[:, :, g + 1]
    if qk_norm:
        q, k = rms(q, wq), rms(k, wk)
    q, k = rope(q), rope(k)
    s = np.einsum("tkgd,skd->kgts", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("kgts,skd->tkgd", p, v).reshape(T, -1, d)
    want = np.einsum("thd,hdm->tm", out, np.asarray(attn.o[...], np.float64))
    assert_close_ref(np.asarray(got)[0], want)
    new_cache = np.asarray(new_cache)
    np.testing.assert_allclose(new_cache[layer, 0, 0, :T], k, rtol=F32_RTOL, atol=F32_RTOL)
    np.testing.assert_allclose(new_cache[layer, 1, 0, :T], v, rtol=F32_RTOL, atol=F32_RTOL)
    written = np.zeros(new_cache.shape, bool)
    written[layer, :, 0, :T] = True
    assert np.all(new_cache[~written] == 0.25), "a slot other than the layer's T was written"
    assert ("q_norm" in nnx.to_pure_dict(nnx.state(attn))) == qk_norm


# ---- the family interface ----------------------------------------------------------------------------

def test_llama_is_found_by_config_preset_and_checkpoint(hf, tmp_path):
    from models import registry

    assert registry.family_of(LlamaConfig.tiny()) is LLAMA and registry.FAMILIES["llama"] is LLAMA
    assert registry.preset("tiny") == LlamaConfig.tiny()
    assert registry.preset("llama3_8b", max_seq_len=64) == LlamaConfig.llama3_8b(max_seq_len=64)
    assert registry.family_for_checkpoint(hf[0]) is LLAMA
    with pytest.raises(TypeError, match="no model family"):
        registry.family_of(HF_CONFIG)
    with pytest.raises(ValueError, match="unknown preset"):
        registry.preset("nope")
    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIG, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        registry.family_for_checkpoint(str(tmp_path))


def test_no_module_of_models_uses_another_ones_private_names():
    """issue 25: models/ modules talk through public names only (no `weights._x`, no
    `from .llama import _y`)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "models"
    paths = sorted(root.rglob("*.py"))

    def dotted(path):  # models/core/tp.py -> ["core", "tp"], a package by its folder
        parts = path.relative_to(root).with_suffix("").parts
        return [p for p in parts if p != "__init__"]

    modules = {".".join(dotted(p)) for p in paths}
    found = []
    for path in paths:
        name = path.relative_to(root).as_posix()
        package = dotted(path) if path.name == "__init__.py" else dotted(path)[:-1]
        tree = ast.parse(path.read_text())
        aliases = set()  # local names bound to other modules of models
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[:len(package) - (node.level - 1)] + (
                    node.module.split(".") if node.module else [])
                for a in node.names:
                    if ".".join(base + [a.name]) in modules:
                        aliases.add(a.asname or a.name)
                    elif a.name.startswith("_"):
                        found.append(f"{name}: from {'.' * node.level}{node.module or ''} "
                                     f"import {a.name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                found.append(f"{name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert len(modules) > 10 and not found, found


@pytest.mark.parametrize("tp", [1, 2])
def test_gemm_rows_pads_single_row_projections_only(loaded, sequence, tp):
    """gemm_rows=2: a batch-1 step's projections run as two rows (the dots of its HLO say so),
    prefill is untouched, and the generated tokens and step logits equal gemm_rows=1's."""
    mesh, config, params = loaded(tp)
    one = Decoder(config, mesh, params, DecodeOptions(gemm_rows=1))
    two = Decoder(config, mesh, params, DecodeOptions(gemm_rows=2))
    prompt = sequence[:6]
    np.testing.assert_array_equal(two.generate(prompt, 10), one.generate(prompt, 10))
    layout = LLAMA.layout(config, tp)
    fwd = LLAMA.make_forward(layout, mesh, two.options, attend_len=64, last_only=True)
    cache = LLAMA.init_cache(layout, mesh, 1, 64)
    tok = jax.numpy.zeros((1, 1), jax.numpy.int32)
    pos = jax.numpy.zeros((1,), jax.numpy.int32)
    text = jax.jit(fwd).lower(params, cache, tok, pos, {}).as_text()
    # 4 projections per layer + the LM head, each on a [2, ...] operand
    assert text.count("stablehlo.dot_general") >= 4 * config.num_layers + 1
    assert "tensor<2x1x128x" in text, "the projections did not run as two rows"
    # prefill (8 rows) runs no padded projection: XLA:CPU's own run-to-run float32 noise only;
    # on GPUs each compile autotunes its own GEMMs, whose TF32 results differ by their rounding
    got, want = (d.teacher_forced_logits(sequence[None, :8]) for d in (two, one))
    if jax.default_backend() == "gpu":
        assert_close_ref(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
