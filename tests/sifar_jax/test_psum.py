"""Correctness of every portable algorithm on the CPU reference backend.

Each XLA:CPU host device is a rank on its own thread, so these tests run the
real protocol (slots, epochs, barriers, validation, retries). To stay within a
few minutes on 2 cores, every jitted function is built once per (ranks,
algorithm) and compiled once per input shape/dtype, and communicators live
for a whole test class (one class instance per rank count).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sifar_jax
from reference import (
    assert_bit_identical_rows,
    assert_close_to_psum,
    assert_matches_reference,
    chain_reference_f32,
    int_view,
    make_inputs,
    reference,
    rng_for,
)
from sifar_jax import plan

N_RANKS = (2, 4, 8)
ALGS = tuple(a for a in sifar_jax.ALGORITHMS if a != "multicast")
DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
SLOT = 4096  # bytes: small, so "past the slot" stays cheap

# Shapes, with "S" standing for the number of elements that fill the slot.
SHAPES = {
    "1": (1,),
    "3": (3,),  # 6 / 12 bytes: not a multiple of 16
    "8": (8,),
    "37": (37,),
    "250": (250,),
    "3x5": (3, 5),
    "2x3x7": (2, 3, 7),
    "slot-1": ("S-1",),
    "slot": ("S",),
    "4xslot/4": (4, "S/4"),
}


def resolve(shape, dtype) -> tuple[int, ...]:
    s = SLOT // np.dtype(dtype).itemsize
    table = {"S": s, "S-1": s - 1, "S/2": s // 2, "S/4": s // 4, "S+1": s + 1}
    return tuple(table[d] if isinstance(d, str) else d for d in shape)


# ----------------------------------------------------------------- functions --
# Built once per (ranks, algorithm, ...) and reused by every class instance:
# meshes of the same devices compare equal, and the communicator's axis key
# is stable across shutdown()/init(), so compiled executables stay valid.
_FUNCS: dict = {}


def allreduce_fn(mesh, algorithm):
    """x: (n, *shape) -> (sifar_psum result, lax.psum result), one row per rank."""
    key = ("ar", mesh.shape["tp"], algorithm)
    if key not in _FUNCS:

        def body(x):
            v = x[0]
            return (
                sifar_jax.sifar_psum(v, "tp", algorithm=algorithm)[None],
                jax.lax.psum(v, "tp")[None],
            )

        _FUNCS[key] = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=(P("tp"), P("tp")))
        )
    return _FUNCS[key]


def repeat_fn(mesh, algorithm, repeat):
    key = ("rep", mesh.shape["tp"], algorithm, repeat)
    if key not in _FUNCS:

        def body(x):
            return sifar_jax.benchmarking.psum_repeated(x[0], "tp", repeat, algorithm=algorithm)[None]

        _FUNCS[key] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    return _FUNCS[key]


def chain_fn(mesh, algorithms, steps):
    """y <- reduce(0.5 * y + x[k]) / n for k < steps, in one jit; returns every y.

    algorithms: a tuple cycled through the chain, or None for lax.psum.
    Each step depends on the previous one and on fresh data, so a stale slot
    read changes the result.
    """
    n = mesh.shape["tp"]
    key = ("chain", n, algorithms, steps)
    if key not in _FUNCS:

        def body(y0, xs):
            y, outs = y0[0], []
            for k in range(steps):
                v = 0.5 * y + xs[0, k]
                if algorithms is None:
                    s = jax.lax.psum(v, "tp")
                else:
                    s = sifar_jax.sifar_psum(v, "tp", algorithm=algorithms[k % len(algorithms)])
                y = s / n
                outs.append(y)
            return jnp.stack(outs)[None]

        _FUNCS[key] = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp")), out_specs=P("tp"))
        )
    return _FUNCS[key]


@pytest.fixture(scope="class", params=N_RANKS, ids=lambda n: f"n{n}")
def tp(request, mesh_factory):
    """A 1-D ("tp",) mesh of n CPU devices, initialised with a 4 KB slot."""
    factory = mesh_factory()
    factory.close()  # clean registry, whatever ran before
    mesh = factory(request.param, slot_bytes=SLOT)
    yield mesh
    factory.close()


# -------------------------------------------------------------------- tests --
class TestMatrix:
    """Every algorithm x dtype x size x rank count vs float64 and lax.psum."""

    @pytest.mark.parametrize("shape_id", list(SHAPES))
    @pytest.mark.parametrize("dtype_name", list(DTYPES))
    @pytest.mark.parametrize("algorithm", ALGS)
    def test_allreduce(self, tp, algorithm, dtype_name, shape_id):
        n = tp.shape["tp"]
        dtype = DTYPES[dtype_name]
        shape = resolve(SHAPES[shape_id], dtype)
        f = allreduce_fn(tp, algorithm)
        for call in range(2):  # the second call reuses the executable and the other slot
            x = make_inputs(rng_for(n, algorithm, dtype_name, shape_id, call), n, shape, dtype)
            what = f"n={n} {algorithm} {dtype_name} {shape} call {call}"
            got, lax_got = (np.asarray(a) for a in f(x))
            assert got.shape == (n, *shape) and got.dtype == dtype, what
            assert_bit_identical_rows(got, what)
            assert_matches_reference(got[0], reference(x), n, what)
            assert_close_to_psum(got[0], lax_got[0], dtype, n, what)

    @pytest.mark.parametrize("dtype_name", list(DTYPES))
    @pytest.mark.parametrize("shape", [("S+1",), (3, "S/2")], ids=["slot+1", "3xslot/2"])
    def test_auto_past_slot_falls_back(self, tp, monkeypatch, dtype_name, shape, caplog):
        """Past the slot, "auto" hands the payload to lax.psum quietly: no
        warning (large payloads are lax.psum's), the reason at debug level and
        in allreduce_choice."""
        import logging
        import warnings

        n = tp.shape["tp"]
        dtype = DTYPES[dtype_name]
        shape = resolve(shape, dtype)
        monkeypatch.setattr(plan, "warned", set())  # the warning is once per reason
        x = make_inputs(rng_for(n, "fallback", dtype_name, shape), n, shape, dtype)
        before = sifar_jax.stats()

        def body(v):
            return sifar_jax.sifar_psum(v[0], "tp")[None]

        f = jax.jit(jax.shard_map(body, mesh=tp, in_specs=P("tp"), out_specs=P("tp")))
        with warnings.catch_warnings(), caplog.at_level(logging.DEBUG, logger="sifar_jax"):
            warnings.simplefilter("error")
            got = np.asarray(f(x))
        assert any("slot" in r.getMessage() for r in caplog.records), caplog.records
        choice = sifar_jax.allreduce_choice(x.shape[1:], dtype, "tp")
        assert not choice.sifar and "slot" in choice.reason and not choice.raises, choice
        assert_close_to_psum(got[0], reference(x), dtype, n, f"fallback n={n} {shape}")
        after = sifar_jax.stats()
        assert after == before, "the fallback must not run a sifar all-reduce"

    def test_auto_is_sifar(self, tp):
        n = tp.shape["tp"]
        x = make_inputs(rng_for(n, "auto"), n, (100,), DTYPES["bfloat16"])
        before = sifar_jax.stats()["sifar"]["calls"]
        auto = np.asarray(allreduce_fn(tp, "auto")(x)[0])  # blocks: stats are final
        assert sifar_jax.stats()["sifar"]["calls"] - before == n
        explicit = np.asarray(allreduce_fn(tp, "sifar")(x)[0])
        np.testing.assert_array_equal(int_view(auto), int_view(explicit))

    def test_empty(self, tp):
        n = tp.shape["tp"]
        got, _ = allreduce_fn(tp, "sifar")(np.zeros((n, 0), np.float32))
        assert got.shape == (n, 0)


class TestSequences:
    """Back-to-back all-reduces: slot alternation, interleaving, psum_repeated, stats."""

    STEPS = 64

    @pytest.mark.parametrize("algorithm", ALGS + ("mixed",))
    def test_chain_of_64(self, tp, algorithm):
        n = tp.shape["tp"]
        size = 37  # odd: padded
        algs = ALGS if algorithm == "mixed" else (algorithm,)
        rng = rng_for(n, "chain", algorithm)
        y0 = rng.uniform(0.5, 2.0, (n, size)).astype(np.float32)
        xs = rng.uniform(0.5, 2.0, (n, self.STEPS, size)).astype(np.float32)
        before = sifar_jax.stats()
        got = np.asarray(chain_fn(tp, algs, self.STEPS)(y0, xs))  # (n, steps, size)
        lax_got = np.asarray(chain_fn(tp, None, self.STEPS)(y0, xs))
        after = sifar_jax.stats()
        assert_bit_identical_rows(got, f"chain {algorithm}")
        # Bit-exact against a float32 rank-order emulation, at every step.
        want = chain_reference_f32(y0, xs)
        mism = np.nonzero((int_view(got[0]) != int_view(want)).any(axis=1))[0]
        assert mism.size == 0, f"chain {algorithm} n={n}: steps {mism[:10].tolist()} differ"
        np.testing.assert_allclose(got[0], lax_got[0], rtol=1e-5)
        for a in algs:
            want_calls = n * sum(1 for k in range(self.STEPS) if algs[k % len(algs)] == a)
            assert after[a]["calls"] - before[a]["calls"] == want_calls, a

    def test_chain_bf16(self, tp):
        n = tp.shape["tp"]
        rng = rng_for(n, "chain-bf16")
        bf16 = DTYPES["bfloat16"]
        y0 = rng.uniform(0.5, 2.0, (n, 200)).astype(bf16)
        xs = rng.uniform(0.5, 2.0, (n, self.STEPS, 200)).astype(bf16)
        got = np.asarray(chain_fn(tp, ("sifar",), self.STEPS)(y0, xs))
        lax_got = np.asarray(chain_fn(tp, None, self.STEPS)(y0, xs))
        assert_bit_identical_rows(got, "chain bf16")
        assert np.isfinite(got.astype(np.float32)).all()
        np.testing.assert_allclose(
            got[0].astype(np.float32), lax_got[0].astype(np.float32), rtol=4 * 2.0**-8
        )

    def test_interleaved_functions(self, tp):
        """Several executables, every algorithm, dispatched back to back without
        waiting, then checked: one communicator serves them all in order."""
        n = tp.shape["tp"]
        cases = list(
            itertools.islice(
                itertools.cycle(
                    itertools.product(ALGS, ["float32", "bfloat16"], [(5,), (3, 5), (250,)])
                ),
                40,
            )
        )
        pending = []
        for i, (alg, dt, shape) in enumerate(cases[::3] + cases[1::3] + cases[2::3]):
            x = make_inputs(rng_for(n, "interleave", i), n, shape, DTYPES[dt])
            pending.append((alg, dt, shape, x, allreduce_fn(tp, alg)(x)))
        for alg, dt, shape, x, (got, _) in pending:
            got = np.asarray(got)
            what = f"interleaved {alg} {dt} {shape}"
            assert_bit_identical_rows(got, what)
            assert_matches_reference(got[0], reference(x), n, what)

    @pytest.mark.parametrize("algorithm", ALGS)
    def test_repeat(self, tp, algorithm):
        n = tp.shape["tp"]
        x = make_inputs(rng_for(n, "repeat", algorithm), n, (3, 7), DTYPES["bfloat16"])
        one = np.asarray(repeat_fn(tp, algorithm, 1)(x))
        before = sifar_jax.stats()
        five = np.asarray(repeat_fn(tp, algorithm, 5)(x))
        after = sifar_jax.stats()
        np.testing.assert_array_equal(int_view(five), int_view(one))
        assert_matches_reference(one[0], reference(x), n, f"repeat {algorithm}")
        assert after[algorithm]["calls"] - before[algorithm]["calls"] == 5 * n

    def test_stats_count_per_rank(self, tp):
        n = tp.shape["tp"]
        x = make_inputs(rng_for(n, "stats"), n, (16,), DTYPES["float32"])
        for alg in ALGS:
            f = allreduce_fn(tp, alg)
            before = sifar_jax.stats()
            for _ in range(3):
                f(x)
            jax.block_until_ready(f(x))
            after = sifar_jax.stats()
            for a in sifar_jax.ALGORITHMS:
                want = 4 * n if a == alg else 0
                assert after[a]["calls"] - before[a]["calls"] == want, (alg, a)
                assert after[a]["timeouts"] == before[a]["timeouts"], (alg, a)
        sifar_jax.check()


# --------------------------------------------------------------- 2-D meshes --
@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=["dp2xtp4", "dp4xtp2"])
def test_2d_mesh(cpu_mesh, shape):
    """Reduce over tp only, over dp only, and over both (tp then dp)."""
    mesh = cpu_mesh(shape=shape, axis_names=("dp", "tp"), slot_bytes=SLOT)
    dp, tp = shape

    for alg in ALGS:

        def body(x, alg=alg):
            v = x[0, 0]
            over_tp = sifar_jax.sifar_psum(v, "tp", algorithm=alg)
            over_dp = sifar_jax.sifar_psum(v, "dp", algorithm=alg)
            both = sifar_jax.sifar_psum(over_tp, "dp", algorithm=alg)
            return over_tp[None, None], over_dp[None, None], both[None, None]

        spec = P("dp", "tp")
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec, spec, spec)))
        x = make_inputs(rng_for(shape, "2d", alg), dp * tp, (3, 11), np.float32)
        x = x.reshape(dp, tp, 3, 11)
        before = sifar_jax.stats()[alg]["calls"]
        over_tp, over_dp, both = (np.asarray(a) for a in f(x))
        # Every device takes part in each of the three all-reduces.
        assert sifar_jax.stats()[alg]["calls"] - before == 3 * dp * tp
        x64 = x.astype(np.float64)
        for i in range(dp):
            assert_bit_identical_rows(over_tp[i], f"{alg} over tp, dp={i}")
            np.testing.assert_allclose(over_tp[i, 0], x64[i].sum(0), rtol=1e-6 * tp)
        for j in range(tp):
            assert_bit_identical_rows(over_dp[:, j], f"{alg} over dp, tp={j}")
            np.testing.assert_allclose(over_dp[0, j], x64[:, j].sum(0), rtol=1e-6 * dp)
        assert_bit_identical_rows(both.reshape(dp * tp, 3, 11), f"{alg} over both")
        np.testing.assert_allclose(both[0, 0], x64.sum((0, 1)), rtol=1e-6 * dp * tp)
    sifar_jax.check()


# ----------------------------------------------- independent all-reduces --
INDEPENDENT_SHAPES = [(256,)] * 6 + [(100,), (3, 50), (512,), (1000,), (7,), (1024,)]


@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("n", N_RANKS, ids=lambda n: f"n{n}")
def test_independent_allreduces_in_one_jit(cpu_mesh, n, algorithm):
    """Twelve all-reduces with no data dependence between them, in one program
    (e.g. attention and MLP partials of a parallel-residual block, or several
    layers' outputs). XLA:CPU may schedule independent ops in any order and run
    them concurrently; every rank must still pair up the same all-reduces, or
    sums of different tensors get mixed silently."""
    mesh = cpu_mesh(n, slot_bytes=SLOT)
    k = len(INDEPENDENT_SHAPES)

    def body(*xs):
        return tuple(sifar_jax.sifar_psum(x[0], "tp", algorithm=algorithm)[None] for x in xs)

    spec = P("tp")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * k, out_specs=(spec,) * k))
    with sifar_jax.testing.timeout(5):
        for call in range(3):
            rng = rng_for(n, algorithm, "independent", call)
            xs = [make_inputs(rng, n, s, DTYPES["float32"]) for s in INDEPENDENT_SHAPES]
            outs = [np.asarray(o) for o in f(*xs)]
            wrong = []
            for i, (x, got) in enumerate(zip(xs, outs)):
                try:
                    assert_bit_identical_rows(got, f"all-reduce {i}")
                    assert_matches_reference(got[0], reference(x), n, f"all-reduce {i}")
                except AssertionError as e:
                    wrong.append(str(e).splitlines()[0])
            assert not wrong, f"call {call}: {len(wrong)} of {k} results wrong: {wrong[:3]}"
    sifar_jax.check()
