"""psum_add_rmsnorm_matmul (the fused all-reduce + add + RMSNorm and the matmul
reading its row, one launch on GPUs), on the CPU backend and, where two GPUs
exist, on the CUDA backend (test_ordering's cpu_mesh fixture runs both).

- new_residual is bit-identical to psum_add_rmsnorm's, and y to a NumPy
  emulation of the kernel's summation order applied to psum_add_rmsnorm's
  normed row (16-bit types: every product is exact in fp32, so the order
  alone decides the bits); float32 within a tight bound; y also within an ulp
  of float64 `normed @ matrix` and of XLA's dot.
- Many calls interleaved with plain and fused calls on one chain, inside a
  scan, across the tag wrap and under skew stay exact (the calls' counts that
  pair the matmul blocks with their all-reduce blocks).
- A timed-out call leaves y NaN (GPUs) or raises (CPU); trace-time errors;
  fallbacks warn once and keep the semantics.

On the GPU host: python -m pytest -q tests/test_fused_matmul.py -k gpu
"""

from __future__ import annotations

import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sifar_jax
from sifar_jax import _ext, fused, testing
from test_fused import DTYPES, EPS, SLOT, model_reference, same_bits, ulps
from test_ordering import cpu_mesh, rng_for  # noqa: F401 - the cpu/gpu mesh fixture


def kernel_order_matmul(normed: np.ndarray, m2: np.ndarray) -> np.ndarray:
    """y = normed @ m2 in the kernel's order (ffi/cuda_fused_matmul.cuh, protocol.h
    MatmulSplitOf): per split of the rows, 8 warps each sum rows w, w + 8, ... with fused
    multiply-adds, the warps in order, then the splits in order."""
    dtype = normed.dtype
    hidden, cols = m2.shape
    tile_cols = 512 // dtype.itemsize
    tiles = -(-cols // tile_cols)
    s = 1 if tiles >= 224 else 224 // tiles  # protocol.h kMatmulItems
    s = max(1, min(s, -(-hidden // 64)))
    chunk = -(-(-(-hidden // s)) // 8) * 8
    splits = -(-hidden // chunk)
    x, w = normed.astype(np.float32), m2.astype(np.float32)
    exact_products = dtype.itemsize == 2  # 16-bit x 16-bit fits fp32: fma == add of the product
    total = None
    for sp in range(splits):
        split = None
        for warp in range(8):
            acc = np.zeros(cols, np.float32)
            for r in range(sp * chunk + warp, min((sp + 1) * chunk, hidden), 8):
                if exact_products:
                    acc = (acc + x[r] * w[r]).astype(np.float32)
                else:
                    acc = (acc.astype(np.float64) + np.float64(x[r]) * w[r].astype(np.float64)
                           ).astype(np.float32)
            split = acc if split is None else split + acc
        total = split if total is None else total + split
    return total.astype(dtype)


def make_case(rng, n, hidden, cols, dtype, tokens=1):
    x = rng.standard_normal((n, tokens, hidden)).astype(dtype)
    r = (2 * rng.standard_normal((tokens, hidden))).astype(dtype)
    w = (1 + 0.1 * rng.standard_normal(hidden)).astype(dtype)
    m = (rng.standard_normal((hidden, n * cols)) * hidden ** -0.5).astype(dtype)  # sharded on tp
    return x, r, w, m


def fused_matmul_and_references(mesh, shapes):
    """Per shape: the call, and psum_add_rmsnorm with XLA's dot of its normed row."""
    k = len(shapes)

    def body(*args):
        out = []
        for x, r, w, m in zip(*(args[i * k:(i + 1) * k] for i in range(4))):
            y, new_residual = sifar_jax.psum_add_rmsnorm_matmul(x[0], r, w, m, "tp", eps=EPS)
            normed, res2 = sifar_jax.psum_add_rmsnorm(x[0], r, w, "tp", eps=EPS)
            xla_y = jnp.dot(normed, m, preferred_element_type=jnp.float32).astype(normed.dtype)
            out += [v[None] for v in (y, new_residual, normed, res2, xla_y)]
        return tuple(out)

    specs = (P("tp"),) * k + (P(),) * (2 * k) + (P(None, "tp"),) * k
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P("tp"),) * (5 * k)))


# (hidden, cols): rows in one block (64, 128) and over clusters of 4 and 8 blocks
# (4096, 8192 in 16-bit types); column counts with a partial last tile.
SHAPES = {"bfloat16": [(64, 40), (128, 64), (4096, 3072), (8192, 200)],
          "float16": [(128, 24), (4096, 136)],
          "float32": [(64, 12), (4096, 100)]}


@pytest.mark.parametrize("n,dtype", [(2, "bfloat16"), (4, "bfloat16"), (2, "float16"),
                                     (2, "float32")])
def test_matches_the_kernel_order_and_the_references(cpu_mesh, n, dtype):
    mesh = cpu_mesh(n, slot_bytes=SLOT)
    dt = DTYPES[dtype]
    shapes = SHAPES[dtype]
    f = fused_matmul_and_references(mesh, shapes)
    rng = rng_for("fused_matmul", n, dtype)
    data = [make_case(rng, n, h, c, dt) for h, c in shapes]
    args = [d[i] for i in range(4) for d in data]
    outs = jax.device_get(f(*args))
    for i, ((h, c), (x, r, w, m)) in enumerate(zip(shapes, data)):
        y, new_res, normed, res2, xla_y = outs[5 * i:5 * i + 5]
        what = f"hidden={h} cols={c}"
        assert same_bits(new_res, res2), f"{what}: new_residual != psum_add_rmsnorm's"
        assert same_bits(new_res[0, 0], model_reference(x[:, 0], r[0], w)[1]), what
        for q in range(n):
            mq = m[:, q * c:(q + 1) * c]
            want = kernel_order_matmul(normed[q, 0], mq)
            got = y[q, 0]
            if dt.itemsize == 2:
                assert same_bits(got, want), (
                    f"{what} rank {q}: {np.count_nonzero(ulps(got, want))} of {c} differ from the "
                    f"kernel's order")
            else:
                assert ulps(got, want).max() <= 2, f"{what} rank {q}: float32 off the kernel order"
            exact = normed[q, 0].astype(np.float64) @ mq.astype(np.float64)
            if dt.itemsize == 2:  # fp32 accumulation, then one rounding to 8 or 11 bits
                assert ulps(got, exact.astype(np.float32).astype(dt)).max() <= 1, f"{what} vs float64"
            else:  # float32 output: the accumulation's own rounding error shows
                bound = h * 2 ** -24 * (np.abs(normed[q, 0]).astype(np.float64) @ np.abs(mq))
                assert (np.abs(got - exact) <= bound).all(), f"{what} vs float64"
            # XLA's own order (and, on the CPU, its own blocking) may cancel
            # differently near zero: bounded against the row's scale instead.
            scale = np.abs(exact).max()
            diff = np.abs(got.astype(np.float64) - xla_y[q, 0].astype(np.float64))
            assert diff.max() <= 2 ** -7 * scale, f"{what} vs XLA's dot: {diff.max()} of {scale}"


def test_calls_interleave_with_plain_and_fused_calls(cpu_mesh):
    """A decode-like chain: matmul calls alternating with psum_add_rmsnorm and
    sifar_psum on one chain, and a scan body's matmul calls (another lane),
    under skew and across the tag wrap. Every call pairs its matmul blocks
    with its own all-reduce (a stale pairing would read the previous row)."""
    n, hidden, cols, steps = 2, 4096, 256, 5
    mesh = cpu_mesh(n, slot_bytes=SLOT)
    dt = DTYPES["bfloat16"]

    def body(xs, r0, w, m):
        xs = xs[0]
        r, outs = r0, []
        for k in range(steps):
            normed, r1 = sifar_jax.psum_add_rmsnorm(xs[k], r, w, "tp", eps=EPS)
            y, r = sifar_jax.psum_add_rmsnorm_matmul(xs[k], r, w, m, "tp", eps=EPS)
            outs += [normed, r1, y, r, sifar_jax.sifar_psum(xs[k][:, :64], "tp")]

        def step(c, x):
            y, c = sifar_jax.psum_add_rmsnorm_matmul(x, c, w, m, "tp", eps=EPS)
            return c, (y, c)

        _, (scan_y, scan_r) = jax.lax.scan(step, r0, xs)
        return tuple(v[None] for v in outs + [scan_y, scan_r])

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P(), P(None, "tp")),
                              out_specs=(P("tp"),) * (5 * steps + 2)))
    with testing.epoch_bits("tp", 4), testing.inject_skew(200, seed=5):
        for it in range(3):
            rng = rng_for("fused_matmul_chain", it)
            xs = rng.standard_normal((n, steps, 1, hidden)).astype(dt)
            r0 = (2 * rng.standard_normal((1, hidden))).astype(dt)
            w = (1 + 0.1 * rng.standard_normal(hidden)).astype(dt)
            m = (rng.standard_normal((hidden, n * cols)) * hidden ** -0.5).astype(dt)
            got = jax.device_get(f(xs, r0, w, m))
            r = r0
            for k in range(steps):
                normed, r1, y, r_out, small = (got[5 * k + j] for j in range(5))
                want_norm, want_r = model_reference(xs[:, k], r, w)
                assert same_bits(r1[0], want_r) and same_bits(r_out[0], r1[0]), f"run {it} step {k}"
                assert same_bits(small[0], model_reference(xs[:, k, :, :64], np.zeros_like(r[:, :64]),
                                                           w[:64])[1]), f"run {it} step {k}: small"
                for q in range(n):
                    mq = m[:, q * cols:(q + 1) * cols]
                    want_y = kernel_order_matmul(normed[q, 0], mq)
                    assert same_bits(y[q, 0], want_y), f"run {it} step {k} rank {q}: y"
                    assert same_bits(got[-2][q][k][0], want_y), f"run {it} scan step {k} rank {q}"
                    assert same_bits(got[-1][q][k], r1[0]), f"run {it} scan step {k}: residual"
                r = want_r
    sifar_jax.check()


def test_rows_of_other_sizes_interleave_on_one_chain(cpu_mesh):
    """Calls whose rows span 1, 4 and 8 all-reduce blocks (clusters of 1, 4, 8 on GPUs)
    alternate on one chain: each pairs its matmul blocks with its own rows (the lane's call
    number is shared by every shape; the ready words of blocks a smaller call leaves alone
    keep older numbers)."""
    n = 2
    mesh = cpu_mesh(n, slot_bytes=SLOT)
    dt = DTYPES["bfloat16"]
    shapes = [(4096, 64), (128, 32), (8192, 64), (128, 32), (4096, 64)]

    def body(*args):
        out = []
        for i in range(len(shapes)):
            x, r, w, m = args[4 * i:4 * i + 4]
            normed, _ = sifar_jax.psum_add_rmsnorm(x[0], r, w, "tp", eps=EPS)
            y, _ = sifar_jax.psum_add_rmsnorm_matmul(x[0], r, w, m, "tp", eps=EPS)
            out += [normed[None], y[None]]
        return tuple(out)

    specs = (P("tp"), P(), P(), P(None, "tp")) * len(shapes)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs,
                              out_specs=(P("tp"),) * (2 * len(shapes))))
    for it in range(2):
        rng = rng_for("fused_matmul_sizes", it)
        data = [make_case(rng, n, h, c, dt) for h, c in shapes]
        got = jax.device_get(f(*[a for d in data for a in d]))
        for i, ((h, c), (_, _, _, m)) in enumerate(zip(shapes, data)):
            normed, y = got[2 * i], got[2 * i + 1]
            for q in range(n):
                want = kernel_order_matmul(normed[q, 0], m[:, q * c:(q + 1) * c])
                assert same_bits(y[q, 0], want), f"run {it} call {i} (hidden {h}) rank {q}"
    sifar_jax.check()


def test_a_timed_out_call_leaves_y_nan(cpu_mesh):
    """Rank 1 never arrives: on GPUs every element of rank 0's y, normed row
    and residual is NaN; the CPU raises; check() reports the timeout."""
    n, hidden, cols = 2, 4096, 512
    mesh = cpu_mesh(n, slot_bytes=SLOT)
    dt = DTYPES["bfloat16"]
    on_cpu = mesh.devices.flat[0].platform == "cpu"

    def body(x, r, w, m):
        y, new_residual = sifar_jax.psum_add_rmsnorm_matmul(x[0], r, w, m, "tp", eps=EPS)
        return y[None], new_residual[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P(), P(None, "tp")),
                              out_specs=(P("tp"), P("tp"))))
    x, r, w, m = make_case(rng_for("fused_matmul_timeout"), n, hidden, cols, dt)
    jax.block_until_ready(f(x, r, w, m))
    t0 = time.perf_counter()
    with testing.timeout(0.3), testing.drop_rank("tp", 1, from_block=0 if on_cpu else 1):
        if on_cpu:
            with pytest.raises(Exception, match="timed out"):
                jax.block_until_ready(f(x, r, w, m))
        else:
            y, new_residual = jax.device_get(f(x, r, w, m))
            for name, v in (("y", y[0]), ("new_residual", new_residual[0])):
                v = v.astype(np.float32)
                assert np.isnan(v).all(), f"{name}: {np.count_nonzero(~np.isnan(v))} not NaN"
    assert time.perf_counter() - t0 < 30
    with pytest.raises(sifar_jax.SifarError, match="timed out"):
        sifar_jax.check()


FALLBACKS = {
    # case: (tokens, cols per rank, algorithm, the warning expected)
    "two_rows": (2, 64, "auto", "one row"),
    "columns_not_16_bytes": (1, 12, "auto", "not a multiple of 8"),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_fallbacks_warn_once_and_keep_the_semantics(cpu_mesh, case, monkeypatch):
    monkeypatch.setattr(fused, "_warned", set())
    tokens, cols, algorithm, expected = FALLBACKS[case]
    n, hidden = 2, 128
    mesh = cpu_mesh(n, slot_bytes=SLOT)
    dt = DTYPES["bfloat16"]

    def body(x, r, w, m):
        y, new_residual = sifar_jax.psum_add_rmsnorm_matmul(x[0], r, w, m, "tp", eps=EPS,
                                                            algorithm=algorithm)
        normed, _ = sifar_jax.psum_add_rmsnorm(x[0], r, w, "tp", eps=EPS)
        return y[None], new_residual[None], normed[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P(), P(None, "tp")),
                              out_specs=(P("tp"),) * 3))
    x, r, w, m = make_case(rng_for("fused_matmul_fallback", case), n, hidden, cols, dt, tokens)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y, new_residual, normed = jax.device_get(f(x, r, w, m))
    ours = [str(c.message) for c in caught if "sifar_jax" in str(c.message)]
    assert len(ours) == 1 and expected in ours[0], ours
    assert same_bits(new_residual[0], model_reference(x, r, w)[1])
    for q in range(n):
        exact = normed[q].astype(np.float64) @ m[:, q * cols:(q + 1) * cols].astype(np.float64)
        assert ulps(y[q], exact.astype(np.float32).astype(dt)).max() <= 1


def test_operand_errors_are_clear_at_trace_time(cpu_mesh):
    mesh = cpu_mesh(2, slot_bytes=SLOT)
    bf = DTYPES["bfloat16"]

    def run(m, x=np.ones((2, 1, 64), bf)):
        f = jax.shard_map(
            lambda x, r, w, m: sifar_jax.psum_add_rmsnorm_matmul(x[0], r, w, m, "tp", eps=EPS)[1],
            mesh=mesh, in_specs=(P("tp"), P(), P(), P()), out_specs=P())
        return jax.jit(f).lower(x, np.ones((1, 64), bf), np.ones(64, bf), m)

    with pytest.raises(ValueError, match="matrix must be"):
        run(np.ones((32, 16), bf))
    with pytest.raises(ValueError, match="matrix must be"):
        run(np.ones(64, bf))
    with pytest.raises(TypeError, match="matrix has dtype"):
        run(np.ones((64, 16), np.float32))
    with pytest.raises(TypeError, match="one dtype"):
        run(np.ones((64, 16), bf), x=np.ones((2, 1, 64), np.float32))
