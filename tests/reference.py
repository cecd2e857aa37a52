"""Host references shared by the CPU tests."""

from __future__ import annotations

import numpy as np


def chain_reference_f32(y0: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """The chain as the protocol computes it: float32, rank order 0..n-1, one
    rounding per add. (n is a power of two, so / n is exact.)"""
    n, steps = xs.shape[0], xs.shape[1]
    y = y0.astype(np.float32)  # (n, S) per rank
    outs = []
    for k in range(steps):
        v = (np.float32(0.5) * y + xs[:, k]).astype(np.float32)
        acc = v[0].copy()
        for r in range(1, n):
            acc = (acc + v[r]).astype(np.float32)
        yk = (acc / np.float32(n)).astype(np.float32)
        outs.append(yk)
        y = np.broadcast_to(yk, y.shape)
    return np.stack(outs)
