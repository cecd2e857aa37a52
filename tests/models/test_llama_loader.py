"""Hugging Face checkpoint save/load round trips, sharded placement, random init, config parsing."""

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from models import LlamaConfig, load_hf_checkpoint, make_mesh, random_params, save_hf_checkpoint
from models import LLAMA
from models.core.config import RopeScaling
from models.core.sharding import replicate_kv


def _need(n):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices, have {len(jax.devices())} (conftest sets XLA_FLAGS)")


def _leaves(params):
    return jax.tree_util.tree_flatten_with_path(params)[0]


def _assert_same_params(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def _assert_sharded_as_specified(params, config, mesh):
    want = LLAMA.param_shardings(LLAMA.layout(config, mesh.shape["tp"]), mesh)
    for (path, x), (_, s) in zip(_leaves(params), _leaves(want)):
        assert x.sharding.is_equivalent_to(s, x.ndim), jax.tree_util.keystr(path)
        full = np.asarray(x)
        for shard in x.addressable_shards:  # every device holds exactly its slice
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])


@pytest.fixture(scope="module")
def tiny_tp2():
    _need(2)
    mesh = make_mesh(2)
    config = LlamaConfig.tiny()
    return config, mesh, random_params(config, mesh, seed=3)


@pytest.mark.parametrize("num_shards", [1, 2])
def test_round_trip_sharded_tp2(tmp_path, tiny_tp2, num_shards):
    config, mesh, params = tiny_tp2
    save_hf_checkpoint(params, config, str(tmp_path), num_shards=num_shards)
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    if num_shards == 1:
        assert files == ["model.safetensors"]
    else:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == files and len(files) == 2
        per_file = [set(load_file(str(tmp_path / f))) for f in files]
        assert not (per_file[0] & per_file[1]) and per_file[0] | per_file[1] == set(index["weight_map"])

    config2, loaded = load_hf_checkpoint(str(tmp_path), mesh)
    assert config2 == config
    _assert_same_params(loaded, params)
    _assert_sharded_as_specified(loaded, config, mesh)


def test_checkpoint_is_hf_layout(tmp_path, tiny_tp2):
    """Names and [out, in] shapes as transformers writes them, read back by safetensors itself."""
    config, _, params = tiny_tp2
    save_hf_checkpoint(params, config, str(tmp_path))
    t = load_file(str(tmp_path / "model.safetensors"))
    H, F, V, d = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    nh, nkv = config.num_heads, config.num_kv_heads
    expected = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        expected.update({
            p + "self_attn.q_proj.weight": (nh * d, H), p + "self_attn.k_proj.weight": (nkv * d, H),
            p + "self_attn.v_proj.weight": (nkv * d, H), p + "self_attn.o_proj.weight": (H, nh * d),
            p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
            p + "mlp.down_proj.weight": (H, F), p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,)})
    assert {k: v.shape for k, v in t.items()} == expected
    # head h of q_proj is query head h of KV group h // group: our qkv[:, h // g, h % g]
    qkv = np.asarray(params["layers"][0]["attn"]["qkv"])
    q = t["model.layers.0.self_attn.q_proj.weight"].reshape(nh, d, H)
    for h in range(nh):
        np.testing.assert_array_equal(q[h].T, qkv[:, h // config.group_size, h % config.group_size])
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_key_value_heads"] == nkv and cfg["rope_scaling"]["rope_type"] == "llama3"


def test_load_at_other_tp_gives_same_arrays(tmp_path, tiny_tp2):
    _need(4)
    config, _, params = tiny_tp2
    save_hf_checkpoint(params, config, str(tmp_path), num_shards=2)
    for tp in (1, 4):
        mesh = make_mesh(tp)
        _, loaded = load_hf_checkpoint(str(tmp_path), mesh)
        _assert_same_params(loaded, params)
        _assert_sharded_as_specified(loaded, config, mesh)


def test_replicated_kv_heads_load_save_and_random_init(tmp_path, tiny_tp2):
    """tp=8 > num_kv_heads=4: every KV head on 2 ranks, each with half its group's query heads.
    Loading, saving and random init all give the same model as at tp=2."""
    _need(8)
    config, _, p2 = tiny_tp2
    mesh8 = make_mesh(8)
    save_hf_checkpoint(p2, config, str(tmp_path))
    _, loaded = load_hf_checkpoint(str(tmp_path), mesh8)
    _assert_sharded_as_specified(loaded, config, mesh8)
    g = config.group_size
    for i in range(config.num_layers):
        qkv2 = np.asarray(p2["layers"][i]["attn"]["qkv"])  # [H, 4, g + 2, d]
        qkv8 = np.asarray(loaded["layers"][i]["attn"]["qkv"])  # [H, 8, g / 2 + 2, d]
        for j in range(8):  # copy j of KV head j // 2: query heads (j % 2) * g/2 ..., then k, v
            head, half = divmod(j, 2)
            np.testing.assert_array_equal(qkv8[:, j, :g // 2], qkv2[:, head, half * g // 2:(half + 1) * g // 2])
            np.testing.assert_array_equal(qkv8[:, j, g // 2:], qkv2[:, head, g:])
        np.testing.assert_array_equal(qkv8, replicate_kv(qkv2, 2))
    _assert_same_params(random_params(config, mesh8, seed=3), loaded)  # same values at every tp
    save_hf_checkpoint(loaded, config, str(tmp_path / "from8"))  # each KV head written once
    _, back = load_hf_checkpoint(str(tmp_path / "from8"), tiny_tp2[1])
    _assert_same_params(back, p2)


def test_bfloat16_round_trip_and_dtype_override(tmp_path):
    _need(2)
    mesh = make_mesh(2)
    config = LlamaConfig.tiny(dtype="bfloat16", tie_word_embeddings=True)
    params = random_params(config, mesh, seed=4)
    save_hf_checkpoint(params, config, str(tmp_path))
    assert load_file(str(tmp_path / "model.safetensors"))["model.norm.weight"].dtype == ml_dtypes.bfloat16
    config2, loaded = load_hf_checkpoint(str(tmp_path), mesh)
    assert config2.dtype == "bfloat16" and "lm_head" not in loaded
    _assert_same_params(loaded, params)
    _, as_f32 = load_hf_checkpoint(str(tmp_path), mesh, dtype="float32")
    for (_, a), (_, b) in zip(_leaves(as_f32), _leaves(params)):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(np.float32))


def test_random_params_sharded_nonzero_and_tp_independent():
    _need(4)
    config = LlamaConfig.tiny()
    p2 = random_params(config, make_mesh(2), seed=0)
    p4 = random_params(config, make_mesh(4), seed=0)
    _assert_sharded_as_specified(p2, config, make_mesh(2))
    _assert_same_params(p2, p4)  # same model whatever the TP size: comparable benchmarks
    for path, x in _leaves(p2):
        assert np.all(np.asarray(x) != 0), jax.tree_util.keystr(path)
    other = random_params(config, make_mesh(2), seed=1)
    assert not np.array_equal(np.asarray(other["embed"]), np.asarray(p2["embed"]))


def test_missing_tensor_is_named(tmp_path, tiny_tp2):
    config, mesh, params = tiny_tp2
    save_hf_checkpoint(params, config, str(tmp_path))
    t = load_file(str(tmp_path / "model.safetensors"))
    del t["model.layers.1.mlp.up_proj.weight"]
    from safetensors.numpy import save_file

    save_file(t, str(tmp_path / "model.safetensors"))
    from models.weights.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="no tensor 'model.layers.1.mlp.up_proj.weight' in "
                                              "model.safetensors"):
        load_hf_checkpoint(str(tmp_path), mesh)


def test_hf_config_variants():
    c = LlamaConfig.llama3_8b()
    assert LlamaConfig.from_hf_config(c.to_hf_config()) == c
    assert c.head_dim == 128 and c.group_size == 4
    assert c.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    # transformers 5 puts theta and scaling in rope_parameters
    d = c.to_hf_config()
    d.pop("rope_theta")
    d["rope_parameters"] = dict(d.pop("rope_scaling"), rope_theta=500000.0)
    assert LlamaConfig.from_hf_config(d) == c
    # Llama 3.1's trained context is 131072; the KV cache default stays at 8192
    assert LlamaConfig.from_hf_config({**c.to_hf_config(), "max_position_embeddings": 131072}).max_seq_len == 8192
    plain = {**c.to_hf_config(), "rope_scaling": None}
    assert LlamaConfig.from_hf_config(plain).rope_scaling is None
    with pytest.raises(NotImplementedError, match="yarn"):
        LlamaConfig.from_hf_config({**c.to_hf_config(), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
