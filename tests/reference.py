"""Host references and checks shared by the CPU tests."""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np


def rng_for(*key) -> np.random.Generator:
    """A fresh, reproducible generator per test case and call."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def make_inputs(rng, n, shape, dtype) -> np.ndarray:
    """(n, *shape) partials, one row per rank. Magnitudes in [0.5, 2) and one
    random sign per element shared by all ranks: no cancellation, so the sum is
    never zero (an unwritten output element cannot pass) and float32 rank-order
    summation stays within (n-1) ulps of the exact sum."""
    mag = rng.uniform(0.5, 2.0, size=(n, *shape))
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    return (mag * sign).astype(dtype)


def reference(x: np.ndarray) -> np.ndarray:
    """The float64 sum of the upcast partials, rounded once to the dtype."""
    return x.astype(np.float64).sum(axis=0).astype(x.dtype)


def rank_order_sum(x: np.ndarray) -> np.ndarray:
    """What the protocol returns for partials x (n, ...), bit for bit: added in
    rank order 0..n-1 in float32 (one rounding per add), rounded once to the
    dtype."""
    acc = x[0].astype(np.float32)
    for r in range(1, x.shape[0]):
        acc = (acc + x[r].astype(np.float32)).astype(np.float32)
    return acc.astype(x.dtype)


def chain_reference_f32(y0: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """The chain as the protocol computes it: float32, rank order 0..n-1, one
    rounding per add. (n is a power of two, so / n is exact.)"""
    n, steps = xs.shape[0], xs.shape[1]
    y = y0.astype(np.float32)  # (n, S) per rank
    outs = []
    for k in range(steps):
        v = (np.float32(0.5) * y + xs[:, k]).astype(np.float32)
        yk = (rank_order_sum(v) / np.float32(n)).astype(np.float32)
        outs.append(yk)
        y = np.broadcast_to(yk, y.shape)
    return np.stack(outs)


def int_view(a: np.ndarray) -> np.ndarray:
    return a.view({2: np.int16, 4: np.int32}[a.dtype.itemsize]).astype(np.int64)


def assert_bit_identical_rows(out: np.ndarray, what: str = "") -> None:
    bits = int_view(np.ascontiguousarray(out))
    same = (bits == bits[:1]).all(axis=tuple(range(1, bits.ndim)))
    assert same.all(), f"{what}: ranks {np.nonzero(~same)[0].tolist()} differ from rank 0"


def assert_bits_equal(got, want, what: str = "") -> None:
    """Equal bit for bit (same dtype and shape)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
    if got.size:
        mism = np.nonzero(int_view(np.ascontiguousarray(got)) != int_view(np.ascontiguousarray(want)))
        assert mism[0].size == 0, f"{what}: {mism[0].size} elements differ, e.g. {got[mism][:3]} vs {want[mism][:3]}"


def assert_matches_reference(got: np.ndarray, ref: np.ndarray, n: int, what: str = "") -> None:
    """got (one rank's result) vs the rounded float64 reference."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, what
    g64 = got.astype(np.float64)
    assert np.isfinite(g64).all(), f"{what}: non-finite output (unwritten or poisoned element)"
    assert (g64 != 0).all(), f"{what}: zero output where the sum is never zero (unwritten element)"
    if got.dtype == np.float32:
        np.testing.assert_allclose(g64, ref.astype(np.float64), rtol=1e-6 * n, atol=0, err_msg=what)
    else:
        # Same sign everywhere, so adjacent bit patterns are adjacent values:
        # within one ulp <=> integer views differ by at most 1.
        ulps = np.abs(int_view(got) - int_view(ref))
        bad = np.nonzero(ulps > 1)
        assert ulps.max() <= 1, (
            f"{what}: {len(bad[0])} elements off by more than 1 ulp, e.g. got "
            f"{got[tuple(b[:3] for b in bad)]} want {ref[tuple(b[:3] for b in bad)]}"
        )


def psum_tolerance(dtype, n) -> float:
    """lax.psum may add in another order and round each step."""
    dtype = np.dtype(dtype)
    eps = {4: 2.0**-23, 2: 2.0**-7 if dtype == np.dtype(ml_dtypes.bfloat16) else 2.0**-10}
    return 2 * n * eps[dtype.itemsize]


def assert_close_to_psum(got, want, dtype, n, what=""):
    np.testing.assert_allclose(
        got.astype(np.float64), want.astype(np.float64), rtol=psum_tolerance(dtype, n), err_msg=what
    )
