"""models/fp8_checkpoint.py: the hub's FP8 layouts read without torch, checked at load time.

Safetensors files with F8_E4M3 tensors written and read back bit for bit; quantization_config
parsed as transformers does (compressed-tensors float-quantized per tensor / per channel,
fine-grained FP8 with 128x128 blocks) and every unsupported variant refused by name; each bad
tensor (missing scale, wrong shape, non-finite or zero scale, e5m2 weight) a ValueError naming
it; a projection read from each layout and run through sifar_jax.fp8_matvec equals the product
with its dequantized weight; the round trip (read, write in the same layout, read) is exact.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from models.weights import fp8_checkpoint as fc
from sifar_jax import fp8_matvec as f8

E4M3 = ml_dtypes.float8_e4m3fn
CT = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
      "config_groups": {"group_0": {"targets": ["Linear"],
                                    "weights": {"num_bits": 8, "type": "float",
                                                "strategy": "channel", "symmetric": True}}}}
BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
         "weight_block_size": [128, 128]}


def fp8_tensors(scheme, n=320, k=256, seed=0):
    rng = np.random.default_rng(seed)
    q = np.clip(rng.standard_normal((n, k)) * 64, -448, 448).astype(E4M3)
    grid = {"block": ((n + 127) // 128, (k + 127) // 128), "channel": (n, 1), "tensor": (1, 1)}
    s = rng.uniform(0.5, 2, grid[scheme.strategy]).astype(np.float32) / 1024
    out = {}
    fc.write_fp8_weight(out, "model.layers.0.mlp.up_proj", q, s, scheme)
    if scheme.layout == "compressed-tensors":
        out["model.layers.0.mlp.up_proj.input_scale"] = np.ones((), np.float32)  # unused
    return out


def test_safetensors_float8_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    t = {"a": rng.standard_normal((3, 5)).astype(E4M3),
         "b": rng.standard_normal((7,)).astype(ml_dtypes.bfloat16),
         "c": rng.standard_normal((2, 2)).astype(np.float32)}
    p = str(tmp_path / "m.safetensors")
    fc.write_safetensors(p, t, {"format": "pt"})
    back = fc.read_safetensors(p)
    for name, a in t.items():
        assert back[name].dtype == a.dtype and back[name].shape == a.shape
        np.testing.assert_array_equal(back[name].view(np.uint8), a.view(np.uint8))
    from safetensors import safe_open  # the reference reader agrees on names and shapes

    with safe_open(p, framework="np") as f:
        assert sorted(f.keys()) == ["a", "b", "c"]


def test_quantization_configs():
    assert fc.parse_quantization_config({}) is None
    s = fc.parse_quantization_config({"quantization_config": CT})
    assert (s.layout, s.strategy, s.scale_suffix) == ("compressed-tensors", "channel", "weight_scale")
    assert not s.quantized("lm_head") and s.quantized("model.layers.0.mlp.up_proj")
    s = fc.parse_quantization_config({"quantization_config": BLOCK})
    assert (s.layout, s.strategy, s.block, s.scale_suffix) == ("fp8", "block", (128, 128),
                                                                "weight_scale_inv")
    bad = [({"quant_method": "gptq"}, "quant_method 'gptq'"),
           (dict(BLOCK, fmt="e5m2"), "fmt 'e5m2'"),
           (dict(BLOCK, weight_block_size=[128, 8]), "weight_block_size"),
           (dict(CT, format="pack-quantized"), "format 'pack-quantized'")]
    group = json.loads(json.dumps(CT))
    group["config_groups"]["group_0"]["weights"]["strategy"] = "group"
    bad.append((group, "strategy 'group'"))
    for qc, msg in bad:
        with pytest.raises(ValueError, match=msg):
            fc.parse_quantization_config({"quantization_config": qc})


@pytest.mark.parametrize("qc,strategy", [(CT, "channel"), (CT, "tensor"), (BLOCK, "block")])
def test_projection_from_each_layout_equals_dequantized_product(tmp_path, qc, strategy):
    qc = json.loads(json.dumps(qc))
    if qc["quant_method"] == "compressed-tensors":
        qc["config_groups"]["group_0"]["weights"]["strategy"] = strategy
    scheme = fc.parse_quantization_config({"quantization_config": qc})
    fc.write_safetensors(str(tmp_path / "model.safetensors"), fp8_tensors(scheme))
    tensors = fc.read_checkpoint_dir(str(tmp_path))
    q, s, block = fc.read_fp8_weight(tensors, "model.layers.0.mlp.up_proj", scheme)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 256)), jnp.float32)
    y = f8.fp8_matvec(x, jnp.asarray(q), jnp.asarray(s), block=block, impl="kernel")
    deq = np.asarray(q, np.float64) * np.repeat(np.repeat(s, block[0], 0)[:320], block[1], 1)[:, :256]
    want = np.asarray(x, np.float64) @ deq.T
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # round trip: written back in the layout it came from, read again: the same bits
    again = {}
    fc.write_fp8_weight(again, "m", q, s, scheme)
    fc.write_safetensors(str(tmp_path / "rt.safetensors"), again)
    q2, s2, b2 = fc.read_fp8_weight(fc.read_safetensors(str(tmp_path / "rt.safetensors")), "m",
                                    scheme)
    assert b2 == block
    np.testing.assert_array_equal(q2.view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(s2, s)


def test_bad_tensors_name_the_tensor():
    scheme = fc.parse_quantization_config({"quantization_config": BLOCK})
    good = fp8_tensors(scheme)
    m = "model.layers.0.mlp.up_proj"
    cases = [({k: v for k, v in good.items() if "scale" not in k}, f"{m}.weight_scale_inv: missing"),
             (dict(good, **{f"{m}.weight_scale_inv": np.ones((2, 2), np.float32)}),
              r"weight_scale_inv: shape \(2, 2\), expected \(3, 2\)"),
             (dict(good, **{f"{m}.weight_scale_inv": np.full((3, 2), np.nan, np.float32)}),
              "non-finite or zero"),
             (dict(good, **{f"{m}.weight_scale_inv": np.zeros((3, 2), np.float32)}),
              "non-finite or zero"),
             (dict(good, **{f"{m}.weight": good[f"{m}.weight"].astype(ml_dtypes.float8_e5m2)}),
              r"up_proj.weight: dtype F8_E5M2, expected F8_E4M3"),
             ({}, f"{m}.weight: missing")]
    for tensors, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fc.read_fp8_weight(tensors, m, scheme)


def test_quantize_per_channel_error_is_e4m3_rounding():
    w = np.random.default_rng(3).standard_normal((48, 64)).astype(np.float32)
    w[5] = 0  # an all-zero channel keeps scale 1
    q, s = fc.quantize_per_channel(w.astype(ml_dtypes.bfloat16))
    assert q.dtype == E4M3 and s.shape == (48, 1) and s[5, 0] == 1
    wb = w.astype(ml_dtypes.bfloat16).astype(np.float32)
    back = q.astype(np.float32) * s
    np.testing.assert_array_less(np.abs(back - wb), 2.0 ** -4 * np.abs(wb) + s * 2.0 ** -10)
