"""Entry points for benchmarks, kept out of sifar_psum's signature."""

from __future__ import annotations

import jax.numpy as jnp

from . import algorithms, psum
from .plan import Fallback, flatten, plan_array, unflatten


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
    plan = plan_array(x, axis_name, algorithm, "benchmarking.psum_repeated")
    if isinstance(plan, Fallback):  # even for "auto": the number would be lax.psum's
        raise ValueError(f"sifar_jax.benchmarking.psum_repeated: cannot run: {plan.reason}")
    if x.size == 0:
        return psum.sifar_psum(x, axis_name, algorithm=algorithm)
    out = psum.allreduce(flatten(x, plan), plan, int(repeat))
    return unflatten(out, x, plan)
