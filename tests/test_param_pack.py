"""The decoder's small replicated weights packed into one array per dtype (models/param_pack.py):
exact round trip, fewer arrays per call, the same tokens and logits, off when fused (tiny
presets, float32, host CPU devices from conftest.py)."""

import jax
import numpy as np
import pytest

import sifar_jax
from models import Decoder, LlamaConfig, make_mesh, param_pack, random_params
from models.families import family_of
from models.qwen3_moe import Qwen3MoeConfig

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
    assert plan.n_packed >= len(norms) > 0  # at least every norm scale
    assert len(arrays) == len(leaves) - plan.n_packed + len(plan.groups)
    for dtype, members in plan.groups:
        for i, off, shape in members:
            a = leaves[i]
            assert str(a.dtype) == dtype and a.sharding.is_fully_replicated
            assert a.nbytes <= param_pack.MAX_BYTES and off % param_pack.ALIGN == 0
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


def test_a_dtype_with_one_small_leaf_is_not_packed():
    mesh = make_mesh(1)
    leaves = [jax.numpy.ones((8,), jax.numpy.float32), jax.numpy.ones((8,), jax.numpy.int32),
              jax.numpy.ones((4,), jax.numpy.int32)]
    plan, arrays = param_pack.pack(leaves, mesh)
    assert plan.kept == (0,) and [d for d, _ in plan.groups] == ["int32"]
    assert [a.shape for a in arrays] == [(8,), (2 * param_pack.ALIGN,)]


@pytest.mark.parametrize("name,tp", [("llama", 1), ("llama", 2), ("qwen3_moe", 2)])
def test_a_packed_decoder_gives_the_same_tokens_and_logits_with_fewer_arrays(name, tp):
    config, mesh, params = _model(name, tp)
    plain = Decoder(config, mesh, params, pack_params=False)
    packed = Decoder(config, mesh, params)
    assert packed.pack_params and not plain.pack_params
    assert len(packed._leaves) < len(plain._leaves) == len(jax.tree.leaves(params))
    for loop in ("sync", "pipelined", "on_device"):
        np.testing.assert_array_equal(packed.generate(PROMPT, 12, loop=loop, chunk=4),
                                      plain.generate(PROMPT, 12, loop=loop, chunk=4),
                                      err_msg=loop)
    np.testing.assert_array_equal(packed.teacher_forced_logits(PROMPT[None]),
                                  plain.teacher_forced_logits(PROMPT[None]))
    # the compiled steps take that many arrays: their entry computations' parameters
    for dec in (plain, packed):
        entry = dec.compiled_step().as_text().split("\nENTRY ", 1)[1].split("\n}", 1)[0]
        assert entry.count(" parameter(") == len(dec._leaves) + len(jax.tree.leaves(dec.state))


@pytest.fixture
def sifar_clean():
    sifar_jax.shutdown()
    yield
    sifar_jax.shutdown()


def test_packing_is_off_when_fused_and_refused_with_it(sifar_clean):
    config, mesh, params = _model("llama", 2)
    if not hasattr(sifar_jax, "psum_add_rmsnorm"):
        pytest.skip("the extension has no fused kernel")
    assert not Decoder(config, mesh, params, allreduce="sifar", fused=True).pack_params
    with pytest.raises(ValueError, match="pack_params=True needs fused=False"):
        Decoder(config, mesh, params, allreduce="sifar", fused=True, pack_params=True)
