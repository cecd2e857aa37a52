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
from test_faults import hang_guard

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
    from models.llama import LlamaConfig

    return LlamaConfig.tiny()


def test_decoder_with_explicit_buffers_matches_psum():
    pytest.importorskip("flax")
    from models import Decoder, make_mesh
    from models import random_params

    sifar_jax.shutdown()
    cfg = _tiny()
    mesh = make_mesh(2, devices=jax.devices("cpu"))  # the CPU's host devices, also on a GPU host
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


def _decoder_like(mesh, rng):
    """What a Decoder with allreduce="sifar_buffers" does: a state holding its
    own arrays and the all-reduce buffers, donated to a jitted step."""
    spec = sifar_jax.buffer_spec(mesh)
    size = int(rng.integers(64, 512))

    def body(x, h, a, b):
        y, a = sifar_jax.sifar_psum_into(x * h, "tp", a, b)
        z, b = sifar_jax.sifar_psum_into(y, "tp", b, a)
        return z, h + 1, a, b

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(x, state):
        z, h, a, b = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp"), spec, spec),
                                   out_specs=(P("tp"), P("tp"), spec, spec))(x, *state)
        return z, (h, a, b)

    h = jnp.ones((N, size), jnp.float32)
    a, b = sifar_jax.make_buffers(mesh, "tp")
    return step, (h, a, b), size


def test_building_using_and_dropping_many_decoders_never_hangs(mesh):
    """Buffers die with their decoder; a new pair may land where an old one
    was on some ranks and elsewhere on others. Every pair must be matched on
    every rank, never an old pair at a reused address (that hangs)."""
    rng = np.random.default_rng(0)
    with hang_guard(300), sifar_jax.testing.timeout(5.0):  # a stale pair would wait this long
        for k in range(8):
            step, state, size = _decoder_like(mesh, rng)
            for i in range(3):
                x = jnp.asarray(rng.integers(-4, 5, (N, size)).astype(np.float32))
                z, state = step(x, state)
                want = np.asarray(x).sum(0) * (i + 1) * N
                np.testing.assert_array_equal(np.asarray(z), np.broadcast_to(want, (N, size)),
                                              err_msg=f"decoder {k}, step {i}")
            del step, state
    sifar_jax.check()


def _one_call_step(mesh):
    """Each call of this step writes `a` once: two calls in a row reuse it."""
    spec = sifar_jax.buffer_spec(mesh)

    def body(x, a, b):
        y, a = sifar_jax.sifar_psum_into(x, "tp", a, b)
        return y, a, b

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), spec, spec),
                                 out_specs=(P("tp"), spec, spec)), donate_argnums=(1, 2))


def test_the_same_buffer_twice_in_a_row_is_a_clear_error(mesh):
    bufs = sifar_jax.make_buffers(mesh, "tp")
    x = jnp.ones((N, 64), jnp.float32)
    spec = sifar_jax.buffer_spec(mesh)

    def traced(body):
        f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), spec, spec), out_specs=P("tp"))
        return jax.jit(f).lower(x, *bufs)

    # At trace time: buf is prev, and buf written by the call just before.
    with pytest.raises(ValueError, match="buf and prev are the same buffer"):
        traced(lambda x, a, b: sifar_jax.sifar_psum_into(x, "tp", a, a)[0])

    def twice(x, a, b):
        y, a = sifar_jax.sifar_psum_into(x, "tp", a, b)
        return sifar_jax.sifar_psum_into(y, "tp", a, b)[0]

    with pytest.raises(ValueError, match="previous sifar_psum_into wrote"):
        traced(twice)

    # At run time, across executables: the handler remembers each rank's last buffer.
    step = _one_call_step(mesh)
    y, a, b = step(x, *bufs)
    np.testing.assert_array_equal(np.asarray(y), np.full((N, 64), N, np.float32))
    with pytest.raises(Exception, match="the buffer its previous all-reduce wrote"):
        np.asarray(step(x, a, b)[0])


def test_registrations_follow_the_arrays_lives(mesh):
    """make_buffers drops the registrations of buffers no longer alive (a
    donated buffer lives on in the step's output and stays registered)."""
    from sifar_jax import _ext

    [c] = sifar_jax.communicators("tp")
    ids = lambda: set(_ext.lib.buffer_ids(c.comm_id, 0))  # noqa: E731
    first = sifar_jax.make_buffers(mesh, "tp")
    x = jnp.ones((N, 64), jnp.float32)
    z, first = _step(mesh)(x, first)  # donated: the output arrays hold the memory now
    kept = ids()
    assert len(kept) == 2
    second = sifar_jax.make_buffers(mesh, "tp")
    assert kept < ids() and len(ids()) == 4, "a donated-and-returned pair was dropped"
    del first
    third = sifar_jax.make_buffers(mesh, "tp")
    assert not kept & ids() and len(ids()) == 4, "the dead pair is still registered"
    for bufs in (second, third):
        z, bufs = _step(mesh)(x, bufs)
        np.testing.assert_array_equal(np.asarray(z), np.full((N, 64), N * N * 0.25, np.float32))
