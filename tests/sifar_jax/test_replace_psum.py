"""sifar_jax.replace_psum(): unmodified jax.lax.psum code runs on sifar where
sifar serves it, and keeps lax.psum's semantics everywhere else."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import sifar_jax

import tiny_llama

PROMPT = [3, 14, 15, 92, 65]
STEPS = 4


def _calls() -> int:
    jax.effects_barrier()
    return sifar_jax.stats()["sifar"]["calls"]


def _psum_fn(mesh, axes="tp", fn=None):
    fn = fn or (lambda v: jax.lax.psum(v, axes))
    return jax.jit(jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh, in_specs=P("tp"),
                                 out_specs=P("tp")))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_explicit_style_model_runs_unmodified(cpu_mesh, n, dtype):
    """A model written with shard_map + jax.lax.psum, run inside the context:
    tokens equal, logits within rounding, sifar's calls = layers x 2 x ranks x steps."""
    mesh = cpu_mesh(n)
    cfg = tiny_llama.Config()
    params = tiny_llama.shard(tiny_llama.init_params(cfg, jax.random.key(1), dtype), mesh)
    want_tokens, want_logits = tiny_llama.greedy(tiny_llama.shard_map_forward(cfg, mesh),
                                                 params, PROMPT, STEPS)
    before = _calls()
    with sifar_jax.replace_psum() as r:
        forward = tiny_llama.shard_map_forward(cfg, mesh)  # traced anew inside
        tokens, logits = tiny_llama.greedy(forward, params, PROMPT, STEPS)
    assert _calls() - before == cfg.layers * 2 * n * STEPS
    assert r.sifar == cfg.layers * 2 * STEPS and r.lax_psum == 0, r.calls
    assert tokens == want_tokens
    tol = dict(rtol=2e-6 * n, atol=2e-6 * n) if dtype == jnp.float32 else dict(rtol=0.1, atol=0.1)
    for got, want in zip(logits, want_logits):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   **tol)


def test_everything_else_keeps_lax_psum(cpu_mesh):
    mesh = cpu_mesh(2)
    x = np.arange(2 * 8, dtype=np.float32).reshape(2, 8)
    from jax.lax import psum as bound_earlier  # a name bound before entering: JAX's own

    cases = {
        "axis size idiom": lambda v: v * jax.lax.psum(1, "tp"),
        "int8": lambda v: jax.lax.psum(v.astype(jnp.int8), "tp").astype(jnp.float32),
        "pmean": lambda v: jax.lax.pmean(v, "tp"),
        "bound earlier": lambda v: bound_earlier(v, "tp"),
    }
    before = _calls()
    with sifar_jax.replace_psum() as r:
        for name, fn in cases.items():
            got = np.asarray(_psum_fn(mesh, fn=fn)(x))
            want = np.asarray(jax.jit(jax.shard_map(lambda v, fn=fn: fn(v[0])[None], mesh=mesh,
                                                    in_specs=P("tp"), out_specs=P("tp")))(x))
            np.testing.assert_array_equal(got, want, err_msg=name)
        vm = jax.jit(jax.vmap(lambda u: jax.lax.psum(u, "b"), axis_name="b"))
        np.testing.assert_array_equal(np.asarray(vm(x)), np.tile(x.sum(0), (2, 1)))
        pm = jax.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i", devices=jax.devices()[:2])
        np.testing.assert_array_equal(np.asarray(pm(x)), np.tile(x.sum(0), (2, 1)))
    assert _calls() == before, "none of these may run sifar"
    assert r.sifar == 0 and r.lax_psum >= 4, r.calls
    # A mesh init did not set up (the trace sees its axes and sizes, not its devices).
    other = Mesh(np.array(jax.devices()[2:6]), ("tp",))
    x4 = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)
    with sifar_jax.replace_psum() as r:
        np.testing.assert_array_equal(np.asarray(_psum_fn(other)(x4))[0], x4.sum(0))
    assert _calls() == before and "did not set this mesh up" in r.calls[0].reason


def test_traced_inside_uses_sifar_cached_keeps_it(cpu_mesh, caplog):
    mesh = cpu_mesh(2)
    x = np.ones((2, 8), np.float32)
    inside = _psum_fn(mesh)
    with caplog.at_level(logging.DEBUG, logger="sifar_jax"), sifar_jax.replace_psum() as r:
        before = _calls()
        inside(x)
        assert _calls() - before == 2
    assert any("replace_psum: psum over ('tp',)" in rec.getMessage() and "sifar_psum" in
               rec.getMessage() for rec in caplog.records)
    assert r.sifar == 1 and __file__ in r.calls[0].where, r.calls
    before = _calls()
    inside(x)  # the cached trace keeps sifar
    assert _calls() - before == 2
    after = _psum_fn(mesh)  # traced after leaving: lax.psum
    after(x)
    assert _calls() - before == 2
    assert jax.lax.psum is sifar_jax._jax_compat.lax_psum

    @sifar_jax.replace_psum()
    def decorated(v):
        return _psum_fn(mesh)(v)

    decorated(x)
    assert _calls() - before == 4


def test_explicit_mesh_under_set_mesh(cpu_mesh):
    devs = jax.devices()[:2]
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=devs)
    sifar_jax.init(mesh)
    with jax.sharding.set_mesh(mesh), sifar_jax.replace_psum() as r:
        f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "tp"), in_specs=P("tp"),
                                  out_specs=P()))
        x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, P("tp")))
        before = _calls()
        got = np.asarray(jax.block_until_ready(f(x)))
        assert _calls() - before == 2
    np.testing.assert_array_equal(got, np.arange(8.0).reshape(2, 4).sum(0))
    assert r.sifar == 1


def test_users_own_global_swap_does_not_recurse(cpu_mesh, monkeypatch):
    mesh = cpu_mesh(2, slot_bytes=4096)
    monkeypatch.setattr(jax.lax, "psum", sifar_jax.sifar_psum)
    x = np.ones((2, 4096), np.float32)  # past the slot: sifar hands it to JAX's psum
    small = np.ones((2, 8), np.float32)
    before = _calls()
    np.testing.assert_array_equal(np.asarray(_psum_fn(mesh)(x))[0], x.sum(0))
    np.testing.assert_array_equal(np.asarray(_psum_fn(mesh)(small))[0], small.sum(0))
    assert _calls() - before == 2
