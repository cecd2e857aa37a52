"""sifar_jax.row_parallel / row_parallel_add_rmsnorm: an auto-sharded program
(jit + NamedSharding, no shard_map of its own) runs its row-parallel
all-reduces on sifar, with a change at those call sites only."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sifar_jax
import tiny_llama

PROMPT = [3, 14, 15, 92, 65]
STEPS = 4


def _calls() -> int:
    jax.effects_barrier()
    return sifar_jax.stats()["sifar"]["calls"]


def _tol(dtype, n):
    return dict(rtol=2e-6 * n, atol=2e-6 * n) if dtype == jnp.float32 else dict(rtol=0.1, atol=0.1)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_auto_sharded_model(cpu_mesh, n, dtype):
    """The dense model with row_parallel at its two row-parallel projections
    against the same model with plain matmuls (XLA's all-reduce)."""
    mesh = cpu_mesh(n)
    cfg = tiny_llama.Config()
    params = tiny_llama.shard(tiny_llama.init_params(cfg, jax.random.key(2), dtype), mesh)
    want_tokens, want_logits = tiny_llama.greedy(tiny_llama.auto_forward(cfg), params, PROMPT,
                                                 STEPS)
    helper = functools.partial(sifar_jax.row_parallel, axis="tp", mesh=mesh)
    before = _calls()
    tokens, logits = tiny_llama.greedy(tiny_llama.auto_forward(cfg, helper), params, PROMPT, STEPS)
    assert _calls() - before == cfg.layers * 2 * n * STEPS
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   **_tol(dtype, n))


def _operands(mesh, dtype, t=3, k=64, h=32):
    rng = np.random.default_rng(0)
    put = lambda a, s: jax.device_put(jnp.asarray(a, dtype), NamedSharding(mesh, s))  # noqa: E731
    x = put(rng.standard_normal((t, k)), P(None, "tp"))
    w = put(rng.standard_normal((k, h)) / 8, P("tp", None))
    r = put(rng.standard_normal((t, h)), P())
    g = put(1 + rng.standard_normal(h) / 4, P())
    return x, w, r, g


@pytest.mark.parametrize("n", [2, 4])
def test_grad_composes(cpu_mesh, n):
    mesh = cpu_mesh(n)
    x, w, r, g = _operands(mesh, jnp.float32)

    def loss(proj, x, w):
        return jnp.sum(jnp.tanh(proj(x, w)) ** 2)

    ours = jax.jit(jax.grad(functools.partial(loss, lambda a, b: sifar_jax.row_parallel(a, b, mesh=mesh)),
                            argnums=(0, 1)))
    plain = jax.jit(jax.grad(functools.partial(loss, jnp.matmul), argnums=(0, 1)))
    before = _calls()
    got = ours(x, w)
    assert _calls() - before == n  # the forward's one all-reduce; the transpose is lax.psum's
    for a, b in zip(got, plain(x, w)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_fused_variant(cpu_mesh, dtype):
    n = 2
    mesh = cpu_mesh(n)
    x, w, r, g = _operands(mesh, dtype)
    eps = 1e-5
    fused = jax.jit(lambda *a: sifar_jax.row_parallel_add_rmsnorm(*a, eps=eps, mesh=mesh))
    before = _calls()
    normed, res = fused(x, w, r, g)
    assert _calls() - before == n
    text = jax.jit(lambda *a: sifar_jax.row_parallel_add_rmsnorm(*a, eps=eps, mesh=mesh)).lower(
        x, w, r, g).as_text()
    assert sifar_jax._ext.TARGETS.psum_add_rmsnorm in text
    # new_residual: bit-identical to residual + row_parallel (one rounding of the sum, one add).
    want_res = np.asarray(jax.jit(lambda x, w, r: r + sifar_jax.row_parallel(x, w, mesh=mesh))(x, w, r))
    assert np.array_equal(np.asarray(res, np.float32), np.asarray(want_res, np.float32))
    want_norm = tiny_llama.rms_norm(jnp.asarray(want_res), g, eps)
    np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(want_norm, np.float32),
                               rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6, atol=1e-6)
    # grad: the backward pass is the unfused composition's (lax.psum).
    if dtype == jnp.float32:
        def loss(fn, x, w, r, g):
            a, b = fn(x, w, r, g)
            return jnp.sum(a * b)

        ref = lambda x, w, r, g: (tiny_llama.rms_norm(r + x @ w, g, eps), r + x @ w)  # noqa: E731
        got = jax.jit(jax.grad(functools.partial(loss, lambda *a: sifar_jax.row_parallel_add_rmsnorm(
            *a, eps=eps, mesh=mesh)), argnums=(0, 1, 2, 3)))(x, w, r, g)
        want = jax.jit(jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2, 3)))(x, w, r, g)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_explicit_mesh_and_errors(cpu_mesh):
    devs = jax.devices()[:4]
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                         devices=devs)
    sifar_jax.init(mesh)
    rng = np.random.default_rng(1)
    x = jax.device_put(jnp.asarray(rng.standard_normal((4, 16)), jnp.float32),
                       NamedSharding(mesh, P("dp", "tp")))
    w = jax.device_put(jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
                       NamedSharding(mesh, P("tp", None)))
    with jax.sharding.set_mesh(mesh):
        before = _calls()
        y = jax.jit(sifar_jax.row_parallel)(x, w)
        assert _calls() - before == 4  # two tp groups (one per dp row) of two ranks
        assert jax.typeof(y).sharding.spec == P("dp", None)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no mesh"):
        jax.jit(sifar_jax.row_parallel)(np.ones((2, 4), np.float32), np.ones((4, 2), np.float32))
    with pytest.raises(ValueError, match="no axis 'mp'"):
        sifar_jax.row_parallel(x, w, "mp", mesh=mesh)


def test_tuple_of_axes_with_a_size_one_axis(cpu_mesh):
    """K split over ("y", "z") with z of one device (jax-llm-examples' tensor axes): one sifar
    all-reduce over y, no all-reduce of XLA's left in the program."""
    mesh = jax.make_mesh((2, 1), ("y", "z"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                         devices=jax.devices()[:2])
    sifar_jax.init(mesh)
    rng = np.random.default_rng(2)
    x = jax.device_put(jnp.asarray(rng.standard_normal((1, 3, 16)), jnp.float32),
                       NamedSharding(mesh, P(None, None, ("y", "z"))))
    w = jax.device_put(jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
                       NamedSharding(mesh, P(("y", "z"), None)))
    f = jax.jit(functools.partial(sifar_jax.row_parallel, axis=("y", "z")))
    with jax.sharding.set_mesh(mesh):
        text = f.lower(x, w).compile().as_text()
        before = _calls()
        y = f(x, w)
        assert _calls() - before == 2
    assert " all-reduce(" not in text and text.count('custom_call_target="sifar_allreduce"') == 1
    np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-5)
