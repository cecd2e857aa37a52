"""Mesh axes of one device add nothing to the compiled program: no all-reduce
of one participant, and a bf16 sum over ("z", "y") rounds once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import sifar_jax


def _hlo(f, *args) -> str:
    return f.lower(*args).compile().as_text()


def test_size_one_axis_in_a_group(cpu_mesh):
    mesh = cpu_mesh(shape=(1, 2), axis_names=("z", "y"))
    x = jax.random.normal(jax.random.key(0), (1, 2, 3, 64), jnp.bfloat16)
    spec = P("z", "y")

    def make(axes):
        body = lambda v: sifar_jax.sifar_psum(v, axes)  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=P("z")))

    both, y_only = make(("z", "y")), make("y")
    text = _hlo(both, x)
    assert "all-reduce" not in text, text
    assert text.count(f'custom_call_target="{sifar_jax._ext.TARGETS.allreduce}"') == 1, text
    before = sifar_jax.stats()["sifar"]["calls"]
    got = np.asarray(both(x))
    assert sifar_jax.stats()["sifar"]["calls"] - before == 2
    # One rounding: bit-identical to the sum over "y" alone.
    assert np.array_equal(got.view(np.uint16), np.asarray(y_only(x)).view(np.uint16))


def test_only_size_one_axes_move_nothing(cpu_mesh):
    mesh = cpu_mesh(shape=(1, 2), axis_names=("z", "y"))
    x = jnp.arange(2 * 8, dtype=jnp.float32).reshape(1, 2, 8)

    def body(v):
        return sifar_jax.sifar_psum(v, "z")  # invariant over z now, as lax.psum types it

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("z", "y"), out_specs=P(None, "y")))
    text = _hlo(f, x)
    assert "all-reduce" not in text and "custom_call_target" not in text, text
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x))
    # Derivatives and vmap keep lax.psum's.
    g = jax.jit(jax.grad(lambda v: jnp.sum(f(v) ** 2)))
    np.testing.assert_array_equal(np.asarray(g(x)), 2 * np.asarray(x))
    vm = jax.jit(jax.shard_map(jax.vmap(body), mesh=mesh, in_specs=P("z", "y"),
                               out_specs=P(None, "y")))
    np.testing.assert_array_equal(np.asarray(vm(x)), np.asarray(x))
