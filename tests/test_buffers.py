"""Explicit dual buffers (make_buffers / sifar_psum_into) on CPU devices."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import sifar_jax

N = 4


@pytest.fixture()
def mesh():
    devs = jax.devices("cpu")
    if len(devs) < N:
        pytest.skip(f"needs {N} CPU devices")
    m = Mesh(np.array(devs[:N]), ("tp",))
    sifar_jax.shutdown()
    sifar_jax.init(m)
    yield m
    sifar_jax.shutdown()


def _step(mesh, donate=True, algorithm="sifar"):
    spec = sifar_jax.buffer_spec(mesh)

    def body(x, a, b):
        y, a = sifar_jax.sifar_psum_into(x, "tp", a, b, algorithm=algorithm)
        z, b = sifar_jax.sifar_psum_into(y * 0.25, "tp", b, a, algorithm=algorithm)
        return z, a, b

    def step(x, bufs):
        z, a, b = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), spec, spec),
                                out_specs=(P("tp"), spec, spec))(x, *bufs)
        return z, sifar_jax.DualBuffers(a, b)

    return jax.jit(step, donate_argnums=(1,) if donate else ())


def _pointers(bufs):
    return [s.data.unsafe_buffer_pointer() for arr in bufs for s in arr.addressable_shards]


@pytest.mark.parametrize("algorithm", ["sifar", "sifar_push", "oneshot_db", "twoshot"])
def test_alternating_buffers_are_exact_and_stay_in_place(mesh, algorithm):
    bufs = sifar_jax.make_buffers(mesh, "tp")
    before = _pointers(bufs)
    step = _step(mesh, algorithm=algorithm)
    for i in range(6):
        x = jax.random.normal(jax.random.key(i), (N, 257), jnp.float32) + 2.0
        z, bufs = step(x, bufs)
        xs = np.asarray(x, np.float64)
        ref = (xs.sum(0) * 0.25) * N  # the second all-reduce sums N equal rows
        np.testing.assert_allclose(np.asarray(z), np.broadcast_to(ref, (N, 257)), rtol=1e-5)
        assert (np.asarray(z) == np.asarray(z)[0]).all(), "ranks disagree"
    assert _pointers(bufs) == before, "donated buffers must keep their registered addresses"


def test_compiled_step_never_copies_the_buffers(mesh):
    bufs = sifar_jax.make_buffers(mesh, "tp")
    x = jnp.ones((N, 64), jnp.float32)
    hlo = _step(mesh).lower(x, bufs).compile().as_text()
    shape = f"u8[1,{bufs.a.shape[1]}]"
    copies = [line for line in hlo.splitlines() if shape in line and " copy" in line]
    assert not copies, copies
    assert "input_output_alias" in hlo


def test_undonated_buffers_are_a_clear_error(mesh):
    bufs = sifar_jax.make_buffers(mesh, "tp")
    x = jnp.ones((N, 64), jnp.float32)
    spec = sifar_jax.buffer_spec(mesh)

    @jax.jit
    def keeps_input(x, bufs):  # returns the new buffer but the input stays alive: XLA copies
        def body(x, a, b):
            y, a = sifar_jax.sifar_psum_into(x, "tp", a, b)
            return y, a
        return jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), spec, spec),
                             out_specs=(P("tp"), spec))(x, *bufs)

    with pytest.raises(Exception, match="did not register: XLA copied it"):
        y, _ = keeps_input(x, bufs)
        np.asarray(y)


def test_make_buffers_needs_init():
    sifar_jax.shutdown()
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))
    with pytest.raises(sifar_jax.NotInitializedError):
        sifar_jax.make_buffers(mesh, "tp")


@functools.lru_cache(maxsize=None)
def _tiny():
    from models.config import LlamaConfig

    return LlamaConfig.tiny()


def test_decoder_with_explicit_buffers_matches_psum():
    pytest.importorskip("flax")
    from models.decode import Decoder, make_mesh
    from models.weights import random_params

    sifar_jax.shutdown()
    cfg = _tiny()
    mesh = make_mesh(2)
    params = random_params(cfg, mesh, seed=3)
    tokens = (np.arange(24) * 7 + 1) % cfg.vocab_size
    ref = Decoder(cfg, mesh, params, allreduce="psum").teacher_forced_logits(tokens[None])
    dec = Decoder(cfg, mesh, params, allreduce="sifar_buffers")
    got = dec.teacher_forced_logits(tokens[None])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    hlo = dec.compiled_step().as_text()
    assert not [line for line in hlo.splitlines() if "u8[" in line and " copy" in line]
    sifar_jax.check()
    sifar_jax.shutdown()
