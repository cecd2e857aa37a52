"""sifar_jax.llama_step with bf16 weights: the same op, kernel and CPU reference as the FP8
step's (tests/models/test_persistent.py), a 16-byte chunk of a row holding 8 weights instead
of 16. The bf16 step runs on the FP8 model's weights converted exactly (every e4m3 value is a
bf16 value) with the same scales, so its sums are the FP8 step's in another chunking: equal to
float32 rounding, its outputs within a few bf16 roundings. On the CPU the op's reference
handler, on a GPU the kernel (and its bits against the CPU's at the first slot).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sifar_jax
from models import make_mesh
from models.llama import step as persistent
from models.registry import FAMILIES

LLAMA = FAMILIES["llama"]
BOUND = 1e-2  # of the largest value: a few bf16 roundings apart after 2 layers


def _gpu() -> bool:
    return any(d.platform == "gpu" for d in jax.devices())


@pytest.fixture(scope="module")
def operands():
    """(config, FP8 op operands, the same as bf16): x, rope, final norm, layers, cache, head."""
    from flax import nnx

    # bf16 rows of 2048 bytes (qkv, gate_up, the head: one whole 2 KiB slab of the ring), 3072
    # (down: a whole slab, then a partial one) and 1024 (o: a partial slab only)
    cfg = LLAMA.preset("tiny", dtype="bfloat16", hidden_size=1024, num_heads=4, num_kv_heads=2,
                       head_dim=128, intermediate_size=1536, num_layers=2, vocab_size=384,
                       max_seq_len=64)
    params = LLAMA.random_params(cfg, make_mesh(1), seed=3, quantize="fp8")
    model = nnx.merge(LLAMA.abstract_model(LLAMA.layout(cfg, 1).shapes)[0], params)
    layers = [persistent._layer_operands(b) for b in model.layers]
    head = persistent.head_operands(model, cfg)
    bf = lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float8_e4m3fn else a  # noqa: E731
    layers16 = [sifar_jax.LlamaLayer(*(bf(a) for a in layer)) for layer in layers]
    cache = jax.random.uniform(jax.random.key(5), (2, 2, 1, 2, 64, 128), jnp.float32, -1, 1)
    rope = jnp.stack([jnp.cos(jnp.arange(128.0) / 7), jnp.sin(jnp.arange(128.0) / 7)])
    common = (model.embed[...][11], rope, model.norm.weight[...])
    return (cfg, (*common, layers, cache.astype(jnp.bfloat16), head),
            (*common, layers16, cache.astype(jnp.bfloat16), (bf(head[0]), head[1])))


def _run(ops, pos, ranks=1, **kw):
    x, rope, fnorm, layers, cache, head = ops
    args = (x, rope, jnp.array([pos, 0], jnp.int32), fnorm, layers, cache)
    common = dict(kv_heads=2, group=2, eps=1e-5, head=head)
    if ranks == 1:
        h, c, logits = sifar_jax.llama_step(*args, **common)
    else:
        h, c, logits, _ = sifar_jax.llama_step_virtual_ranks(*args, ranks=ranks, **common, **kw)
    return (np.asarray(h, np.float32), np.asarray(c, np.float32), np.asarray(logits))


def test_the_conversion_is_exact(operands):
    _, fp8, b16 = operands
    for a, b in zip(fp8[3][0], b16[3][0]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("pos", [0, 40])
def test_bf16_weights_give_the_fp8_steps_values(operands, pos, ranks):
    """h, the cache and the logits of the bf16 step against the FP8 step on the same values."""
    _, fp8, b16 = operands
    (h8, c8, l8), (h16, c16, l16) = _run(fp8, pos, ranks), _run(b16, pos, ranks)
    assert np.isfinite(l16).all() and np.abs(l16).max() > 0
    for a, b in ((h16, h8), (c16, c8), (l16, l8)):
        assert np.abs(a - b).max() <= BOUND * np.abs(b).max()
    # layer 0's key and value at the slot: norm and qkv only, 16- against 8-weight chunks
    assert np.abs(c16[0, :, 0, :, pos] - c8[0, :, 0, :, pos]).max() <= 1e-2


def test_bf16_head_logits(operands):
    """The head's logits: its bf16 rows times h times the scale (float64 within float32)."""
    _, _, b16 = operands
    h, _, logits = _run(b16, 5)
    w, s = b16[5]
    want = (np.asarray(w, np.float64) @ h.astype(np.float64)) * np.asarray(s, np.float64)
    assert np.abs(logits - want).max() <= 1e-5 * np.abs(want).max()


def test_one_weight_type_per_step(operands):
    _, fp8, b16 = operands
    x, rope, fnorm, layers, cache, head = b16
    pos = jnp.array([0, 0], jnp.int32)
    kw = dict(kv_heads=2, group=2, eps=1e-5)
    mixed = [layers[0]._replace(down=fp8[3][0].down), layers[1]]
    with pytest.raises(ValueError, match=r"layer 0 down must be bfloat16 \[1024, 1536\]"):
        sifar_jax.llama_step(x, rope, pos, fnorm, mixed, cache, **kw)
    with pytest.raises(ValueError, match=r"head must be bfloat16 \[V, 1024\] \(the layers' weight type\)"):
        sifar_jax.llama_step(x, rope, pos, fnorm, layers, cache, head=fp8[5], **kw)
    f32 = [layer._replace(qkv=layer.qkv.astype(jnp.float32)) for layer in layers]
    with pytest.raises(ValueError, match="must be float8_e4m3fn or bfloat16"):
        sifar_jax.llama_step(x, rope, pos, fnorm, f32, cache, **kw)


@pytest.mark.skipif(not _gpu(), reason="needs a GPU")
def test_gpu_bits_equal_cpu_at_the_first_slot(operands):
    """At slot 0 the step is GEMVs, norms, RoPE and SwiGLU: layer 0's key and value bit for bit
    (the kernel's bf16 chunks in the CPU reference's order); h nearly everywhere (expf may
    differ by an ulp), the logits bit for bit where h is."""
    _, _, b16 = operands
    out = {}
    for dev in (jax.devices("gpu")[0], jax.devices("cpu")[0]):
        out[dev.platform] = _run(jax.device_put(b16, dev), 0)
    (h_g, c_g, l_g), (h_c, c_c, l_c) = out["gpu"], out["cpu"]
    np.testing.assert_array_equal(c_g[0, :, 0, :, 0], c_c[0, :, 0, :, 0])
    assert (h_g != h_c).mean() <= 0.01
    if (h_g == h_c).all():
        np.testing.assert_array_equal(l_g.view(np.uint32), l_c.view(np.uint32))
    assert np.abs(l_g - l_c).max() <= 1e-2 * np.abs(l_c).max()
