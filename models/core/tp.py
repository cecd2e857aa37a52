"""Tensor-parallel building blocks every model family shares: the switch between all-reduce
implementations, the norm each all-reduce feeds, and the per-trace context layers receive.

A family's layers are written as the computation of ONE rank inside `jax.shard_map`: a
row-parallel projection returns this rank's partial sum, and `TPContext.add_norm` turns it into
the residual stream's update and the next RMSNorm's output (one fused sifar call, or the three
ops unfused).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from ..weights.types import Fp8Weight, RowWeight, project_fp8, stored_equation

AllReduceFn = Callable[[jax.Array, str], jax.Array]
# sifar_buffers: sifar with explicit dual buffers threaded through the decode state.
ALLREDUCE_KINDS = ("psum", "sifar", "sifar_buffers", "identity")
FUSED_MODES = (False, True)  # fused=True: all-reduce + residual add + RMSNorm in one call


# ---- the one switch between all-reduce implementations -------------------------------------------

def make_allreduce(kind: str = "psum", algorithm: str = "auto") -> AllReduceFn:
    """Return f(x, axis_name) -> sum of x over the mesh axis (inside shard_map).

    "psum": jax.lax.psum.  "sifar": sifar_jax.sifar_psum (requires sifar_jax.init(mesh) first;
    the Decoder does that).  "identity": no communication at all — wrong numbers, but the timing
    upper bound for a free all-reduce.
    """
    if kind == "psum":
        return lambda x, axis_name: jax.lax.psum(x, axis_name)
    if kind == "identity":
        return lambda x, axis_name: x
    if kind in ("sifar", "sifar_buffers"):  # sifar_buffers: see make_allreduce_into
        def sifar(x, axis_name):
            import sifar_jax  # lazily: the models work without the extension built

            return sifar_jax.sifar_psum(x, axis_name, algorithm=algorithm)

        return sifar
    raise ValueError(f"allreduce must be one of {ALLREDUCE_KINDS}, got {kind!r}")


def make_allreduce_into(algorithm: str = "auto"):
    """f(x, axis_name, buf, prev) -> (sum, buf): sifar with explicit dual buffers."""
    def sifar_into(x, axis_name, buf, prev):
        import sifar_jax

        return sifar_jax.sifar_psum_into(x, axis_name, buf, prev, algorithm=algorithm)

    return sifar_into


# ---- parameters, RMSNorm, and the all-reduce + residual add + RMSNorm ------------------------------

def normal(rngs: nnx.Rngs, shape, std: float, dtype) -> jax.Array:
    """A parameter's initial value (the modules are built under nnx.eval_shape for their shapes;
    real weights come from a checkpoint or random_params)."""
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def project(equation: str, x: jax.Array, w: jax.Array, rows: int = 1, **kw) -> jax.Array:
    """jnp.einsum(equation, x, w) for x [B, T, ...]; a single row (B = T = 1: batch-1 decoding) is
    multiplied as `rows` copies and the first result kept. XLA:GPU runs a one-row projection as a
    slow multiply + reduce or a narrow GEMM that streams the weights more slowly than a two-row
    one (docs/performance.md). The copies change no value of the kept row's inputs.

    An FP8 weight (weights/types.py, Fp8Weight) runs as one FP8 GEMV (rows ignored); a RowWeight
    as an einsum over its stored (output-major) dims."""
    if isinstance(w, Fp8Weight):
        return project_fp8(equation, x, w, **kw)
    if isinstance(w, RowWeight):
        equation, w = stored_equation(equation, w), w.w
    if rows > 1 and x.shape[0] * x.shape[1] == 1:
        y = jnp.einsum(equation, jnp.broadcast_to(x, (rows,) + x.shape[1:]), w, **kw)
        return y[:1]
    return jnp.einsum(equation, x, w, **kw)


class RMSNorm(nnx.Module):
    """Llama's RMSNorm over the last axis with a learned gain (replicated over the tp axis):
    the library's sifar_jax.fused.rms_norm (float32 statistics, then the scale in the activation
    dtype, as transformers does), imported when a model is traced, so that importing models
    needs no built extension."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        from sifar_jax.fused import rms_norm

        return rms_norm(x, self.weight[...], self.eps)


def unfused_psum_add_rmsnorm(x, residual, weight, axis_name, *, eps: float,
                             allreduce: AllReduceFn = jax.lax.psum):
    """The contract of `sifar_jax.psum_add_rmsnorm`, as three separate ops:
    new_residual = residual + allreduce(x) (in x.dtype, rounded once), normed = rms_norm(it).
    Returns (normed, new_residual)."""
    from sifar_jax.fused import rms_norm

    new_residual = residual + allreduce(x, axis_name)
    return rms_norm(new_residual, weight, eps), new_residual


def fused_add_norm_available() -> Optional[str]:
    """None when sifar_jax.psum_add_rmsnorm exists, else why not."""
    try:
        import sifar_jax
    except Exception as e:  # noqa: BLE001 - extension not built
        return f"import sifar_jax failed: {e!r}"
    if not hasattr(sifar_jax, "psum_add_rmsnorm"):
        return "sifar_jax has no psum_add_rmsnorm (the fused all-reduce + add + RMSNorm) yet"
    return None


def make_fused_add_norm(allreduce: str, algorithm: str = "auto",
                        prefetch_bytes: Optional[int] = None):
    """f(x, residual, weight, axis_name, *, eps, prefetch=None) -> (normed, new_residual) as one
    fused call; `prefetch` (the next matmul's weight) gets its first prefetch_bytes (None:
    sifar_jax's default, 0: none) brought into L2 while the all-reduce waits."""
    if allreduce != "sifar":
        raise ValueError(f"fused=True needs allreduce='sifar' (the fused kernel is sifar's), "
                         f"got allreduce={allreduce!r}")
    why = fused_add_norm_available()
    if why:
        raise NotImplementedError(f"fused=True: {why}")
    import sifar_jax

    if prefetch_bytes is not None and prefetch_bytes < 0:
        raise ValueError(f"prefetch_bytes must be >= 0 (or None: the default), got {prefetch_bytes}")
    return functools.partial(sifar_jax.psum_add_rmsnorm, algorithm=algorithm,
                             prefetch_bytes=prefetch_bytes)


# ---- what every layer receives ---------------------------------------------------------------------

class TPContext:
    """Per-trace view of the tensor-parallel axis that every layer receives.

    Lives only while one shard_map body is traced. `buffers` is the pytree threaded through the
    decode state as state["ar"] (empty unless sifar_buffers) and returned, updated, by the forward.
    `fused_add_norm` (optional) replaces all-reduce + residual add + RMSNorm by one call.
    """

    def __init__(self, axis_name: str, size: int, allreduce: AllReduceFn, buffers: Any = None,
                 allreduce_into=None, fused_add_norm=None):
        self.axis_name = axis_name
        self.size = size
        self._allreduce = allreduce
        self._allreduce_into = allreduce_into
        self._fused_add_norm = fused_add_norm
        self.buffers = {} if buffers is None else dict(buffers)
        self.count = 0  # all-reduces issued so far in this trace

    def rank(self) -> jax.Array:
        return jax.lax.axis_index(self.axis_name)

    def all_reduce(self, x: jax.Array) -> jax.Array:
        if self.buffers:
            # Explicit dual buffering: all-reduce k writes into buffer k % 2 and keeps the other
            # (the one all-reduce k-1 wrote) alive. The decode state donates state["ar"] every
            # step, so both are written in place and keep their registered addresses.
            cur, prev = ("a", "b") if self.count % 2 == 0 else ("b", "a")
            y, self.buffers[cur] = self._allreduce_into(x, self.axis_name, self.buffers[cur],
                                                        self.buffers[prev])
        else:
            y = self._allreduce(x, self.axis_name)
        self.count += 1
        return y

    def add_norm(self, x: jax.Array, residual: jax.Array, norm: RMSNorm,
                 next_weight: Optional[jax.Array] = None):
        """All-reduce the row-parallel partial x, add it to the residual stream, normalise with
        `norm`: (normed, new_residual). One fused call when fused, else the composition.
        next_weight: the weight the next matmul reads; the fused call prefetches its start into
        L2 while it waits for the other ranks (the unfused composition ignores it)."""
        weight = norm.weight[...]
        if hasattr(next_weight, "q"):  # an Fp8Weight: its e4m3 values are what is read next
            next_weight = next_weight.q
        elif hasattr(next_weight, "rows"):  # a RowWeight: its stored array
            next_weight = next_weight.w
        if self._fused_add_norm is not None:
            self.count += 1
            return self._fused_add_norm(x, residual, weight, self.axis_name, eps=norm.eps,
                                        prefetch=next_weight)
        return unfused_psum_add_rmsnorm(x, residual, weight, self.axis_name, eps=norm.eps,
                                        allreduce=lambda v, _: self.all_reduce(v))
