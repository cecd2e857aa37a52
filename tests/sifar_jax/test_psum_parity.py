"""lax.psum behaviours from JAX's own shard_map tests, with sifar_psum in its place.

* jax.vmap over a shard_map on an explicit mesh (JAX's test_vmap_shmap_psum),
  and shard_map(axis_names=...) manual over some mesh axes only: XLA
  partitions the body over the other axes, which a custom call cannot be
  (XLA:CPU's "Side-effect ops cannot be replicated"). sifar_psum hands these
  to lax.psum at trace time ("auto", warning once) or raises (a named algorithm).
* explicit-sharding unreduced types (test_unreduced_psum_fwd_preduced_bwd,
  test_unreduced_replicated_bitcast, test_shmap_unreduced_fsdp_custom_vjp_bwd):
  the sum of an unreduced value is typed as lax.psum types it (not unreduced
  over the reduced axes any more) and served by sifar; its gradient is
  lax.psum's (preduced).
* an unbound axis: a NameError carrying lax.psum's text.

The bodies follow JAX's tests (jax-ml/jax tests/shard_map_test.py), written
anew for 8 XLA:CPU devices with sifar_jax.init on each mesh.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import sifar_jax
from sifar_jax import plan

PSUMS = {"sifar": sifar_jax.sifar_psum, "lax": lax.psum}

def _has_unreduced() -> bool:
    try:
        P(unreduced={"x"})
    except TypeError:
        return False
    return hasattr(lax, "pcast")


needs_unreduced = pytest.mark.skipif(not _has_unreduced(),
                                     reason="this jax has no unreduced/reduced types")


def sifar_calls() -> int:
    return sifar_jax.stats()["sifar"]["calls"]


def explicit_mesh(shape, names):
    """An explicit mesh of the first devices, set up for sifar_jax."""
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))
    sifar_jax.init(mesh)
    return mesh


@pytest.fixture
def clean(cpu_mesh, monkeypatch):
    """sifar_jax shut down before and after (cpu_mesh); fallback warnings fresh."""
    monkeypatch.setattr(plan, "warned", set())
    return cpu_mesh


def _ours(caught) -> list[str]:
    return [str(w.message) for w in caught if "sifar_jax" in str(w.message)]


# ------------------------------------------------------ partially manual --
def test_vmap_over_shard_map_on_an_explicit_mesh(clean):
    """JAX's test_vmap_shmap_psum: the vmapped dimension is sharded over "x",
    which the shard_map (manual over "y") leaves to XLA. Same values and
    sharding as lax.psum, eager and under jit; "auto" warns once."""
    mesh = explicit_mesh((2, 2), ("x", "y"))
    with jax.set_mesh(mesh):
        arr = jax.device_put(jnp.arange(16).reshape(2, 8), P("x", "y"))
        outs = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name, psum in PSUMS.items():
                f = jax.shard_map(lambda x, psum=psum: psum(x, axis_name="y"),
                                  in_specs=P("y"), out_specs=P(None))
                outs[name] = (jax.vmap(f)(arr), jax.jit(jax.vmap(f))(arr))
    for got, want in zip(outs["sifar"], outs["lax"]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.sharding == want.sharding == NamedSharding(mesh, P("x", None))
    np.testing.assert_array_equal(np.asarray(outs["sifar"][0]),
                                  np.arange(16).reshape(2, 2, 4).sum(1))
    ours = _ours(caught)
    assert len(ours) == 1 and "not manual over the mesh axes ('x',)" in ours[0], ours


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_shard_map_manual_over_some_axes(clean, axis_type):
    """shard_map(axis_names={"y"}) on a ("x", "y") mesh: lax.psum's result, and
    a named algorithm raises at trace time instead of falling back."""
    mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(axis_type,) * 2)
    sifar_jax.init(mesh)
    x = np.arange(32.0, dtype=np.float32).reshape(4, 8)

    def make(psum):
        return jax.jit(jax.shard_map(lambda v: psum(v, "y"), mesh=mesh, in_specs=P(None, "y"),
                                     out_specs=P(None), axis_names={"y"}))

    with jax.set_mesh(mesh):
        arr = jax.device_put(x, NamedSharding(mesh, P("x", "y")))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, want = make(sifar_jax.sifar_psum)(arr), make(lax.psum)(arr)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(got), x.reshape(4, 2, 4).sum(1))
        assert len(_ours(caught)) == 1
        named = make(lambda v, a: sifar_jax.sifar_psum(v, a, algorithm="sifar"))
        with pytest.raises(ValueError, match=r"algorithm='sifar'.*not manual over"):
            named.lower(arr)


def test_fully_manual_shard_map_on_an_explicit_mesh_is_served_by_sifar(clean):
    """The same explicit mesh, manual over every axis: sifar serves it, no warning."""
    mesh = explicit_mesh((2, 2), ("x", "y"))
    with jax.set_mesh(mesh):
        arr = jax.device_put(np.arange(16.0, dtype=np.float32).reshape(2, 8), P("x", "y"))
        f = jax.jit(jax.shard_map(lambda v: sifar_jax.sifar_psum(v, "y"), in_specs=P("x", "y"),
                                  out_specs=P("x", None)))
        before = sifar_calls()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = jax.block_until_ready(f(arr))
        assert sifar_calls() - before == 4  # one all-reduce, counted on each device
    np.testing.assert_array_equal(np.asarray(out), np.arange(16.0).reshape(2, 2, 4).sum(1))


# ------------------------------------------------------------ unreduced --
@needs_unreduced
def test_unreduced_psum_forward_and_preduced_backward(clean):
    """JAX's test_unreduced_psum_fwd_preduced_bwd: an einsum left unreduced
    over "x", summed in a shard_map; the result and its gradients (whose
    transpose is lax.psum's, preduced) as with lax.psum, the sum by sifar."""
    mesh = explicit_mesh((2,), ("x",))
    a, b = np.arange(8.0).reshape(2, 4), np.arange(24.0).reshape(4, 6)
    types, results = {}, {}
    with jax.set_mesh(mesh):
        arr1 = jax.device_put(a.astype(np.float32), P(None, "x"))
        arr2 = jax.device_put(b.astype(np.float32), P("x", None))
        for name, psum in PSUMS.items():
            def ar(z, psum=psum, name=name):
                out = psum(z, "x")
                types[name] = (jax.typeof(z), jax.typeof(out))
                return out

            ar = jax.shard_map(ar, in_specs=P(unreduced={"x"}), out_specs=P())

            def f(x, y, ar=ar):
                return ar(jnp.einsum("ab,bc->ac", x, y, out_sharding=P(unreduced={"x"}))).sum()

            before = sifar_calls()
            out = jax.jit(f)(arr1, arr2)
            g1, g2 = jax.block_until_ready(jax.jit(jax.grad(f, argnums=(0, 1)))(arr1, arr2))
            results[name] = (out, g1, g2, sifar_calls() - before)
    (z_in, z_out), (_, want_out) = types["sifar"], types["lax"]
    assert "x" in z_in.manual_axis_type.unreduced
    assert z_out == want_out and not z_out.manual_axis_type.unreduced
    out, g1, g2, calls = results["sifar"]
    assert calls >= 2 and results["lax"][3] == 0  # sifar summed it (forward, and in grad)
    assert float(out) == float(np.sum(a @ b))
    for got, want in zip((out, g1, g2), results["lax"][:3]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.sharding == want.sharding
    assert g1.sharding == NamedSharding(mesh, P(None, "x"))
    assert g2.sharding == NamedSharding(mesh, P("x", None))


@needs_unreduced
def test_unreduced_replicated_bitcast(clean):
    """JAX's test_unreduced_replicated_bitcast: a replicated value cast to
    unreduced, then summed: each device's copy counts once."""
    mesh = explicit_mesh((2,), ("x",))
    with jax.set_mesh(mesh):
        arr = jax.device_put(np.arange(4, dtype=np.int32), P("x"))
        to_unreduced = jax.jit(jax.shard_map(lambda x: lax.pcast(x, "x", to="unreduced"),
                                             in_specs=P("x"), out_specs=P(unreduced={"x"})))
        u = to_unreduced(arr)
        outs = {}
        for name, psum in PSUMS.items():
            g = jax.jit(jax.shard_map(lambda x, psum=psum: psum(x, "x"),
                                      in_specs=P(unreduced={"x"}), out_specs=P()))
            before = sifar_calls()
            outs[name] = (jax.block_until_ready(g(u)), sifar_calls() - before)
    (got, calls), (want, _) = outs["sifar"], outs["lax"]
    assert calls == 2
    assert got.shape == (2,) and got.sharding == want.sharding == NamedSharding(mesh, P(None))
    for s in got.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), [2, 4])


@needs_unreduced
def test_unreduced_fsdp_custom_vjp_backward(clean):
    """JAX's test_shmap_unreduced_fsdp_custom_vjp_bwd: in a custom_vjp's
    backward pass, reduce-scatter over "seq" leaves the weight's gradient
    unreduced over "data", and the psum over "data" (by sifar) reduces it."""
    mesh = explicit_mesh((2, 2), ("data", "seq"))
    x_np = np.arange(64.0, dtype=np.float32).reshape(8, 4, 2)
    y_np = np.arange(12.0, dtype=np.float32).reshape(2, 6)
    seen = {}
    with jax.set_mesh(mesh):
        arr1 = jax.device_put(x_np, P("data", "seq", None))
        arr2 = jax.device_put(y_np, P("seq", None))

        @jax.custom_vjp
        def f(x, y):
            ag = jax.shard_map(lambda a: lax.all_gather(a, "seq", tiled=True, to="reduced"),
                               in_specs=P("seq", None), out_specs=P(None, None, reduced={"seq"}))
            return jnp.einsum("btd,df->btf", x, ag(y))

        def f_bwd(res, g):
            x, y = res
            rs = jax.shard_map(lambda a: lax.psum_scatter(a, "seq", tiled=True),
                               in_specs=P(unreduced={"data", "seq"}),
                               out_specs=P("seq", None, unreduced={"data"}))

            def ar_body(a):
                out = sifar_jax.sifar_psum(a, "data")
                seen["types"] = (jax.typeof(a), jax.typeof(out))
                return out

            ar = jax.shard_map(ar_body, in_specs=P("seq", None, unreduced={"data"}),
                               out_specs=P("seq", None))
            x_bar = jnp.einsum("btf,df->btd", g, y, out_sharding=P("data", "seq", None))
            y_bar = jnp.einsum("btd,btf->df", x, g,
                               out_sharding=P(None, None, unreduced={"data", "seq"}))
            return x_bar, ar(rs(y_bar))

        f.defvjp(lambda x, y: (f(x, y), (x, y)), f_bwd)
        before = sifar_calls()
        g1, g2 = jax.block_until_ready(jax.jit(jax.grad(
            lambda x, y: jnp.sin(jax.jit(f)(x, y).sum()), argnums=(0, 1)))(arr1, arr2))
        assert sifar_calls() - before == 4  # one all-reduce, counted on each device
    a_in, a_out = seen["types"]
    assert a_in.manual_axis_type.unreduced == {"data"}
    assert a_out.manual_axis_type.unreduced == frozenset()
    assert a_out.manual_axis_type.varying == {"seq"}
    want1, want2 = jax.grad(lambda x, y: jnp.sin((x @ y).sum()), argnums=(0, 1))(x_np, y_np)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(want1), rtol=2e-4)
    np.testing.assert_allclose(np.asarray(g2), np.asarray(want2), rtol=2e-4)


# ----------------------------------------------------------- unbound axis --
def test_unbound_axis_says_what_lax_psum_says(clean):
    """JAX's test_psum_not_under_shmap_error matches lax.psum's text."""
    clean(2)
    with pytest.raises(NameError) as lax_error:
        jax.jit(lambda x: lax.psum(x, "x"))(jnp.arange(8.0))
    with pytest.raises(sifar_jax.UnboundAxisError) as ours:
        jax.jit(lambda x: sifar_jax.sifar_psum(x, "x"))(jnp.arange(8.0))
    assert str(lax_error.value) in str(ours.value)
    assert "Found an unbound axis name: x" in str(ours.value)
    assert isinstance(ours.value, NameError) and isinstance(ours.value, ValueError)


# -------------------------------------------------------- jaxpr structure --
def _body(closed_jaxpr) -> list[str]:
    """The primitive names in the body of a jaxpr's one shard_map."""
    (smap,) = closed_jaxpr.jaxpr.eqns
    return [e.primitive.name for e in smap.params["jaxpr"].eqns]


@pytest.mark.parametrize("shape", [(1,), (3, 5), (4,)], ids=["pad", "reshape+pad", "lines"])
@pytest.mark.parametrize("out_spec", [P(), P("x")], ids=["fan-in", "implicit-fan-out"])
def test_jaxpr_holds_the_all_reduce_alone(clean, shape, out_spec):
    """JAX's test_fanin_psum_transposes_to_fanout and
    test_psum_with_implicit_fanout_self_transposes: the body holds the
    all-reduce where lax.psum's holds psum, and nothing else (the payload is
    flattened and padded to whole lines in the lowering, not in the jaxpr),
    so the transpose (vjp) is equation for equation lax.psum's. Values equal."""
    mesh = clean(4, axis_names=("x",))
    x = np.arange(4 * int(np.prod(shape)), dtype=np.float32).reshape(4 * shape[0], *shape[1:])
    jaxprs, values = {}, {}
    for name, psum in PSUMS.items():
        f = jax.shard_map(lambda v, psum=psum: psum(v, "x"), mesh=mesh, in_specs=P("x"),
                          out_specs=out_spec)
        out, vjp = jax.vjp(f, x)
        jaxprs[name] = (_body(jax.make_jaxpr(f)(x)), _body(jax.make_jaxpr(vjp)(out)))
        values[name] = (jax.jit(f)(x), vjp(out)[0])
    (fwd, bwd), (lax_fwd, lax_bwd) = jaxprs["sifar"], jaxprs["lax"]
    assert fwd == ["sifar_allreduce" if "psum" in p else p for p in lax_fwd], (fwd, lax_fwd)
    assert bwd == lax_bwd, (bwd, lax_bwd)
    for got, want in zip(values["sifar"], values["lax"]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
