"""sifar_jax.matvec: y[m] = x[m] @ w[ids[m]] (ffi/matvec/).

On every machine: the CPU handler (impl="kernel") against a float64 reference on random data
(within one rounding of the output plus float32 summation error), every dtype, grids with and
without a split K, column tails, clipped ids, trailing dims, the user errors. With a CUDA GPU:
the CUDA kernel gives the same bits as the CPU handler (they share the summation order), on
the decoders' real shapes too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sifar_jax import matvec as mv
from conftest import gpu_device_list

DTYPES = ("float32", "bfloat16", "float16")
EPS = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}  # half an ulp

# (M, K, N, E or None): a dense projection, MoE top-k, odd K, a column tail (N not a tile)
SMALL = [(1, 64, 256, None), (8, 96, 48, 5), (3, 40, 16, 2), (2, 130, 264, 3)]


def operands(m, k, n, e, dtype, seed=0, trailing=()):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    wshape = ((k, n) if e is None else (e, k, n)) + trailing
    w = (rng.standard_normal(wshape) * k ** -0.5).astype(np.float32)
    ids = None if e is None else rng.integers(0, e, m).astype(np.int32)
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype), (None if ids is None else jnp.asarray(ids))


def reference(x, w, ids):
    """float64 y and the bound on |y - ref|: half an ulp of the output's rounding plus the
    float32 summation's error (K terms)."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    k = x64.shape[1]
    w3 = w64.reshape((1,) + w64.shape) if ids is None else w64
    w3 = w3.reshape(w3.shape[0], k, -1)
    sel = w3[np.zeros(x64.shape[0], int) if ids is None
             else np.clip(np.asarray(ids), 0, w3.shape[0] - 1)]
    y = np.einsum("mk,mkn->mn", x64, sel)
    mag = np.einsum("mk,mkn->mn", np.abs(x64), np.abs(sel))
    bound = EPS[jnp.dtype(x.dtype).name] * np.abs(y) * 1.01 + 2 * k * 2.0 ** -24 * mag
    return y, bound


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SMALL, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("plan", [(32, 1), (64, 2), (256, 7), (128, 3)])
def test_kernel_on_cpu_matches_float64(dtype, shape, plan):
    m, k, n, e = shape
    x, w, ids = operands(m, k, n, e, dtype)
    y = jax.jit(lambda x, w, ids: mv.matvec(x, w, ids, impl="kernel", plan=plan))(x, w, ids)
    assert y.shape == (m, n) and y.dtype == x.dtype
    want, bound = reference(x, w, ids)
    np.testing.assert_array_less(np.abs(np.asarray(y, np.float64) - want), bound + 1e-30)


def test_split_order_changes_only_float32_rounding():
    """Different splits sum in a different order: results differ by float32 rounding only, and
    the same splits give the same bits every time."""
    x, w, ids = operands(4, 512, 64, 3, "float32", seed=1)
    a = mv.matvec(x, w, ids, impl="kernel", plan=(32, 1))
    b = mv.matvec(x, w, ids, impl="kernel", plan=(64, 16))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(b), np.asarray(mv.matvec(x, w, ids, impl="kernel",
                                                                      plan=(64, 16))))


def test_trailing_dims_and_clipped_ids():
    x, w, _ = operands(3, 32, 8, 4, "float32", seed=2, trailing=(2,))  # w [E, K, 8, 2]
    ids = jnp.asarray([-5, 2, 99], jnp.int32)  # clipped to 0, 2, 3 (jnp.take's mode="clip")
    y = mv.matvec(x, w, ids, impl="kernel")
    assert y.shape == (3, 8, 2)
    want = np.einsum("mk,mkab->mab", np.asarray(x, np.float64),
                     np.asarray(w, np.float64)[[0, 2, 3]])
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


def test_xla_impl_and_auto_agree_with_kernel():
    x, w, ids = operands(8, 256, 128, 6, "bfloat16", seed=3)
    k = np.asarray(mv.matvec(x, w, ids, impl="kernel"), np.float32)
    for impl in ("xla", "auto"):
        np.testing.assert_allclose(np.asarray(mv.matvec(x, w, ids, impl=impl), np.float32), k,
                                   rtol=2 ** -7, atol=1e-2)


def test_default_plan_fills_the_gpu_within_its_limits():
    for m, k, n in [(1, 4096, 6144), (1, 14336, 4096), (1, 4096, 28672), (8, 2048, 1536),
                    (8, 768, 2048), (8, 384, 2048), (1, 64, 256), (64, 4096, 128256)]:
        lanes, splits = mv.matvec_plan(m, k, n, 2)
        assert lanes in mv.LANES and 1 <= splits <= k
        vecs = n // 8
        assert vecs % lanes == 0 or lanes == 32  # no partly empty tiles unless unavoidable
        groups = mv.THREADS // lanes
        assert splits == 1 or k // splits >= groups * mv.MIN_ROWS_PER_GROUP
        assert splits * 4 <= max(4, mv.MAX_PARTIAL_SHARE * k * 2)  # partial sums' bytes
    assert mv.matvec_plan(64, 4096, 128256, 2)[1] == 1  # already thousands of blocks
    assert mv.matvec_plan(1, 16, 256, 2)[1] == 1


def test_user_errors_at_trace_time():
    x, w, ids = operands(2, 32, 16, 3, "float32")
    with pytest.raises(ValueError, match="x must be"):
        mv.matvec(x[0], w, ids)
    with pytest.raises(ValueError, match="does not match w's K"):
        mv.matvec(x[:, :16], w, ids)
    with pytest.raises(ValueError, match="a stack of weights .* needs ids"):
        mv.matvec(x, w)  # ids forgotten
    with pytest.raises(ValueError, match="ids must be integers"):
        mv.matvec(x, w, ids.astype(jnp.float32))
    with pytest.raises(TypeError, match="one dtype"):
        mv.matvec(x, w.astype(jnp.bfloat16), ids)
    with pytest.raises(ValueError, match="impl must be"):
        mv.matvec(x, w, ids, impl="cuda")
    with pytest.raises(ValueError, match="splits"):
        mv.matvec(x, w, ids, impl="kernel", plan=(32, 33))
    with pytest.raises(ValueError, match="lanes"):
        mv.matvec(x, w, ids, impl="kernel", plan=(48, 1))
    x7, w7, ids7 = operands(2, 32, 7, 3, "float32")  # 7 float32 columns: not 16-byte rows
    with pytest.raises(TypeError, match="multiple of 4 elements"):
        mv.matvec(x7, w7, ids7, impl="kernel")
    y = mv.matvec(x7, w7, ids7)  # auto: XLA's ops where the kernel cannot run
    want, bound = reference(x7, w7, ids7)
    np.testing.assert_array_less(np.abs(np.asarray(y, np.float64) - want), bound + 1e-6)


# ---- on a CUDA GPU: the kernel's bits are the CPU handler's ----------------------------------------

GPU_SHAPES = SMALL + [
    (1, 4096, 6144, None),  # Llama-3.1-8B qkv (TP=1)
    (1, 14336, 4096, None),  # down
    (8, 2048, 1536, 128),  # Qwen3-30B-A3B: the chosen experts' gate_up (TP=1)
    (8, 768, 2048, 128),  # and down
    (8, 384, 2048, 128),  # down at TP=2
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_kernel_matches_cpu_handler_bits(dtype, shape):
    gpus = gpu_device_list()
    if not gpus or "cuda" not in mv._ext.PLATFORMS:
        pytest.skip("needs a CUDA GPU and the CUDA build")
    m, k, n, e = shape
    x, w, ids = operands(m, k, n, e, dtype, seed=k + n)
    if ids is not None:
        ids = ids.at[0].set(ids[-1])  # a repeated expert
    plan = mv.matvec_plan(m, k, n, jnp.dtype(dtype).itemsize)
    f = jax.jit(lambda x, w, ids: mv.matvec(x, w, ids, impl="kernel", plan=plan))
    on = lambda d: f(*jax.device_put((x, w, ids), d))  # noqa: E731
    got, cpu = np.asarray(on(gpus[0])), np.asarray(on(jax.devices("cpu")[0]))
    np.testing.assert_array_equal(got.view(np.uint8), cpu.view(np.uint8))
    want, bound = reference(x, w, ids)
    np.testing.assert_array_less(np.abs(got.astype(np.float64) - want), bound + 1e-30)
    auto = jax.jit(lambda x, w, ids: mv.matvec(x, w, ids, plan=plan))  # auto: the kernel
    np.testing.assert_array_equal(np.asarray(auto(*jax.device_put((x, w, ids), gpus[0])))
                                  .view(np.uint8), got.view(np.uint8))
