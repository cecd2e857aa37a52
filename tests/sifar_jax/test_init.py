"""init makes the communicators, products of axes included; nothing is made
while tracing; a re-init says so in one line; stats() keeps its totals."""

from __future__ import annotations

import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import sifar_jax

SLOT = 4096


def _product_fn(mesh, axes, algorithm="auto"):
    spec = P(*mesh.axis_names)

    def body(v):
        return sifar_jax.sifar_psum(v[0, 0], axes, algorithm=algorithm)[None, None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


def test_init_makes_products_and_tracing_makes_none(cpu_mesh):
    mesh = cpu_mesh(shape=(2, 4), axis_names=("dp", "tp"), slot_bytes=SLOT)
    ids = {c.comm_id for c in sifar_jax.communicators()}
    [prod] = sifar_jax.communicators(("dp", "tp"))
    [swapped] = sifar_jax.communicators(("tp", "dp"))  # ranks row-major as named
    assert prod.nranks == swapped.nranks == 8 and prod.groups != swapped.groups
    x = np.arange(8 * 5, dtype=np.float32).reshape(2, 4, 5)
    for axes in (("dp", "tp"), ("tp", "dp")):
        f = _product_fn(mesh, axes)
        before = sifar_jax.stats()["sifar"]["calls"]
        got = np.asarray(f(x))
        assert sifar_jax.stats()["sifar"]["calls"] - before == 8
        np.testing.assert_array_equal(got[0, 0], x.sum((0, 1)))
    assert {c.comm_id for c in sifar_jax.communicators()} == ids, "a trace made a communicator"


def test_a_product_init_did_not_make(cpu_mesh, caplog):
    mesh = cpu_mesh(shape=(2, 4), axis_names=("dp", "tp"), init=False)
    sifar_jax.init(mesh, slot_bytes=SLOT, products=())
    assert sifar_jax.communicators(("dp", "tp")) == []
    [u] = sifar_jax.unsupported(("tp", "dp"))
    assert u.nranks == 8 and "products" not in u.reason and "init made no" in u.reason
    x = np.ones((2, 4, 5), np.float32)
    with pytest.raises(ValueError, match=r"products=\[\('dp', 'tp'\)\]"):
        _product_fn(mesh, ("dp", "tp"), "sifar").lower(x)
    with warnings.catch_warnings(), caplog.at_level(logging.DEBUG, logger="sifar_jax"):
        warnings.simplefilter("error")
        before = sifar_jax.stats()["sifar"]["calls"]
        got = np.asarray(_product_fn(mesh, ("dp", "tp"))(x))
    assert sifar_jax.stats()["sifar"]["calls"] == before
    np.testing.assert_array_equal(got[0, 0], x.sum((0, 1)))
    assert any("products=" in r.getMessage() for r in caplog.records)
    choice = sifar_jax.allreduce_choice((5,), jnp.float32, ("dp", "tp"))
    assert not choice.sifar and "products=" in choice.reason
    # Named at init: made.
    sifar_jax.init(mesh, slot_bytes=SLOT, products=[("dp", "tp")])
    assert len(sifar_jax.communicators(("dp", "tp"))) == 1 and not sifar_jax.unsupported(("dp", "tp"))
    assert sifar_jax.unsupported(("tp", "dp")), "another order is another communicator"
    before = sifar_jax.stats()["sifar"]["calls"]
    np.testing.assert_array_equal(np.asarray(_product_fn(mesh, ("dp", "tp"))(x))[0, 0], x.sum((0, 1)))
    assert sifar_jax.stats()["sifar"]["calls"] - before == 8
    with pytest.raises(ValueError, match="distinct axes of the mesh"):
        sifar_jax.init(mesh, products=[("tp", "xx")])


def test_default_products_skip_size_one_axes(cpu_mesh):
    cpu_mesh(shape=(2, 1, 2, 2), axis_names=("a", "z", "b", "c"), slot_bytes=SLOT)
    keys = {c.axis_name for c in sifar_jax.communicators() if isinstance(c.axis_name, tuple)}
    import itertools

    want = {p for k in (2, 3) for p in itertools.permutations("abc", k)}
    assert keys == want, keys


def test_reinit_says_so_once_and_stats_keep_totals(cpu_mesh):
    devs = jax.devices("cpu")
    first = Mesh(np.array(devs[:4]).reshape(1, 2, 2), ("z", "dp", "tp"))
    second = Mesh(np.array(devs[:4]).reshape(1, 2, 2)[:, ::-1], ("z", "dp", "tp"))
    sifar_jax.init(first, slot_bytes=SLOT)
    x = np.ones((2, 2, 5), np.float32)
    f = jax.jit(jax.shard_map(lambda v: sifar_jax.sifar_psum(v[0, 0], "tp")[None, None],
                              mesh=first, in_specs=P(("dp",), "tp"), out_specs=P("dp", "tp")))
    jax.block_until_ready(f(x))
    assert sifar_jax.stats()["sifar"]["calls"] == 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sifar_jax.init(second, slot_bytes=SLOT)
    lines = [str(w.message) for w in caught if "replaces" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "'dp'" in lines[0] and "'tp'" in lines[0] and "'z'" not in lines[0], lines[0]
    assert sifar_jax.stats()["sifar"]["calls"] == 4, "the replaced communicators' counts"
    sifar_jax.shutdown()
    assert sifar_jax.stats()["sifar"]["calls"] == 0, "shutdown() starts the counts again"
