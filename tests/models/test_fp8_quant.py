"""models/quant.py: the FP8 weight type through models/tp.py's project (on CPU: XLA's
dequantize-and-dot path of sifar_jax.fp8_matvec).

Per-channel quantization's error is within e4m3's rounding; `project` on an Fp8Weight equals the
einsum on its dequantized weight for each of the decoders' equations; under shard_map at TP=2,
column-parallel (qkv, gate_up with 128x128 blocks over an intermediate of 320: each rank's rows
start inside a block) and row-parallel (o, down: partial sums added by psum) shards give the
unsharded product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from models.core.tp import project
from models.weights.types import E4M3, Fp8Weight, dequantize, quantize_fp8
from sifar_jax import fp8_matvec as f8

# (equation, x shape, einsum weight shape [*in, *out], contracted dims)
EQUATIONS = [("bth,hkgd->btkgd", (1, 1, 64), (64, 2, 3, 16), 1),  # qkv
             ("bthd,hdm->btm", (1, 1, 4, 16), (4, 16, 64), 2),  # o
             ("bth,hcf->btcf", (2, 1, 64), (64, 2, 48), 1),  # gate_up
             ("btf,fh->bth", (1, 1, 96), (96, 64), 1),  # down
             ("bth,hv->btv", (1, 1, 64), (64, 80), 1)]  # lm head


def rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_per_channel_quantization_error_is_e4m3_rounding():
    w = rand((64, 3, 40), 0) * np.linspace(0.01, 3, 40)  # channels of very different sizes
    qw = quantize_fp8(jnp.asarray(w), 1)
    assert qw.q.dtype == E4M3 and qw.q.shape == (3, 40, 64) and qw.scale.shape == (3, 40, 1)
    back = np.asarray(dequantize(qw, jnp.float32))
    scale = np.transpose(np.asarray(qw.scale), (2, 0, 1))  # [1, 3, 40] against w [64, 3, 40]
    # half an e4m3 ulp (3 mantissa bits) of a normal value, or of the smallest subnormal
    np.testing.assert_array_less(np.abs(back - w), 2.0 ** -4 * np.abs(w) + scale * 2.0 ** -10)
    assert np.abs(back - w).max() > 0  # it did quantize


@pytest.mark.parametrize("eq,xs,ws,n_in", EQUATIONS, ids=[e[0] for e in EQUATIONS])
def test_project_fp8_equals_einsum_on_dequantized(eq, xs, ws, n_in):
    x = jnp.asarray(rand(xs, 1), jnp.bfloat16)
    qw = quantize_fp8(jnp.asarray(rand(ws, 2)), n_in)
    got = jax.jit(lambda x, w: project(eq, x, w))(x, qw)
    want = jnp.einsum(eq, x.astype(jnp.float32), dequantize(qw, jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    assert got.shape == want.shape and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2 ** -7,
                               atol=1e-5)
    f32 = project(eq, x, qw, preferred_element_type=jnp.float32)
    assert f32.dtype == jnp.float32


def blocked_gate_up(seed=3):
    """gate_up [h=256 -> c=2, f=320] with 128x128 block scales, regridded to 32-row blocks so
    that each of 2 ranks' 160 rows starts on a block."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(np.clip(rng.standard_normal((2, 320, 256)) * 64, -448, 448), E4M3)
    scale = jnp.asarray(rng.uniform(0.5, 2, (2, 3, 2)).astype(np.float32) / 1024)
    fine = f8.regrid_scale(scale, (128, 128), 320, 256, (32, 128))
    return Fp8Weight(q, scale, 1, (128, 128)), Fp8Weight(q, fine, 1, (32, 128))


def test_tp2_column_and_row_parallel_shards_match_unsharded(cpu_mesh):
    mesh = cpu_mesh(2)
    x = jnp.asarray(rand((1, 1, 256), 4), jnp.bfloat16)
    coarse, fine = blocked_gate_up()
    full = project("bth,hcf->btcf", x, coarse)
    spec = Fp8Weight(P(None, "tp"), P(None, "tp"), 1, (32, 128))
    col = jax.jit(jax.shard_map(lambda x, w: project("bth,hcf->btcf", x, w), mesh=mesh,
                                in_specs=(P(), spec), out_specs=P(None, None, None, "tp")))
    np.testing.assert_array_equal(np.asarray(col(x, fine), np.float32),
                                  np.asarray(full, np.float32))
    # Row-parallel: down [f=320 -> h=64], each rank's 160 columns start inside a 128 block.
    rng = np.random.default_rng(5)
    q = jnp.asarray(np.clip(rng.standard_normal((64, 320)) * 64, -448, 448), E4M3)
    s = jnp.asarray(rng.uniform(0.5, 2, (1, 3)).astype(np.float32) / 1024)
    down = Fp8Weight(q, f8.regrid_scale(s, (128, 128), 64, 320, (128, 32)), 1, (128, 32))
    a = jnp.asarray(rand((1, 1, 320), 6), jnp.bfloat16)
    want = project("btf,fh->bth", a, Fp8Weight(q, s, 1, (128, 128)))
    dspec = Fp8Weight(P(None, "tp"), P(None, "tp"), 1, (128, 32))
    row = jax.jit(jax.shard_map(
        lambda a, w: jax.lax.psum(project("btf,fh->bth", a, w, preferred_element_type=jnp.float32),
                                  "tp"),
        mesh=mesh, in_specs=(P(None, None, "tp"), dspec), out_specs=P()))
    # each rank's partial is rounded to bf16 once: within 2 bf16 roundings of the largest value
    want = np.asarray(want, np.float32)
    np.testing.assert_allclose(np.asarray(row(a, down)), want, rtol=0,
                               atol=2 * 2.0 ** -8 * np.abs(want).max())


def test_bad_equation_is_a_clear_error():
    qw = quantize_fp8(jnp.asarray(rand((64, 32), 7)), 1)
    with pytest.raises(ValueError, match="contracted dims first"):
        project("bth,vh->btv", jnp.ones((1, 1, 32), jnp.bfloat16), qw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama_mlp_with_fp8_params_equals_its_dequantized_weights(dtype):
    """A family's module gains FP8 by holding Fp8Weight params: no per-call-site code."""
    from flax import nnx

    from models.llama import model as llama
    from models.llama import LlamaConfig

    c = LlamaConfig.tiny(dtype=dtype)
    fp8, ref = llama.MLP(c, rngs=nnx.Rngs(0)), llama.MLP(c, rngs=nnx.Rngs(0))
    for name in ("gate_up", "down"):
        qw = quantize_fp8(getattr(fp8, name)[...], 1)
        setattr(fp8, name, nnx.Param(qw))
        setattr(ref, name, nnx.Param(dequantize(qw, jnp.dtype(dtype))))
    x = jax.random.normal(jax.random.key(1), (1, 1, c.hidden_size), jnp.dtype(dtype))
    got, want = np.asarray(fp8(x), np.float32), np.asarray(ref(x), np.float32)
    # float32: the same sums' rounding only; bf16: the fp8 path keeps float32 sums and rounds
    # once where XLA's bf16 dot rounds its bf16 products' sum: within 2 bf16 roundings.
    tol = 1e-5 if dtype == "float32" else 2 * 2.0 ** -8
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())


def test_qwen3_moe_experts_with_fp8_stacks_equal_dequantized():
    """Expert stacks as Fp8Weight: the chosen experts read in place by fp8_matvec with ids."""
    from models.qwen3_moe import model as qwen3_moe
    from models.weights.types import dequantize_stack, quantize_fp8_stack

    e, h, i, n, k = 6, 64, 32, 2, 3
    gate_up = quantize_fp8_stack(jnp.asarray(rand((e, h, 2, i), 8)), 1)
    down = quantize_fp8_stack(jnp.asarray(rand((e, i, h), 9)), 1)
    assert gate_up.q.shape == (e, 2, i, h) and down.q.shape == (e, h, i)
    x = jnp.asarray(rand((n, h), 10))
    ids = jnp.asarray([[0, 3, 5], [2, 3, 1]], jnp.int32)
    weights = jnp.asarray(rand((n, k), 11))
    got = qwen3_moe.experts(x, weights, ids, gate_up, down)
    with jax.default_matmul_precision("highest"):  # XLA:GPU's default f32 dot is TF32
        want = qwen3_moe.experts(x, weights, ids, dequantize_stack(gate_up, jnp.float32),
                                 dequantize_stack(down, jnp.float32), impl="matvec")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=1e-5 * np.abs(np.asarray(want)).max())


def test_a_contracted_size_the_gemv_cannot_read_is_named():
    """K = 8 on a rank (e.g. experts 32 wide at TP 4): the error names the projection and what
    to change, at trace time."""
    w = quantize_fp8(jnp.asarray(rand((8, 16), 3)), 1)
    with pytest.raises(ValueError, match=r"'btf,fh->bth'.*8 contracted columns.*multiple of 16"):
        project("btf,fh->bth", jnp.asarray(rand((1, 1, 8), 4)), w)


def test_an_expert_stack_the_gemv_cannot_read_is_named():
    from models.weights.types import matvec_fp8, quantize_fp8_stack

    stack = quantize_fp8_stack(jnp.asarray(rand((4, 8, 16), 5)), 1)  # 4 experts, K = 8
    with pytest.raises(ValueError, match=r"the experts' down of in dims \(8,\): 8 contracted"):
        matvec_fp8(jnp.asarray(rand((2, 8), 6)), stack, jnp.asarray([0, 3]), "the experts' down")


def test_quantizing_a_model_whose_shard_the_gemv_cannot_read_names_it_before_any_trace():
    """qwen3_moe_tiny's experts are 32 wide: at TP=4 a rank's down has 8 contracted columns.
    quantize="fp8" says so while quantizing (the weight, the TP size, what to change), not as a
    traceback from inside the decoder's trace; TP=2 (16 columns) quantizes."""
    from models import registry
    from models import make_mesh

    config = registry.preset("qwen3_moe_tiny")
    family = registry.family_of(config)
    with pytest.raises(ValueError, match=r"'down' has 8 contracted columns per rank at TP=4.*"
                                         r"multiple of 16"):
        family.random_params(config, make_mesh(4), quantize="fp8")
    params = family.random_params(config, make_mesh(2), quantize="fp8")
    assert any(isinstance(w, Fp8Weight) for w in jax.tree.leaves(
        params, is_leaf=lambda a: isinstance(a, Fp8Weight)))


def test_a_channels_scale_has_the_same_bits_from_numpy_jax_jit_and_the_loader():
    """max |w| x float32(1/448): XLA turns a division by 448 into that product, so writing it as
    one keeps quantize_params (jax) and load_hf_checkpoint(quantize="fp8") (numpy) bit-equal."""
    from models.weights.fp8_checkpoint import quantize_per_channel

    w = rand((96, 200), 7) * np.float32(3.7)
    via_np, via_jnp = quantize_fp8(w, 1), quantize_fp8(jnp.asarray(w), 1)
    via_jit = jax.jit(lambda v: quantize_fp8(v, 1))(jnp.asarray(w))
    q_ck, s_ck = quantize_per_channel(w.T)  # [N, K] as the checkpoint holds it
    for got in (via_jnp, via_jit):
        np.testing.assert_array_equal(np.asarray(got.scale).view(np.uint32),
                                      np.asarray(via_np.scale).view(np.uint32))
        np.testing.assert_array_equal(np.asarray(got.q).view(np.uint8),
                                      np.asarray(via_np.q).view(np.uint8))
    np.testing.assert_array_equal(s_ck.view(np.uint32), np.asarray(via_np.scale).view(np.uint32))
    np.testing.assert_array_equal(q_ck.view(np.uint8), np.asarray(via_np.q).view(np.uint8))
    # the scale is max |w| / 448 to within one float32 rounding
    amax = np.abs(w).max(axis=0)
    np.testing.assert_allclose(np.asarray(via_np.scale).ravel(), amax / 448, rtol=2 ** -23)
