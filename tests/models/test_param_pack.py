"""The decoder's small replicated vectors packed into one array per dtype (models/param_pack.py):
exact round trip, fewer arrays per call, the same tokens and logits, no added instruction, the
fused call's norm scales kept out (tiny presets, host CPU devices from conftest.py)."""

import collections
import re

import jax
import numpy as np
import pytest

import sifar_jax
from models import Decoder, LlamaConfig, make_mesh, random_params
from models.core.transformer import fused_norm_scale
from models.decoder import param_pack
from models.decoder.options import DecodeOptions
from models.qwen3_moe import Qwen3MoeConfig
from models.registry import family_of

PROMPT = np.array([5, 17, 3, 250, 99, 7, 42, 128], np.int32)
CONFIGS = {"llama": LlamaConfig.tiny, "qwen3_moe": Qwen3MoeConfig.tiny}


def _need(n):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices, have {len(jax.devices())}")


def _model(name, tp):
    _need(tp)
    config = CONFIGS[name]()
    mesh = make_mesh(tp)
    return config, mesh, family_of(config).random_params(config, mesh, seed=3)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pack_then_unpack_gives_every_leaf_back_bit_for_bit(name, tp):
    config, mesh, params = _model(name, tp)
    leaves = jax.tree.leaves(params)
    plan, arrays = param_pack.pack(leaves, mesh)
    norms = [a for a in leaves if a.ndim == 1 and a.sharding.is_fully_replicated]
    assert plan.n_packed == len(norms) > 0  # every norm scale, and no matmul's weight
    assert len(arrays) == len(leaves) - plan.n_packed + len(plan.groups)
    for dtype, members in plan.groups:
        for i, off, shape in members:
            a = leaves[i]
            assert str(a.dtype) == dtype and a.sharding.is_fully_replicated
            assert a.nbytes <= param_pack.MAX_BYTES and off % param_pack.ALIGN == 0
            assert a.ndim == 1
    for i in plan.kept:  # a sharded or large weight is passed as it is
        assert arrays[plan.kept.index(i)] is leaves[i]
    for packed in arrays[len(plan.kept):]:
        assert packed.sharding.is_fully_replicated
    back = jax.jit(lambda a: param_pack.unpack(plan, a))(arrays)
    assert len(back) == len(leaves)
    for a, b in zip(leaves, back):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_unpack_refuses_arrays_of_another_plan():
    config, mesh, params = _model("llama", 1)
    plan, arrays = param_pack.pack(jax.tree.leaves(params), mesh)
    with pytest.raises(ValueError, match="unpack"):
        param_pack.unpack(plan, arrays[:-1])


def test_only_vectors_are_packed_and_a_dtype_needs_two():
    """bfloat16 and int32 vectors packed per dtype (padded to ALIGN), bit for bit; a lone
    float32 vector, a small matrix and leaves the caller keeps stay as they are."""
    mesh = make_mesh(1)
    rng = np.random.default_rng(0)
    bf16 = [jax.numpy.asarray(rng.standard_normal(n), jax.numpy.bfloat16) for n in (100, 64, 3)]
    leaves = [jax.numpy.ones((8,), jax.numpy.float32), *bf16,
              jax.numpy.arange(8, dtype=jax.numpy.int32), jax.numpy.ones((4, 4)),
              jax.numpy.arange(4, dtype=jax.numpy.int32), jax.numpy.ones((5,), jax.numpy.int32)]
    keep = [False] * len(leaves)
    keep[-1] = True
    plan, arrays = param_pack.pack(leaves, mesh, keep=keep)
    assert plan.kept == (0, 5, 7) and [d for d, _ in plan.groups] == ["bfloat16", "int32"]
    assert [a.shape for a in arrays[3:]] == [(4 * param_pack.ALIGN,), (2 * param_pack.ALIGN,)]
    back = jax.jit(lambda a: param_pack.unpack(plan, a))(arrays)
    for a, b in zip(leaves, back):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(b).view(np.uint8), np.asarray(a).view(np.uint8))


@pytest.mark.parametrize("name,tp", [("llama", 1), ("llama", 2), ("qwen3_moe", 2)])
def test_a_packed_decoder_gives_the_same_tokens_and_logits_with_fewer_arrays(name, tp):
    config, mesh, params = _model(name, tp)
    plain = Decoder(config, mesh, params, DecodeOptions(pack_params=False))
    packed = Decoder(config, mesh, params)
    assert packed.pack_params and not plain.pack_params
    assert len(packed.weights.leaves) < len(plain.weights.leaves) == len(jax.tree.leaves(params))
    for loop in ("sync", "pipelined", "on_device"):
        np.testing.assert_array_equal(packed.generate(PROMPT, 12, loop=loop, chunk=4),
                                      plain.generate(PROMPT, 12, loop=loop, chunk=4),
                                      err_msg=loop)
    np.testing.assert_array_equal(packed.teacher_forced_logits(PROMPT[None]),
                                  plain.teacher_forced_logits(PROMPT[None]))
    # the compiled steps take that many arrays (their entry computations' parameters), and
    # packing adds no other instruction there: each slice is fused into the norm that reads it
    ops = {}
    for name, dec in (("plain", plain), ("packed", packed)):
        entry = dec.compiled_step().as_text().split("\nENTRY ", 1)[1].split("\n}", 1)[0]
        arrays = len(dec.weights.leaves) + len(jax.tree.leaves(dec.state))
        assert entry.count(" parameter(") == arrays
        ops[name] = collections.Counter(
            m.group(1) for m in re.finditer(r"= \S+ ([a-z][\w-]*)\(", entry)
            if m.group(1) != "parameter")
    assert ops["packed"] == ops["plain"]


@pytest.fixture
def sifar_clean():
    sifar_jax.shutdown()
    yield
    sifar_jax.shutdown()


@pytest.mark.parametrize("name,packed", [("llama", 0), ("qwen3_moe", 4)])
def test_fused_keeps_the_norm_scales_its_call_takes(name, packed, sifar_clean):
    """Fused, a block's input and post norms and the final norm are the fused call's operands
    (a slice would be copied): Llama packs nothing then, Qwen3 its q and k norms (2 layers);
    the tokens are the unpacked fused decoder's."""
    config, mesh, params = _model(name, 2)
    if not hasattr(sifar_jax, "psum_add_rmsnorm"):
        pytest.skip("the extension has no fused kernel")
    dec = Decoder(config, mesh, params, DecodeOptions(allreduce="sifar", fused=True))
    assert dec.pack_params and dec.weights.plan.n_packed == packed
    kept = [jax.tree_util.keystr(p) for p, a in jax.tree_util.tree_flatten_with_path(params)[0]
            if a.ndim == 1 and fused_norm_scale(p)]
    assert kept and all("norm" in k for k in kept)
    want = Decoder(config, mesh, params, DecodeOptions(allreduce="sifar", fused=True,
                                                       pack_params=False)).generate(PROMPT, 8)
    np.testing.assert_array_equal(dec.generate(PROMPT, 8), want)
