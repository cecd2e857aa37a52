"""What sifar_jax says, and where, as docs/reference.md ("Warnings and logs") states it.

Auto's own choices (a payload past the slot, the auto table's lax.psum, a product init was
told not to make, the fused kernel's padded rows past the slot) are logged at DEBUG on the
"sifar_jax" logger and never warned; a call sifar_psum (or the fused call) cannot serve for a
reason of the call or the machine (a dtype it does not sum, axis_index_groups, a partially
manual shard_map, another algorithm named for the fused call) warns once per reason;
replace_psum only logs. One test per row of the table.
"""

from __future__ import annotations

import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sifar_jax
from sifar_jax import algorithms, autotable, plan

KB = 1024


@pytest.fixture
def said(monkeypatch, caplog):
    """Runs a callable; returns (sifar_jax's warnings, sifar_jax logger's DEBUG messages)."""
    monkeypatch.setattr(plan, "warned", set())  # once per reason: start afresh
    monkeypatch.setattr(algorithms, "_warned", set())
    monkeypatch.setattr(autotable, "_state", {"given": None, "env": None, "env_read": False})
    monkeypatch.delenv(autotable.ENV, raising=False)

    def run(fn):
        caplog.clear()
        with warnings.catch_warnings(record=True) as caught, \
                caplog.at_level(logging.DEBUG, logger="sifar_jax"):
            warnings.simplefilter("always")
            out = jax.block_until_ready(fn())
        ours = [w for w in caught if "sifar_jax" in str(w.message)]
        assert all(w.category is UserWarning for w in ours), ours
        logs = [r.getMessage() for r in caplog.records
                if r.name == "sifar_jax" and r.levelno == logging.DEBUG]
        return [str(w.message) for w in ours], logs, out

    return run


def _psum_fn(mesh, **kw):
    return jax.jit(jax.shard_map(lambda v: sifar_jax.sifar_psum(v[0], "tp", **kw)[None],
                                 mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))


# ------------------------------------------------------------------ DEBUG only --
def test_payload_past_the_slot_is_a_debug_log(cpu_mesh, said):
    mesh = cpu_mesh(2, slot_bytes=4 * KB)
    x = np.ones((2, 2 * KB), np.float32)  # 8 KB
    warned, logs, out = said(lambda: _psum_fn(mesh)(x))
    assert warned == []
    assert any(m.startswith("sifar_jax: lax.psum: payload of 8192 bytes exceeds")
               for m in logs), logs
    np.testing.assert_array_equal(np.asarray(out)[0], x.sum(0))


def test_the_auto_tables_lax_psum_is_a_debug_log(cpu_mesh, said):
    autotable.use(autotable.Table("cpu", {2: ((64, "sifar"),)}, source="test"))
    mesh = cpu_mesh(2, slot_bytes=4 * KB)
    x = np.ones((2, 256), np.float32)  # 1 KB: past the table's largest size
    warned, logs, _ = said(lambda: _psum_fn(mesh)(x))
    assert warned == []
    assert any("the auto table hands 1024-byte payloads" in m for m in logs), logs


def test_a_product_not_made_is_a_debug_log(cpu_mesh, said):
    mesh = cpu_mesh(shape=(2, 2), axis_names=("dp", "tp"), init=False)
    sifar_jax.init(mesh, products=())
    f = jax.jit(jax.shard_map(lambda v: sifar_jax.sifar_psum(v[0, 0], ("dp", "tp"))[None, None],
                              mesh=mesh, in_specs=P("dp", "tp"), out_specs=P("dp", "tp")))
    warned, logs, _ = said(lambda: f(np.ones((2, 2, 5), np.float32)))
    assert warned == []
    assert any("products=" in m for m in logs), logs


def test_fused_rows_padded_past_the_slot_are_a_debug_log(cpu_mesh, said):
    """psum_add_rmsnorm under "auto": the rows fit the slot, their padded layout does not, so
    the unfused composition runs (sifar_psum, add, RMSNorm), logged like auto's other choices."""
    slot = 512
    mesh = cpu_mesh(2, slot_bytes=slot)
    rows, width = 5, 48  # 96-byte bf16 rows: 480 bytes, each padded to a power of two of lines
    assert rows * sifar_jax._ext.lib.fused_padded_row_bytes(2 * width) > slot >= rows * 2 * width

    def body(x, r, w):
        normed, res = sifar_jax.psum_add_rmsnorm(x[0], r, w, "tp", eps=1e-5)
        return normed[None], res[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()),
                              out_specs=(P("tp"), P("tp"))))
    x = jnp.ones((2, rows, width), jnp.bfloat16)
    r, w = jnp.ones((rows, width), jnp.bfloat16), jnp.ones((width,), jnp.bfloat16)
    warned, logs, _ = said(lambda: f(x, r, w))
    assert warned == []
    assert any(m.startswith("sifar_jax.psum_add_rmsnorm: the unfused composition")
               and "exceeds the 512-byte slot" in m for m in logs), logs


def test_replace_psum_only_logs(cpu_mesh, said):
    """replace_psum leaves a dtype sifar does not sum to JAX's psum: a DEBUG line, no warning."""
    mesh = cpu_mesh(2)
    f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v[0], "tp")[None], mesh=mesh,
                              in_specs=P("tp"), out_specs=P("tp")))
    with sifar_jax.replace_psum():
        warned, logs, out = said(lambda: f(np.ones((2, 8), np.int8)))
    assert warned == []
    assert any(m.startswith("sifar_jax.replace_psum: psum over ('tp',)") and "lax.psum" in m
               for m in logs), logs
    np.testing.assert_array_equal(np.asarray(out)[0], np.full(8, 2, np.int8))


# ---------------------------------------------------------- one UserWarning --
def test_a_dtype_sifar_does_not_sum_warns_once(cpu_mesh, said):
    mesh = cpu_mesh(2)
    x = np.ones((2, 8), np.int8)
    warned, logs, out = said(lambda: (_psum_fn(mesh)(x), _psum_fn(mesh)(x + 1)))
    assert warned == ["sifar_jax: falling back to lax.psum: dtype int8 is not summed natively"]
    assert not any("int8" in m for m in logs), logs
    np.testing.assert_array_equal(np.asarray(out[0])[0], np.full(8, 2, np.int8))


def test_axis_index_groups_warns(cpu_mesh, said):
    mesh = cpu_mesh(2)
    f = jax.jit(jax.shard_map(
        lambda v: sifar_jax.sifar_psum(v[0], "tp", axis_index_groups=[[0], [1]])[None],
        mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    warned, _, _ = said(lambda: f(np.ones((2, 8), np.float32)))
    assert warned == ["sifar_jax: falling back to lax.psum: axis_index_groups"]


def test_a_partially_manual_shard_map_warns(cpu_mesh, said):
    mesh = cpu_mesh(shape=(2, 2), axis_names=("x", "tp"))
    f = jax.jit(jax.shard_map(lambda v: sifar_jax.sifar_psum(v, "tp"), mesh=mesh,
                              in_specs=P(None, "tp"), out_specs=P(None), axis_names={"tp"}))
    with jax.set_mesh(mesh):
        warned, _, _ = said(lambda: f(np.ones((4, 8), np.float32)))
    assert len(warned) == 1 and "not manual over the mesh axes ('x',)" in warned[0], warned


def test_the_fused_call_with_another_algorithm_warns(cpu_mesh, said):
    mesh = cpu_mesh(2)

    def body(x, r, w):
        normed, res = sifar_jax.psum_add_rmsnorm(x[0], r, w, "tp", eps=1e-5,
                                                 algorithm="oneshot")
        return normed[None], res[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()),
                              out_specs=(P("tp"), P("tp"))))
    x = jnp.ones((2, 1, 64), jnp.float32)
    warned, _, _ = said(lambda: f(x, jnp.ones((1, 64)), jnp.ones((64,))))
    assert warned == ["sifar_jax.psum_add_rmsnorm: falling back to the unfused composition "
                      "(sifar_psum, add, RMSNorm): the fused kernel runs the sifar algorithm, "
                      "not 'oneshot'"]


def test_naming_the_ablation_algorithm_warns():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        algorithms._warned.discard("multicast")
        algorithms.validate("multicast")
    assert any("not correct by construction" in str(w.message) for w in caught)
