"""Misuse is reported at trace time with a clear message; nothing runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sifar_jax
from sifar_jax import multicast

SLOT = 4096


def trace(mesh, body, x, axis="tp"):
    """Traces and lowers body under shard_map + jit without running it."""
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))
    return f.lower(x)


def _summed_as(dtype):
    """What sifar sums a dtype as: bool counts in int32, like lax.psum."""
    return jnp.dtype(jnp.int32) if jnp.dtype(dtype) == jnp.bool_ else jnp.dtype(dtype)


# Whatever the extension does not sum natively (int32/uint32 may become native).
UNSUPPORTED = [
    d
    for d in (jnp.int32, jnp.uint32, jnp.int8, jnp.uint16, jnp.bool_, jnp.complex64)
    if _summed_as(d) not in sifar_jax.SUPPORTED_DTYPES
]


@pytest.mark.parametrize("dtype", UNSUPPORTED, ids=lambda d: jnp.dtype(d).name)
def test_unsupported_dtype_with_named_algorithm_is_type_error(cpu_mesh, dtype):
    """A named algorithm raises; "auto" hands the type to lax.psum (test_transforms)."""
    mesh = cpu_mesh(2, slot_bytes=SLOT)
    x = jax.ShapeDtypeStruct((2, 8), dtype)
    with pytest.raises(TypeError, match=r"algorithm='sifar'.*dtype .* not supported.*float32"):
        trace(mesh, lambda v: sifar_jax.sifar_psum(v, "tp", algorithm="sifar"), x)


def test_unknown_axis_is_name_error(cpu_mesh):
    """Like lax.psum, an unbound axis name is a NameError (and still a ValueError)."""
    mesh = cpu_mesh(2, slot_bytes=SLOT)
    x = jax.ShapeDtypeStruct((2, 8), jnp.float32)
    with pytest.raises(sifar_jax.UnboundAxisError, match=r"axis 'nope' is not bound") as e:
        trace(mesh, lambda v: sifar_jax.sifar_psum(v, "nope"), x)
    assert isinstance(e.value, NameError) and isinstance(e.value, ValueError)
    with pytest.raises(NameError):  # one unbound name among bound ones
        trace(mesh, lambda v: sifar_jax.sifar_psum(v, ("tp", "nope")), x)


def test_outside_shard_map_is_name_error(cpu_mesh):
    cpu_mesh(2, slot_bytes=SLOT)
    with pytest.raises(NameError, match=r"shard_map"):
        sifar_jax.sifar_psum(jnp.ones(8), "tp")
    with pytest.raises(NameError):  # what lax.psum raises here too
        jax.lax.psum(jnp.ones(8), "tp")


def test_not_initialised(cpu_mesh):
    mesh = cpu_mesh(4, init=False)
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    with pytest.raises(sifar_jax.NotInitializedError, match=r"sifar_jax\.init"):
        trace(mesh, lambda v: sifar_jax.sifar_psum(v, "tp"), x)


def test_initialised_for_another_size(cpu_mesh):
    """A communicator for a 2-device "tp" does not serve a 4-device "tp"."""
    cpu_mesh(2, slot_bytes=SLOT)
    mesh4 = cpu_mesh(4, init=False)
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    with pytest.raises(sifar_jax.NotInitializedError, match=r"size 4"):
        trace(mesh4, lambda v: sifar_jax.sifar_psum(v, "tp"), x)


def test_unknown_algorithm_is_value_error(cpu_mesh):
    mesh = cpu_mesh(2, slot_bytes=SLOT)
    x = jax.ShapeDtypeStruct((2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"unknown algorithm 'ring'.*sifar"):
        trace(mesh, lambda v: sifar_jax.sifar_psum(v, "tp", algorithm="ring"), x)


@pytest.mark.parametrize("algorithm", [a for a in sifar_jax.ALGORITHMS if a != "multicast"])
def test_explicit_algorithm_past_slot_is_value_error(cpu_mesh, algorithm):
    mesh = cpu_mesh(2, slot_bytes=SLOT)
    x = jax.ShapeDtypeStruct((2, SLOT // 4 + 1), jnp.float32)  # 4100 bytes: padded to 4112
    with pytest.raises(ValueError, match=rf"algorithm='{algorithm}'.*exceeds the {SLOT}-byte slot"):
        trace(mesh, lambda v: sifar_jax.sifar_psum(v, "tp", algorithm=algorithm), x)


def test_explicit_algorithm_at_slot_is_fine(cpu_mesh):
    mesh = cpu_mesh(2, slot_bytes=SLOT)
    x = jax.ShapeDtypeStruct((2, SLOT // 4), jnp.float32)
    trace(mesh, lambda v: sifar_jax.sifar_psum(v[0], "tp", algorithm="sifar")[None], x)


def test_multicast_refused_on_cpu(cpu_mesh):
    """Multicast never runs on the CPU backend: the refusal names the reason."""
    mesh = cpu_mesh(2, slot_bytes=SLOT)
    x = jax.ShapeDtypeStruct((2, 8), jnp.float32)
    with pytest.raises((sifar_jax.MulticastDisabledError, ValueError)) as e:
        trace(mesh, lambda v: sifar_jax.sifar_psum(v, "tp", algorithm="multicast"), x)
    msg = str(e.value)
    assert "multicast" in msg
    assert any(w in msg for w in ("GPU", "opt-in", "turned off", "NVLink")), msg


def test_multicast_guard_messages():
    """The guard alone (pure Python, nothing is launched)."""
    assert multicast.refusal(environ={}) is not None
    assert "opt-in" in multicast.refusal(environ={})
    for var, off in multicast.DISABLING.items():
        env = {multicast.ENABLE_VAR: "1", var: off}
        reason = multicast.refusal(environ=env)
        assert reason is not None and var in reason, (var, reason)
        with pytest.raises(sifar_jax.MulticastDisabledError, match=var):
            multicast.require_enabled(environ=env)
    with pytest.raises(sifar_jax.MulticastDisabledError, match="opt-in"):
        multicast.require_enabled(environ={})
    assert multicast.refusal(environ={multicast.ENABLE_VAR: "1"}, device_supports=False)


def test_auto_never_picks_multicast_on_cpu(cpu_mesh):
    mesh = cpu_mesh(2, slot_bytes=SLOT)
    f = jax.jit(
        jax.shard_map(
            lambda v: sifar_jax.sifar_psum(v[0], "tp")[None], mesh=mesh, in_specs=P("tp"),
            out_specs=P("tp"),
        )
    )
    x = np.arange(1, 17, dtype=np.float32).reshape(2, 8)
    np.testing.assert_array_equal(np.asarray(f(x))[0], x.sum(0))
    s = sifar_jax.stats()
    assert s["sifar"]["calls"] == 2 and s["multicast"]["calls"] == 0


def test_repeated_axis_is_lax_psums_error(cpu_mesh):
    """("tp", "tp") fails as lax.psum fails, and leaves sifar_jax working."""
    mesh = cpu_mesh(2, slot_bytes=SLOT)
    x = jax.ShapeDtypeStruct((2, 8), jnp.float32)
    errors = []
    for psum in (jax.lax.psum, sifar_jax.sifar_psum):
        with pytest.raises(ValueError) as e:
            trace(mesh, lambda v, psum=psum: psum(v, ("tp", "tp")), x)
        errors.append(str(e.value).splitlines()[0])
    assert errors[0] == errors[1]
    trace(mesh, lambda v: sifar_jax.sifar_psum(v, "tp"), x)  # still fine


def test_axis_index_groups_with_named_algorithm_is_value_error(cpu_mesh):
    """"auto" hands axis_index_groups to lax.psum (test_transforms); a named
    algorithm cannot serve it."""
    mesh = cpu_mesh(4, slot_bytes=SLOT)
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"axis_index_groups"):
        trace(
            mesh,
            lambda v: sifar_jax.sifar_psum(
                v, "tp", axis_index_groups=[[0, 1], [2, 3]], algorithm="sifar"
            ),
            x,
        )


def test_psum_repeated_validates(cpu_mesh):
    mesh = cpu_mesh(2, slot_bytes=SLOT)
    x = jax.ShapeDtypeStruct((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="repeat"):
        trace(mesh, lambda v: sifar_jax.benchmarking.psum_repeated(v, "tp", 0), x)
    big = jax.ShapeDtypeStruct((2, SLOT), jnp.float32)  # past the slot: no fallback here
    with pytest.raises(ValueError, match="exceeds"):
        trace(mesh, lambda v: sifar_jax.benchmarking.psum_repeated(v, "tp", 3), big)


def test_init_validates_slot(cpu_mesh):
    mesh = cpu_mesh(2, init=False)
    with pytest.raises(ValueError, match="slot_bytes"):
        sifar_jax.init(mesh, slot_bytes=0)


def test_testing_helpers_validate(cpu_mesh):
    cpu_mesh(2, slot_bytes=SLOT)
    with pytest.raises(ValueError):
        sifar_jax.testing.inject_skew(-1)
    with pytest.raises(ValueError, match="no communicator"):
        with sifar_jax.testing.drop_rank("nope", 0):
            pass


def test_run_after_shutdown_is_an_error_not_a_crash(cpu_mesh):
    mesh = cpu_mesh(2, slot_bytes=SLOT)
    f = jax.jit(
        jax.shard_map(
            lambda v: sifar_jax.sifar_psum(v[0], "tp", algorithm="sifar")[None], mesh=mesh,
            in_specs=P("tp"), out_specs=P("tp"),
        )
    )
    x = np.ones((2, 8), np.float32)
    jax.block_until_ready(f(x))
    sifar_jax.shutdown()
    with pytest.raises(Exception, match=r"no communicator.*sifar_jax\.init"):
        jax.block_until_ready(f(x))


def test_check_passes_when_healthy(cpu_mesh):
    sifar_jax.check()  # nothing initialised
    mesh = cpu_mesh(4, slot_bytes=SLOT)
    f = jax.jit(
        jax.shard_map(
            lambda v: sifar_jax.sifar_psum(v[0], "tp")[None], mesh=mesh, in_specs=P("tp"),
            out_specs=P("tp"),
        )
    )
    jax.block_until_ready(f(np.ones((4, 64), np.float32)))
    sifar_jax.check()
    assert all(v["timeouts"] == 0 for v in sifar_jax.stats().values())
