"""sifar_psum against lax.psum under JAX's transformations, row by row.

Every function below computes one body twice, once with sifar_psum and once
with lax.psum, in one jitted shard_map, and records both results' types at
trace time. Each test then checks, as mpi4jax tests its ops:

* types: structure, shapes, dtypes, weak types and varying axes equal lax.psum's;
* values: the sifar sums bit for bit against the rank-order float32 reference
  (what the protocol computes) and bit-identical on every rank; integer and
  lax.psum-served results equal lax.psum exactly; what flows through lax.psum's
  own rules (tangents, transposes) equal lax.psum's bit for bit; a tolerance
  only where a value depends on a sum that lax.psum adds in another order;
* that sifar really ran (the call counters), or that the fallback warned.

On 2, 4 and 8 CPU devices, with check_vma on and off. Functions are built and
compiled once per (ranks, check_vma); communicators live for a test class.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sifar_jax
from conftest import gpu_device_list
from reference import (
    assert_bit_identical_rows,
    assert_bits_equal,
    assert_close_to_psum,
    make_inputs,
    rank_order_sum,
    rng_for,
)
from sifar_jax import plan

N_RANKS = (2, 4, 8)
SLOT = 4096
CHECK_VMA = pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
BF16 = np.dtype(ml_dtypes.bfloat16)
PSUMS = (sifar_jax.sifar_psum, jax.lax.psum)

_FUNCS: dict = {}


class Paired:
    """jit(shard_map(body(psum, ...))) for psum = sifar_psum and lax.psum.

    Call it to get (sifar result, lax.psum result); `.types` holds their types,
    recorded when it was traced."""

    def __init__(self, mesh, body, in_specs, out_specs, check_vma):
        self.types = None

        def both(*args):
            outs = tuple(body(psum, *args) for psum in PSUMS)
            self.types = tuple(jax.tree.map(jax.typeof, o) for o in outs)
            return outs

        self.fn = jax.jit(
            jax.shard_map(
                both, mesh=mesh, in_specs=in_specs, out_specs=(out_specs, out_specs),
                check_vma=check_vma,
            )
        )

    def __call__(self, *args):
        sifar, lax = self.fn(*args)
        return jax.tree.map(np.asarray, sifar), jax.tree.map(np.asarray, lax)

    def assert_same_types(self):
        sifar, lax = self.types
        assert jax.tree.structure(sifar) == jax.tree.structure(lax)
        for path, a, b in zip(
            jax.tree_util.tree_flatten_with_path(sifar)[0], jax.tree.leaves(sifar),
            jax.tree.leaves(lax),
        ):
            assert a == b and a.weak_type == b.weak_type, (path[0], a, b, a.sharding, b.sharding)


def once(key, build):
    """build() once per key (the same devices give equal meshes, and axis keys
    survive shutdown/init, so the executables stay valid across classes)."""
    if key not in _FUNCS:
        _FUNCS[key] = build()
    return _FUNCS[key]


def paired(name, mesh, body, in_specs, out_specs, check_vma) -> Paired:
    return once((name, mesh, check_vma),
                lambda: Paired(mesh, body, in_specs, out_specs, check_vma))


def sifar_calls() -> int:
    return sifar_jax.stats()["sifar"]["calls"]


def assert_exact_sum(got_rows, parts, what):
    """got_rows: (n, ...) one result per rank; parts: (n, ...) the partials."""
    assert_bit_identical_rows(got_rows, what)
    assert_bits_equal(got_rows[0], rank_order_sum(parts), what)


# Every CPU rank count, and the GPUs where two or more are visible.
MESHES = [*N_RANKS, pytest.param("gpu", marks=pytest.mark.gpu)]


def _devices_and_size(param):
    """(devices, rank count) for a MESHES entry; skips the GPU one without GPUs."""
    if param != "gpu":
        return None, param
    devs = gpu_device_list()
    if len(devs) < 2:
        pytest.skip("needs at least 2 CUDA GPUs")
    return devs, 1 << (len(devs).bit_length() - 1)  # the largest power of two


@pytest.fixture(scope="class", params=MESHES, ids=lambda p: p if p == "gpu" else f"n{p}")
def tp(request, mesh_factory):
    """A 1-D ("tp",) mesh with a 4 KB slot."""
    devices, n = _devices_and_size(request.param)
    factory = mesh_factory(devices)
    factory.close()
    yield factory(n, slot_bytes=SLOT)
    factory.close()


@pytest.fixture(scope="class", params=MESHES, ids=lambda p: p if p == "gpu" else f"n{p}")
def dp_tp(request, mesh_factory):
    """A 2-D ("dp", "tp") mesh (2, n/2) with a 4 KB slot."""
    devices, n = _devices_and_size(request.param)
    factory = mesh_factory(devices)
    factory.close()
    yield factory(shape=(2, n // 2), axis_names=("dp", "tp"), slot_bytes=SLOT)
    factory.close()


# ----------------------------------------------------------------- autodiff --
def _autodiff_body(psum, x, t, c):
    """jvp, vjp, linear_transpose, grad (linear, nonlinear, second order,
    under jax.checkpoint) of psum over "tp". c is invariant: a cotangent of the
    sum's type."""
    v, t = x[0], t[0]
    s = lambda u: psum(u, "tp")  # noqa: E731
    primal, tangent = jax.jvp(s, (v,), (t,))
    out, pullback = jax.vjp(s, v)
    (vjp_ct,) = pullback(c)
    (transposed,) = jax.linear_transpose(s, v)(c)
    grad_linear = jax.grad(lambda u: jnp.sum(s(u) * c))(v)
    grad_nonlinear = jax.grad(lambda u: jnp.sum(jnp.sin(s(u * u))))(v)
    grad2 = jax.grad(lambda u: jnp.sum(jax.grad(lambda w: jnp.sum(s(w * w) ** 2))(u) * c))(v)
    remat = jax.grad(lambda u: jnp.sum(jax.checkpoint(lambda w: jnp.sin(s(w)))(u) * c))(v)
    rows = dict(primal=primal, tangent=tangent, out=out, vjp=vjp_ct, transpose=transposed,
                grad_linear=grad_linear, grad_nonlinear=grad_nonlinear, grad2=grad2, remat=remat)
    return {k: r[None] for k, r in rows.items()}


def _outer_grad_fn(mesh, check_vma):
    """grad taken outside shard_map (linear and nonlinear losses)."""

    def loss(x, c, psum, nonlinear):
        def body(v, c):
            y = psum(v[0] * v[0] if nonlinear else v[0], "tp")
            return (jnp.sin(y) if nonlinear else y * c)[None]

        f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P()), out_specs=P("tp"),
                          check_vma=check_vma)
        return jnp.sum(f(x, c))

    return once(("outer", mesh, check_vma), lambda: jax.jit(
        lambda x, c: [[jax.grad(loss)(x, c, psum, nl) for nl in (False, True)] for psum in PSUMS]
    ))


class TestAutodiff:
    @CHECK_VMA
    def test_inside_shard_map(self, tp, check_vma):
        n = tp.shape["tp"]
        f = paired("autodiff", tp, _autodiff_body, (P("tp"), P("tp"), P()), P("tp"), check_vma)
        rng = rng_for(n, "autodiff", check_vma)
        x, t = make_inputs(rng, n, (37,), np.float32), make_inputs(rng, n, (37,), np.float32)
        c = make_inputs(rng, 1, (37,), np.float32)[0]
        before = sifar_calls()
        got, want = f(x, t, c)
        f.assert_same_types()
        # The primal sums of the nine rows that sum x itself by sifar (jvp, vjp;
        # the rest differentiate other sums) all ran as sifar all-reduces.
        assert sifar_calls() - before >= 2 * n
        for name in ("primal", "out"):
            assert_exact_sum(got[name], x, f"{name} n={n}")
        # Tangents and transposes are lax.psum's own: bit for bit.
        for name in ("tangent", "vjp", "transpose", "grad_linear"):
            assert_bits_equal(got[name], want[name], f"{name} n={n} check_vma={check_vma}")
        # These depend on a primal sum, which lax.psum adds in another order.
        for name in ("grad_nonlinear", "grad2", "remat"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4 * n, atol=1e-5 * n,
                                       err_msg=name)

    @CHECK_VMA
    def test_grad_outside_shard_map(self, tp, check_vma):
        n = tp.shape["tp"]
        rng = rng_for(n, "outer", check_vma)
        x = make_inputs(rng, n, (1, 29), np.float32)
        c = make_inputs(rng, 1, (29,), np.float32)[0]
        before = sifar_calls()
        outs = jax.tree.map(np.asarray, _outer_grad_fn(tp, check_vma)(x, c))  # blocks
        (lin, nonlin), (lin_psum, nonlin_psum) = outs
        # The nonlinear loss needs its primal sum (by sifar); the linear one's
        # is unused (kept on the CPU, where the call is side-effecting).
        assert sifar_calls() - before >= n
        assert_bits_equal(lin, lin_psum, "linear loss")
        np.testing.assert_allclose(nonlin, nonlin_psum, rtol=1e-4 * n, atol=1e-5 * n)


# --------------------------------------------------------------------- vmap --
def _vmap_body(psum, x):
    v = x[0]  # (B, S)
    over_rows = jax.vmap(lambda u: psum(u, "tp"))(v)
    over_cols = jax.vmap(lambda u: psum(u, "tp"), in_axes=1, out_axes=1)(v)
    return dict(rows=over_rows[None], cols=over_cols[None])


def _vmap_named_body(psum, x):
    """A vmap axis and a mesh axis in one call."""
    return jax.vmap(lambda u: psum(u, ("i", "tp")), axis_name="i")(x[0])[None]


def _vmap_around_fn(mesh, check_vma):
    def around(psum):
        return jax.vmap(jax.shard_map(lambda v: psum(v[0], "tp")[None], mesh=mesh,
                                      in_specs=P("tp"), out_specs=P("tp"), check_vma=check_vma))

    return once(("around", mesh, check_vma),
                lambda: jax.jit(lambda xb: [around(psum)(xb) for psum in PSUMS]))


class TestVmap:
    @CHECK_VMA
    def test_inside_shard_map(self, tp, check_vma):
        n = tp.shape["tp"]
        f = paired("vmap", tp, _vmap_body, P("tp"), P("tp"), check_vma)
        x = make_inputs(rng_for(n, "vmap", check_vma), n, (3, 40), np.float32)
        before = sifar_calls()
        got, want = f(x)
        f.assert_same_types()
        assert sifar_calls() - before == 2 * n, "each vmap is one all-reduce of the stacked payload"
        for name in ("rows", "cols"):
            assert_exact_sum(got[name], x, f"vmap {name} n={n}")

    @CHECK_VMA
    def test_around_shard_map(self, tp, check_vma):
        n = tp.shape["tp"]
        xb = make_inputs(rng_for(n, "around", check_vma), n, (5, 24), np.float32)
        xb = np.ascontiguousarray(np.moveaxis(xb, 0, 1))  # (B=5, n, 24)
        before = sifar_calls()
        got, want = (np.asarray(a) for a in _vmap_around_fn(tp, check_vma)(xb))
        assert sifar_calls() - before == n
        assert got.shape == want.shape == (5, n, 24)
        for b in range(5):
            assert_exact_sum(got[b], xb[b], f"vmap around shard_map, batch {b}")
            assert_close_to_psum(got[b], want[b], np.float32, n)

    def test_vmap_and_mesh_axis(self, tp):
        """("i", "tp"): lax.psum over the vmap axis, sifar over the mesh axis."""
        n = tp.shape["tp"]
        f = paired("vmap-named", tp, _vmap_named_body, P("tp"), P("tp"), False)
        x = make_inputs(rng_for(n, "named"), n, (4, 16), np.float32)
        before = sifar_calls()
        got, want = f(x)
        f.assert_same_types()
        assert sifar_calls() - before == n
        assert_bit_identical_rows(got, "vmap+mesh")
        assert_close_to_psum(got[0], want[0], np.float32, 4 * n)

    def test_vmap_and_mesh_axis_under_check_vma_fails_like_lax_psum(self, tp):
        """lax.psum rejects a vmap axis inside shard_map(check_vma=True): same error."""
        n = tp.shape["tp"]
        x = jax.ShapeDtypeStruct((n, 4, 16), jnp.float32)
        errors = []
        for psum in PSUMS:
            def body(v, psum=psum):
                return _vmap_named_body(psum, v)

            f = jax.jit(jax.shard_map(body, mesh=tp, in_specs=P("tp"), out_specs=P("tp")))
            with pytest.raises(Exception) as e:
                f.lower(x)
            errors.append((type(e.value), str(e.value).splitlines()[0]))
        assert errors[0] == errors[1]


@pytest.mark.parametrize("shape", [(4,), (3, 5)], ids=["4", "3x5"])
def test_vmap_axis_without_mesh(shape):
    """A vmap axis name and no mesh at all (no init either): just lax.psum."""
    x = make_inputs(rng_for("vmap-only", shape), shape[0], shape[1:], np.float32)
    tree = {"a": x, "b": (x.astype(BF16), np.arange(shape[0]) % 2 == 0)}
    got, want = (
        jax.jit(jax.vmap(lambda t, psum=psum: psum(t, "i"), axis_name="i"))(tree) for psum in PSUMS
    )
    jax.tree.map(assert_bits_equal, got, want)
    nested = [
        jax.vmap(jax.vmap(lambda u, psum=psum: psum(u, ("i", "j")), axis_name="j"), axis_name="i")(
            x.reshape(shape[0], 1, -1)
        )
        for psum in PSUMS
    ]
    assert_bits_equal(*nested)


# ------------------------------------------------------------------ pytrees --
def _tree_body(psum, a, b, c, d):
    tree = {"a": a[0], "bc": (b[0], [c[0], d[0]])}
    out = psum(tree, "tp")
    return jax.tree.map(lambda leaf: leaf[None], out)


def _packed_body(psum, a, b, c):
    """Three float32 leaves of 1,600 bytes: past the 4 KB slot together."""
    return tuple(leaf[None] for leaf in psum((a[0], b[0], c[0]), "tp"))


class TestPytrees:
    @CHECK_VMA
    def test_mixed_tree(self, tp, check_vma):
        n = tp.shape["tp"]
        spec = P("tp")
        f = paired("tree", tp, _tree_body, (spec,) * 4, spec, check_vma)
        rng = rng_for(n, "tree", check_vma)
        a = make_inputs(rng, n, (3, 5), np.float32)
        b = make_inputs(rng, n, (7,), BF16)
        c = make_inputs(rng, n, (2, 2), np.float16)
        d = make_inputs(rng, n, (11,), np.float32)
        before = sifar_calls()
        got, want = f(a, b, c, d)
        f.assert_same_types()
        assert jax.tree.structure(got) == jax.tree.structure({"a": 0, "bc": (0, [0, 0])})
        # One payload per dtype: float32 (a and d together), bfloat16, float16.
        assert sifar_calls() - before == 3 * n
        for name, g, x in (("a", got["a"], a), ("b", got["bc"][0], b), ("c", got["bc"][1][0], c),
                           ("d", got["bc"][1][1], d)):
            assert_exact_sum(g, x, f"leaf {name} n={n}")

    def test_packed_into_slots(self, tp):
        n = tp.shape["tp"]
        spec = P("tp")
        f = paired("packed", tp, _packed_body, (spec,) * 3, (spec,) * 3, True)
        rng = rng_for(n, "packed")
        xs = [make_inputs(rng, n, (400,), np.float32) for _ in range(3)]
        before = sifar_calls()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every leaf fits a slot: no fallback
            got, _ = f(*xs)
        assert sifar_calls() - before == 2 * n, "two payloads: (a, b) and (c)"
        for i, (g, x) in enumerate(zip(got, xs)):
            assert_exact_sum(g, x, f"packed leaf {i}")


# ------------------------------------------------------------------- dtypes --
INT_DTYPES = (np.int32, np.uint32, np.int8, np.uint16)


def _dtype_body(psum, *xs):
    return tuple(out[None] for out in psum([x[0] for x in xs], "tp"))


def _summed_as(dtype):
    return np.dtype(np.int32) if np.dtype(dtype) == np.bool_ else np.dtype(dtype)


class TestDtypes:
    @CHECK_VMA
    def test_every_dtype(self, tp, check_vma, monkeypatch):
        """Integers, bool (counts), complex: lax.psum's result exactly; the ones
        not summed natively go to lax.psum with one warning naming them."""
        n = tp.shape["tp"]
        dtypes = INT_DTYPES + (np.bool_, np.complex64)
        spec = P("tp")
        rng = rng_for(n, "dtypes", check_vma)
        xs = []
        for dt in dtypes:
            if dt == np.bool_:
                xs.append(rng.random((n, 9)) < 0.5)
            elif dt == np.complex64:
                xs.append((make_inputs(rng, n, (5,), np.float32) + 1j).astype(dt))
            else:  # nonzero, no overflow in the sum
                hi = min(np.iinfo(dt).max // n, 1000)
                xs.append(rng.integers(1, hi, size=(n, 6)).astype(dt))
        monkeypatch.setattr(plan, "warned", set())
        fresh = ("dtypes", tp, check_vma) not in _FUNCS
        f = paired("dtypes", tp, _dtype_body, (spec,) * len(xs), (spec,) * len(xs), check_vma)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, want = f(*xs)
        f.assert_same_types()
        for dt, g, w in zip(dtypes, got, want):
            assert g.dtype == w.dtype == _summed_as(dt), dt
            np.testing.assert_array_equal(g, w, err_msg=str(dt))
            np.testing.assert_array_equal(g[0], xs[dtypes.index(dt)].astype(_summed_as(dt)).sum(0))
        if fresh:  # traced in this test: the warning came now
            text = " ".join(str(w.message) for w in caught)
            for dt in dtypes:
                if _summed_as(dt) not in sifar_jax.SUPPORTED_DTYPES:
                    assert f"dtype {_summed_as(dt)} is not summed natively" in text, (dt, text)


# ------------------------------------------------------ scalars, empty, 0-d --
def _scalars_body(psum, x):
    v = x[0]
    weak = jax.lax.axis_index("tp") * 1.5 + 1.0  # a weakly typed traced value
    return dict(
        py_float=psum(2.5, "tp"),
        py_int=psum(3, "tp"),
        py_bool=psum(True, "tp"),
        numpy_0d=psum(np.float32(1.25), "tp"),
        traced_0d=psum(v[0, 0], "tp"),
        weak=psum(weak, "tp"),
        mixed=psum((2.0, v[0, 1]), "tp"),
        empty=psum(v[:, :0], "tp"),
        empty_int=psum(v[:0].astype(jnp.int32), "tp"),
    )


class TestScalarsAndEmpty:
    @CHECK_VMA
    def test_same_result_and_type(self, tp, check_vma):
        n = tp.shape["tp"]
        f = paired("scalars", tp, _scalars_body, P("tp"), P(), check_vma)
        x = make_inputs(rng_for(n, "scalars", check_vma), n, (2, 3), np.float32)
        got, want = f(x)
        f.assert_same_types()
        for name in ("py_float", "py_int", "py_bool", "numpy_0d", "empty", "empty_int"):
            assert_bits_equal(got[name], want[name], name)  # lax.psum's own result
        assert got["empty"].shape == (2, 0) and got["empty_int"].shape == (0, 3)
        assert_bits_equal(got["traced_0d"], rank_order_sum(x[:, 0, 0]), "traced 0-d")
        assert_bits_equal(got["weak"], np.float32(sum(r * 1.5 + 1.0 for r in range(n))), "weak")
        assert_bits_equal(got["mixed"][0], np.float32(2.0 * n), "mixed constant")
        assert_bits_equal(got["mixed"][1], rank_order_sum(x[:, 0, 1]), "mixed traced")


# --------------------------------------------------------- axis_index_groups --
def _groups(n):
    return [list(range(i, i + 2)) for i in range(0, n, 2)]


class TestAxisIndexGroups:
    def test_served_by_lax_psum(self, tp, monkeypatch):
        """shard_map(check_vma=False) accepts axis_index_groups: lax.psum serves it."""
        n = tp.shape["tp"]
        groups = _groups(n)

        def body(psum, x):
            return psum(x[0], "tp", axis_index_groups=groups)[None]

        monkeypatch.setattr(plan, "warned", set())
        f = paired("groups", tp, body, P("tp"), P("tp"), False)
        x = make_inputs(rng_for(n, "groups"), n, (10,), np.float32)
        with pytest.warns(UserWarning, match="axis_index_groups"):
            got, want = f(x)
        assert_bits_equal(got, want, "axis_index_groups")
        for g in groups:
            np.testing.assert_allclose(got[g[0]], x[g].sum(0), rtol=1e-6)

    def test_check_vma_error_is_lax_psums(self, tp):
        n = tp.shape["tp"]
        x = jax.ShapeDtypeStruct((n, 10), jnp.float32)
        errors = []
        for psum in PSUMS:
            def body(v, psum=psum):
                return psum(v, "tp", axis_index_groups=_groups(n))

            f = jax.jit(jax.shard_map(body, mesh=tp, in_specs=P("tp"), out_specs=P("tp")))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with pytest.raises(Exception) as e:
                    f.lower(x)
            errors.append((type(e.value), str(e.value).splitlines()[:1]))
        assert errors[0] == errors[1]


# -------------------------------------------------------------- several axes --
def _axes_body(psum, x, y):
    v, w = x[0, 0], y[0, 0]
    return dict(
        dp_tp=psum(v, ("dp", "tp"))[None, None],
        tp_dp=psum(v, ("tp", "dp"))[None, None],
        tp=psum(v, "tp")[None, None],
        dp=psum(v, "dp")[None, None],
        tree=jax.tree.map(lambda a: a[None, None], psum({"f": v, "b": w}, ("dp", "tp"))),
    )


class TestSeveralAxes:
    @CHECK_VMA
    def test_product_communicator(self, dp_tp, check_vma):
        """One all-reduce over the product group; rank order is row-major over
        the axes as named, like lax.axis_index(axes)."""
        dp, tp = dp_tp.devices.shape
        n = dp * tp
        spec = P("dp", "tp")
        f = paired("axes", dp_tp, _axes_body, (spec, spec), spec, check_vma)
        rng = rng_for(n, "axes", check_vma)
        x = make_inputs(rng, n, (21,), np.float32).reshape(dp, tp, 21)
        y = make_inputs(rng, n, (9,), BF16).reshape(dp, tp, 9)
        before = sifar_calls()
        got, want = f(x, y)
        f.assert_same_types()
        # dp_tp, tp_dp, tp, dp, and the tree's two dtypes: one all-reduce each,
        # but none over an axis of one device (lax.psum's, free).
        assert sifar_calls() - before == (6 if tp > 1 else 5) * n
        flat = lambda a: a.reshape(n, *a.shape[2:])  # noqa: E731
        assert_exact_sum(flat(got["dp_tp"]), x.reshape(n, 21), "(dp, tp)")
        assert_exact_sum(flat(got["tp_dp"]), x.transpose(1, 0, 2).reshape(n, 21), "(tp, dp)")
        for i in range(dp):
            assert_exact_sum(got["tp"][i], x[i], f"tp at dp={i}")
        for j in range(tp):
            assert_exact_sum(got["dp"][:, j], x[:, j], f"dp at tp={j}")
        assert_exact_sum(flat(got["tree"]["f"]), x.reshape(n, 21), "tree float32")
        assert_exact_sum(flat(got["tree"]["b"]), y.reshape(n, 9), "tree bfloat16")
        assert_close_to_psum(got["dp_tp"][0, 0], want["dp_tp"][0, 0], np.float32, n)
        if tp > 1:
            assert ("dp", "tp") in {c.axis_name for c in sifar_jax.communicators()}

    def test_varying_type_refuses_a_wrong_out_specs(self, dp_tp):
        """Issue 9.6: sifar_psum(x, "tp") varies over "dp", exactly like
        lax.psum, so shard_map refuses out_specs=P() at trace time."""
        dp, tp = dp_tp.devices.shape
        x = jax.ShapeDtypeStruct((dp, tp * 4), jnp.float32)
        errors, types = [], []
        for psum in PSUMS:
            def body(v, psum=psum):
                y = psum(v, "tp")
                types.append(jax.typeof(y))
                return y

            f = jax.jit(jax.shard_map(body, mesh=dp_tp, in_specs=P("dp", "tp"), out_specs=P()))
            with pytest.raises(ValueError, match="out_specs") as e:
                f.lower(x)
            errors.append(str(e.value))
            ok = jax.jit(jax.shard_map(body, mesh=dp_tp, in_specs=P("dp", "tp"),
                                       out_specs=P("dp")))
            ok.lower(x)  # the right spec is accepted
        assert errors[0] == errors[1]
        assert types[0] == types[1]
        assert sifar_jax._jax_compat.varying_axes(types[0]) == {"dp"}


# ----------------------------------------------------------------- ordering --
def _allreduce_eqns(jaxpr) -> list:
    """The sifar_allreduce equations of a jaxpr and its sub-jaxprs, in order."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sifar_allreduce":
            found.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _allreduce_eqns(inner)
    return found


@CHECK_VMA
def test_transformed_calls_join_their_jaxprs_chain(cpu_mesh, check_vma):
    """Calls made under grad and vmap land in the enclosing jaxpr's chain,
    each ordered after the one before (not on a chain of their own, which
    could share a lane with it and run concurrently)."""
    mesh = cpu_mesh(4, slot_bytes=SLOT)

    def body(x):
        v = x[0]
        a = sifar_jax.sifar_psum(v, "tp")
        g = jax.grad(lambda u: jnp.sum(jnp.sin(sifar_jax.sifar_psum(u, "tp"))))(v)
        b = jax.vmap(lambda u: sifar_jax.sifar_psum(u, "tp"))(v.reshape(2, -1))
        _, t = jax.jvp(lambda u: sifar_jax.sifar_psum(u * u, "tp"), (v,), (v,))
        return (a + g + b.reshape(-1) + t)[None]

    f = jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=check_vma)
    eqns = _allreduce_eqns(jax.make_jaxpr(f)(np.ones((4, 8), np.float32)).jaxpr)
    assert len(eqns) == 4
    assert len({e.params["plan"].chain for e in eqns}) == 1, [e.params["plan"].chain for e in eqns]
    for prev, eqn in zip(eqns, eqns[1:]):
        assert eqn.invars[1:] == prev.outvars, "each call takes the previous result as operand"
