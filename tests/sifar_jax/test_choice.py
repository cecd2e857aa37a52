"""sifar_jax.allreduce_choice: asked outside a trace, it says what sifar_psum
then runs (checked against the call counters and the jaxpr)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sifar_jax

SLOT = 4096
CASES = [  # (shape, dtype, algorithm)
    ((100,), jnp.float32, "auto"),
    ((3, 700), jnp.bfloat16, "auto"),  # 4200 bytes: past the slot
    ((1024,), jnp.float32, "auto"),  # exactly the slot
    ((1025,), jnp.float32, "auto"),  # one element past it
    ((16,), jnp.int8, "auto"),  # a dtype sifar does not sum
    ((0, 4), jnp.float32, "auto"),  # empty
    ((33,), jnp.bool_, "auto"),  # counted as int32
    ((7, 9), jnp.float16, "oneshot"),
    ((64,), jnp.float32, "twoshot"),
]


def _calls() -> dict:
    return {a: s["calls"] for a, s in sifar_jax.stats().items()}


def _run(mesh, shape, dtype, algorithm, axes="tp"):
    n = mesh.devices.size
    spec = P(tuple(mesh.axis_names))

    def body(v):
        return sifar_jax.sifar_psum(v[0], axes, algorithm=algorithm)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    x = (np.random.default_rng(0).standard_normal((n, *shape)) > 0).astype(dtype)
    jaxpr = str(jax.make_jaxpr(f)(x))
    before = _calls()
    jax.block_until_ready(f(x))
    after = _calls()
    return jaxpr, {a: after[a] - before[a] for a in after}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("shape,dtype,algorithm", CASES,
                         ids=[f"{s}-{jnp.dtype(d).name}-{a}" for s, d, a in CASES])
def test_choice_agrees_with_sifar_psum(cpu_mesh, n, shape, dtype, algorithm):
    mesh = cpu_mesh(n, slot_bytes=SLOT)
    choice = sifar_jax.allreduce_choice(shape, dtype, "tp", algorithm=algorithm)
    assert not choice.raises, choice
    jaxpr, delta = _run(mesh, shape, dtype, algorithm)
    assert ("sifar_allreduce" in jaxpr) == choice.sifar, (choice, jaxpr)
    want = {a: (n if choice.sifar and a == choice.algorithm else 0) for a in delta}
    assert delta == want, (choice, delta)
    if choice.sifar:
        assert choice.axes == ("tp",) and choice.reason is None and choice.slot_bytes == SLOT
    else:
        assert choice.algorithm is None and choice.reason, choice


def test_choice_reasons(cpu_mesh):
    cpu_mesh(2, slot_bytes=SLOT)
    big = sifar_jax.allreduce_choice((3, 700), jnp.bfloat16, "tp")
    assert "exceeds the 4096-byte slot" in big.reason and big.nbytes == 4208, big
    assert "int8" in sifar_jax.allreduce_choice((16,), jnp.int8, "tp").reason
    named = sifar_jax.allreduce_choice((3, 700), jnp.bfloat16, "tp", algorithm="sifar")
    assert named.raises and "algorithm='sifar'" in named.reason, named
    dtype = sifar_jax.allreduce_choice((4,), jnp.int8, "tp", algorithm="sifar")
    assert dtype.raises and "not supported" in dtype.reason, dtype
    missing = sifar_jax.allreduce_choice((4,), jnp.float32, "dp")
    assert missing.raises and "not initialised" in missing.reason, missing
    assert str(sifar_jax.allreduce_choice((4,), jnp.float32, "tp")) == "sifar (sifar) over ('tp',)"


def test_choice_over_a_product_and_size_one_axes(cpu_mesh):
    mesh = cpu_mesh(shape=(2, 2, 1), axis_names=("dp", "tp", "z"), slot_bytes=SLOT)
    both = sifar_jax.allreduce_choice((8,), jnp.float32, ("tp", "dp", "z"))
    assert both.sifar and set(both.axes) == {"dp", "tp"} and both.psum_axes == (), both
    _, delta = _run(mesh, (8,), jnp.float32, "auto", axes=("tp", "dp", "z"))
    assert delta["sifar"] == 4
    one = sifar_jax.allreduce_choice((8,), jnp.float32, "z")
    assert not one.sifar and "one device" in one.reason, one
