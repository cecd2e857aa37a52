"""Entry points for benchmarks, kept out of sifar_psum's signature."""

from __future__ import annotations

import contextlib

import jax.numpy as jnp

from . import algorithms, fused, psum


def psum_repeated(x, axis_name, repeat: int, *, algorithm: str = algorithms.AUTO):
    """`repeat` all-reduces of `x` back to back inside one kernel launch (one
    handler call on the CPU): the kernel-level benchmark of the paper.

    Returns what one `sifar_psum(x, axis_name)` returns (every repetition
    reduces the same input). One array over one mesh axis; raises where
    sifar_psum would fall back to lax.psum, since the number would not be
    the algorithm's.
    """
    if int(repeat) < 1:
        raise ValueError("sifar_jax.benchmarking.psum_repeated: repeat must be >= 1")
    x = jnp.asarray(x)
    plan = psum._plan(x, axis_name, algorithm, "benchmarking.psum_repeated")
    if isinstance(plan, str):
        raise ValueError(f"sifar_jax.benchmarking.psum_repeated: cannot run: {plan}")
    if x.size == 0:
        return psum.sifar_psum(x, axis_name, algorithm=algorithm)
    out = psum._allreduce(psum._flat(x, plan), plan, int(repeat))
    return psum._unflat(out, x, plan)


@contextlib.contextmanager
def fused_rows(kernel: str):
    """Inside the block, `psum_add_rmsnorm` calls traced from now on run their
    rows of 2 or 4 blocks' lines (hidden 2048-4096 in 16-bit types) on GPUs in
    `kernel`: "wide" (one block of 512-1024 threads per row), "cluster" (a
    thread-block cluster of 256-thread blocks exchanging the row's sum) or
    "auto" (the build's default). Results are identical; the speed is what
    benchmarks compare. jax.jit caches traces: functions traced before the
    block keep their kernel."""
    if kernel not in fused.ROW_KERNELS:
        raise ValueError(f"sifar_jax.benchmarking.fused_rows: kernel must be one of "
                         f"{sorted(fused.ROW_KERNELS)}, got {kernel!r}")
    before, fused._rows = fused._rows, kernel
    try:
        yield
    finally:
        fused._rows = before
