"""sifar_jax.fp8_matvec: y[m] = x[m] @ dequant(w[ids[m]]).T with e4m3 weights (ffi/matvec/).

On every machine: the CPU handler (impl="kernel") against a float64 reference on random data
(within one rounding of the output plus float32 summation error), every activation dtype,
per-tensor / per-channel / 128x128-block scales, every (lanes, ksplit), dense rows 1..9 and
expert stacks with ids; a tensor-parallel shard whose rows or columns start inside a scale
block (320 over 2 ranks); under shard_map; the user errors at trace time. With a CUDA GPU: the
kernels' bits equal the CPU handler's on the decoders' real shapes and on every plan of the row
kernel (one x row per block), outputs poisoned first.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from sifar_jax import fp8_matvec as f8
from conftest import gpu_device_list

DTYPES = ("float32", "bfloat16", "float16")
EPS = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}  # half an ulp
E4M3 = jnp.float8_e4m3fn


@functools.lru_cache(maxsize=2)
def weights(k, n, e, scaling, seed):
    """w (e4m3, [N, K] or [E, N, K]), scale (float32 grid), block: one case's, for every dtype."""
    rng = np.random.default_rng(seed + 7919)
    lead = () if e is None else (e,)
    # Spans e4m3's range (448 at most: a larger value would become NaN), never all zeros.
    w = jnp.asarray(np.clip(rng.standard_normal(lead + (n, k), dtype=np.float32) * 100, -448, 448), E4M3)
    block = {"tensor": (n, k), "channel": (1, k), "block": (128, 128)}[scaling]
    grid = (math.ceil(n / block[0]), math.ceil(k / block[1]))
    scale = jnp.asarray(rng.uniform(0.5, 2.0, lead + grid).astype(np.float32) / (100 * k ** 0.5))
    return w, scale, block


def operands(m, k, n, e, dtype, scaling, seed=0):
    """x, w (e4m3, [N, K] or [E, N, K]), scale (float32 grid), block, ids."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32), dtype)
    w, scale, block = weights(k, n, e, scaling, seed)
    ids = None if e is None else jnp.asarray(rng.integers(0, e, m).astype(np.int32))
    return x, w, scale, block, ids


_DEQUANTIZED: list = []  # the last few (w, scale, block, float64 w, |float64 w|): w kept alive


def dequantized(w, scale, block):
    """float64 q x scale [.., N, K] and its absolute value, cached for the last few weights (a
    GPU case checks one weight for every dtype and launch)."""
    for ww, ss, bb, wd, ad in _DEQUANTIZED:
        if ww is w and ss is scale and bb == block:
            return wd, ad
    q = np.asarray(w.astype(jnp.float32), np.float64)
    s = np.asarray(scale, np.float64)
    n, k = q.shape[-2:]
    s = np.repeat(np.repeat(s, block[0], axis=-2)[..., :n, :], block[1], axis=-1)[..., :k]
    wd = q * s
    _DEQUANTIZED.append((w, scale, block, wd, np.abs(wd)))
    del _DEQUANTIZED[:-3]
    return _DEQUANTIZED[-1][3:]


def reference(x, w, scale, block, ids):
    """float64 y and the bound on |y - ref|: half an ulp of y plus float32 summation error."""
    wd, ad = dequantized(w, scale, block)
    k = wd.shape[-1]
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    if ids is None:
        y, mag = x64 @ wd.T, np.abs(x64) @ ad.T
    else:
        pick = np.clip(np.asarray(ids), 0, wd.shape[0] - 1)
        y = np.einsum("mk,mnk->mn", x64, wd[pick])
        mag = np.einsum("mk,mnk->mn", np.abs(x64), ad[pick])
    bound = EPS[jnp.dtype(x.dtype).name] * np.abs(y) * 1.01 + 2 * (k + 32) * 2.0 ** -24 * mag
    return y, bound


def run(x, w, scale, block, ids, **kw):
    return jax.jit(lambda x, w, s, i: f8.fp8_matvec(x, w, s, i, block=block, **kw))(
        x, w, scale, ids)


def check(y, x, w, scale, block, ids):
    assert np.isfinite(np.asarray(w, np.float32)).all()
    assert np.isfinite(np.asarray(y, np.float32)).all()
    want, bound = reference(x, w, scale, block, ids)
    assert y.shape == want.shape and y.dtype == x.dtype
    np.testing.assert_array_less(np.abs(np.asarray(y, np.float64) - want), bound + 1e-30)


# (M, K, N, E or None): dense rows 1..9, a stack of experts, a ragged block grid
SHAPES = [(1, 256, 64, None), (2, 64, 24, None), (3, 320, 40, None), (5, 48, 16, None),
          (8, 128, 130, None), (9, 96, 8, None), (8, 160, 48, 5), (3, 272, 136, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", ["tensor", "channel", "block"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cpu_handler_matches_float64(dtype, scaling, shape):
    m, k, n, e = shape
    x, w, scale, block, ids = operands(m, k, n, e, dtype, scaling, seed=m + k + n)
    check(run(x, w, scale, block, ids, impl="kernel"), x, w, scale, block, ids)


@pytest.mark.parametrize("plan", [(32, 1), (16, 2), (8, 4), (4, 8), (32, 8)])
def test_every_plan_matches_float64(plan):
    x, w, scale, block, ids = operands(4, 512, 72, None, "bfloat16", "block", seed=1)
    check(run(x, w, scale, block, ids, impl="kernel", plan=plan), x, w, scale, block, ids)
    x, w, scale, block, ids = operands(6, 384, 40, 3, "float32", "channel", seed=2)
    check(run(x, w, scale, block, ids, impl="kernel", plan=plan), x, w, scale, block, ids)


def test_xla_impl_matches_float64_and_auto_is_xla_on_cpu():
    x, w, scale, block, ids = operands(2, 256, 200, None, "bfloat16", "block", seed=3)
    y = run(x, w, scale, block, ids, impl="xla")
    check(y, x, w, scale, block, ids)
    np.testing.assert_array_equal(np.asarray(run(x, w, scale, block, ids), np.float32),
                                  np.asarray(y, np.float32))


def test_shard_starting_inside_a_block_gives_the_full_products_bits():
    """Intermediate 320 over 2 ranks with 128x128 blocks: each rank's rows (column-parallel) and
    columns (row-parallel) start inside a block; regridded scales give the shard the very
    scales the full weight uses, so its products are the full product's bits."""
    x, w, scale, block, _ = operands(2, 256, 320, None, "bfloat16", "block", seed=4)
    fine = (32, 128)
    s_fine = f8.regrid_scale(scale, block, 320, 256, fine)
    assert s_fine.shape == (10, 2)
    full = np.asarray(run(x, w, scale, block, None, impl="kernel"), np.float32)
    for r in range(2):
        part = run(x, w[160 * r:160 * (r + 1)], s_fine[5 * r:5 * (r + 1)], fine, None,
                   impl="kernel")
        np.testing.assert_array_equal(np.asarray(part, np.float32), full[:, 160 * r:160 * (r + 1)])
    # Row-parallel: K = 320 over 2 ranks, each rank's K starts inside a block along K.
    x, w, scale, block, _ = operands(1, 320, 64, None, "float32", "block", seed=5)
    s_fine = f8.regrid_scale(scale, block, 64, 320, (128, 32))
    total = 0
    for r in range(2):
        sl = slice(160 * r, 160 * (r + 1))
        part = run(x[:, sl], w[:, sl], s_fine[:, 5 * r:5 * (r + 1)], (128, 32), None,
                   impl="kernel")
        check(part, x[:, sl], w[:, sl], s_fine[:, 5 * r:5 * (r + 1)], (128, 32), None)
        total = total + np.asarray(part, np.float64)
    want, bound = reference(x, w, scale, block, None)
    np.testing.assert_array_less(np.abs(total - want), 2 * bound + 1e-30)


def test_under_shard_map_column_parallel(cpu_mesh):
    mesh = cpu_mesh(2)
    x, w, scale, block, _ = operands(1, 128, 64, None, "bfloat16", "channel", seed=6)
    f = jax.jit(jax.shard_map(lambda x, w, s: f8.fp8_matvec(x, w, s, impl="kernel"), mesh=mesh,
                              in_specs=(P(), P("tp"), P("tp")), out_specs=P(None, "tp")))
    y = f(x, jax.device_put(w, NamedSharding(mesh, P("tp"))), scale)
    check(y, x, w, scale, block, None)


def test_user_errors_at_trace_time():
    x, w, scale, block, ids = operands(1, 64, 32, None, "bfloat16", "block", seed=7)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        f8.fp8_matvec(x, w.astype(jnp.float8_e5m2), scale, block=block)
    with pytest.raises(TypeError, match="x must be"):
        f8.fp8_matvec(x.astype(jnp.int32), w, scale, block=block)
    with pytest.raises(ValueError, match="does not match"):
        f8.fp8_matvec(x[:, :48], w, scale, block=block)
    with pytest.raises(ValueError, match="multiple of 16"):
        f8.fp8_matvec(x[:, :40], w[:, :40], scale, block=block)
    with pytest.raises(ValueError, match=r"scale \(1, 2\) is not \(1, 1\)"):
        f8.fp8_matvec(x, w, jnp.ones((1, 2)), block=block)
    with pytest.raises(ValueError, match="cannot infer"):
        f8.fp8_matvec(x, w, jnp.ones((3, 5)))
    with pytest.raises(ValueError, match=r"\[E, N, K\]"):
        f8.fp8_matvec(x, w, scale, jnp.zeros((1,), jnp.int32), block=block)
    with pytest.raises(ValueError, match="block_k a multiple"):
        f8.fp8_matvec(x, w, jnp.ones((1, 8)), block=(32, 8))
    with pytest.raises(TypeError, match="scale must be floating"):
        f8.fp8_matvec(x, w, jnp.ones((1, 1), jnp.int32), block=block)
    with pytest.raises(ValueError, match="plan"):
        f8.fp8_matvec(x, w, scale, block=block, impl="kernel", plan=(64, 1))
    for impl in f8.IMPLS:  # a malformed plan is named on every impl, XLA's (which ignores it) too
        for plan in ((32,), "auto", (32.0, 1), (64, 1)):
            with pytest.raises(ValueError, match=r"a pair \(lanes, ksplit\) of ints"):
                f8.fp8_matvec(x, w, scale, block=block, impl=impl, plan=plan)


def test_default_plan_fills_the_gpu():
    for m, k, n, stacked in [(1, 4096, 6144, False), (1, 14336, 4096, False),
                             (1, 4096, 768, False), (8, 768, 2048, True), (1, 64, 16, False)]:
        lanes, ksplit = f8.fp8_matvec_plan(m, k, n, stacked)
        chunks = k // 16
        assert chunks >= 2 * lanes or lanes == 4
        blocks = math.ceil(n / ((8 // ksplit) * (32 // lanes))) * (m if stacked else 1)
        assert blocks >= f8.TARGET_BLOCKS or ksplit == 8 or chunks < 4 * lanes * ksplit


def assert_gpu_bits_equal_cpu(gpu, ops, dtype, **kw):
    """The kernel on `gpu` (its output's memory poisoned with NaNs first) against the CPU
    handler, bit for bit, and both within the float64 reference's bound."""
    x, w, scale, block, ids = ops
    f = jax.jit(lambda x, w, s, i: f8.fp8_matvec(x, w, s, i, block=block, impl="kernel", **kw))
    on = lambda d: f(*jax.device_put((x, w, scale, ids), d))  # noqa: E731
    # NaNs left in the allocator's free memory, where the output will be: all of it is written.
    poison = jax.device_put(jnp.full((4, x.shape[0], w.shape[-2]), jnp.nan, dtype), gpu)
    poison.block_until_ready()
    del poison
    got, cpu = np.asarray(on(gpu)), np.asarray(on(jax.devices("cpu")[0]))
    assert np.isfinite(got.astype(np.float32)).all()
    np.testing.assert_array_equal(got.view(np.uint8), cpu.view(np.uint8))
    check(got, x, w, scale, block, ids)


# The decoders' shapes: Llama-8B TP=1 and TP=2 per-rank, Qwen3-30B-A3B experts (top-8).
GPU_SHAPES = [(1, 4096, 6144, None, "channel"), (1, 14336, 4096, None, "block"),
              (1, 7168, 4096, None, "tensor"), (2, 4096, 3072, None, "block"),
              (8, 2048, 1536, 128, "block"), (8, 768, 2048, 128, "channel"),
              (5, 4096, 768, None, "channel")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("pdl", [True, False])
def test_cuda_kernel_matches_cpu_handler_bits(dtype, shape, pdl):
    gpus = gpu_device_list()
    if not gpus or "cuda" not in f8._ext.PLATFORMS:
        pytest.skip("needs a CUDA GPU and the CUDA build")
    m, k, n, e, scaling = shape
    ops = operands(m, k, n, e, dtype, scaling, seed=k + n)
    assert_gpu_bits_equal_cpu(gpus[0], ops, dtype, pdl=pdl, prefetch=pdl)


# One x row per block (the shared-memory row kernel): every lanes value, K splits, a K whose
# chunks do not fill the batches (ragged per lane), rows past a block's last group, a K too
# large to stage (the L1 kernel serves it), an expert stack; two rows per thread (chosen when
# a grid has 1-2 rounds of row groups per block: N past 264 groups of one row each, on an
# H100/H200) with lanes 16 and 8, N off the two-row group.
ROW_PLANS = [((1, 1200, 100, None, "block"), (32, 2)), ((1, 1200, 100, None, "channel"), (16, 1)),
             ((1, 1200, 100, None, "tensor"), (8, 4)), ((1, 1216, 37, None, "block"), (4, 8)),
             ((1, 208, 9, None, "channel"), (4, 1)), ((1, 32768, 40, None, "channel"), (32, 1)),
             ((3, 640, 72, 4, "block"), (8, 2)), ((1, 1200, 4100, None, "block"), (16, 2)),
             ((1, 1216, 9001, None, "channel"), (8, 1))]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROW_PLANS, ids=lambda c: "x".join(map(str, c[0][:3])) + f"-{c[1]}")
def test_cuda_row_kernel_matches_cpu_handler_bits_for_every_plan(dtype, case):
    gpus = gpu_device_list()
    if not gpus or "cuda" not in f8._ext.PLATFORMS:
        pytest.skip("needs a CUDA GPU and the CUDA build")
    (m, k, n, e, scaling), plan = case
    ops = operands(m, k, n, e, dtype, scaling, seed=k + n + plan[0])
    assert_gpu_bits_equal_cpu(gpus[0], ops, dtype, plan=plan)
