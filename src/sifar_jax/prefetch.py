"""`l2_prefetch`: bring a weight's first bytes into the GPU's L2 while latency-bound kernels run.

A batch-1 decode step alternates weight-streaming matmuls with short kernels that barely touch
memory (RoPE, the cache write, attention over a short cache, residual adds and norms): ~19 us
per Llama-8B layer on an H200 during which the memory is idle. `l2_prefetch(w, *after)` is an
op whose kernel (ffi/prefetch/) hands the first `nbytes` of `w` to the copy engines as bulk L2
prefetches once `after` is ready; nothing is read into the SMs and no result changes. It returns
a token (one int32 zero) that the caller folds into a later result (`fold`), so that XLA keeps
the op and orders it after `after`.

It only helps where XLA runs it *beside* those short kernels: XLA:GPU's default command-buffer
scheduling runs a step's kernels one after another (then the prefetch only adds its own time);
`CONCURRENT_OPTIONS` makes XLA build each command buffer as a graph of its data dependencies,
where the prefetch overlaps the kernels after `after` (docs/performance.md has the measurement).
On the CPU the op only writes the token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _ext, _jax_compat

__all__ = ["l2_prefetch", "fold", "CONCURRENT_OPTIONS"]

# XLA:GPU compile options under which independent kernels of one command buffer may overlap.
CONCURRENT_OPTIONS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}


def _nbytes(weight, nbytes) -> int:
    size = int(np.prod(weight.shape)) * jnp.dtype(weight.dtype).itemsize
    if nbytes is None:
        nbytes = size
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"sifar_jax.l2_prefetch: nbytes must be an int or None, got {nbytes!r}")
    if not 0 <= nbytes <= size:
        raise ValueError(f"sifar_jax.l2_prefetch: nbytes must be in [0, {size}] (the weight's "
                         f"bytes), got {nbytes}")
    return int(nbytes) // 16 * 16  # the bulk prefetch moves whole 16-byte units


def l2_prefetch(weight: jax.Array, *after: jax.Array, nbytes: int | None = None) -> jax.Array:
    """Bring weight's first `nbytes` (None: all of it; rounded down to 16 bytes) into the GPU's
    L2 once every array in `after` is ready (they are not read). Returns a token, one int32
    zero of shape (1,): pass it to `fold` on a later result, or as an `after` of the next
    prefetch (a chain), so that XLA keeps and orders the op. A hint only: nothing it returns
    depends on the weight's values."""
    for a in (weight, *after):
        if not hasattr(a, "dtype") or not hasattr(a, "shape"):
            raise TypeError(f"sifar_jax.l2_prefetch: weight and after must be arrays, got "
                            f"{type(a).__name__}")
    n = _nbytes(weight, nbytes)

    def call():
        args = _jax_compat.same_varying(weight, *after)
        token = jax.typeof(args[0]).update(shape=(1,), dtype=jnp.dtype(jnp.int32))
        return jax.ffi.ffi_call(_ext.TARGETS.l2_prefetch, token)(*args, nbytes=np.int64(n))

    if "cuda" in _ext.PLATFORMS:
        return call()
    # A build without the CUDA backend: GPUs get a plain zero, the CPU its handler.
    return jax.lax.platform_dependent(cpu=call, default=lambda: jnp.zeros((1,), jnp.int32))


def fold(x: jax.Array, token: jax.Array | None) -> jax.Array:
    """x plus the token (an int32 zero): x's values (a -0.0 becomes 0.0), computed after the
    prefetch ran."""
    if token is None:
        return x
    return x + token.astype(x.dtype).reshape((1,) * x.ndim)
