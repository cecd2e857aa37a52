"""`sifar_psum`: the drop-in `lax.psum` for one mesh axis inside `shard_map`."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from . import _ext, algorithms, comm, multicast
from .errors import NotInitializedError

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_LINE = 16  # bytes: the payload is moved in 16-byte lines
_warned: set[str] = set()


def _fallback(x, axis_name, reason: str):
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"sifar_jax: falling back to lax.psum: {reason}", stacklevel=3)
    return jax.lax.psum(x, axis_name)


def _axis_size(axis_name) -> int:
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError as e:
        raise ValueError(
            f"sifar_jax.sifar_psum: axis {axis_name!r} is not bound here; call it inside "
            f"jax.shard_map over a mesh that has this axis"
        ) from e


def _pick(algorithm: str, platform: str) -> str:
    if algorithm != algorithms.AUTO:
        return algorithm
    if platform == "cuda" and multicast.enabled():
        return algorithms.MULTICAST
    return algorithms.SIFAR


def sifar_psum(x, axis_name, *, algorithm: str = algorithms.AUTO, _repeat: int = 1):
    """All-reduce (sum) of `x` over the mesh axis `axis_name`, like `lax.psum`.

    Use inside `jax.shard_map` under `jax.jit`, after `sifar_jax.init(mesh)`.
    Every rank gets a bit-identical result: partials are added in rank order
    in float32 and rounded once. Supports float32, bfloat16 and float16 of any
    shape. With algorithm="auto" it falls back to `lax.psum` (warning once with
    the reason) where it cannot run; an explicitly named algorithm raises.

    `_repeat` (benchmarks only): run that many all-reduces of `x` back to back
    inside one handler call / kernel launch, the paper's kernel-level method.
    """
    algorithms.validate(algorithm)
    x = jnp.asarray(x)
    dtype = jnp.dtype(x.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"sifar_jax.sifar_psum: dtype {dtype} is not supported; use float32, bfloat16 or "
            f"float16 (or lax.psum for other types)"
        )
    explicit = algorithm != algorithms.AUTO

    def cannot(reason: str, exc=ValueError):
        if explicit:
            raise exc(f"sifar_jax.sifar_psum(algorithm={algorithm!r}): {reason}")
        return _fallback(x, axis_name, reason)

    if isinstance(axis_name, (tuple, list)):
        if len(axis_name) != 1:
            return cannot("reducing over several axes at once is not supported")
        axis_name = axis_name[0]
    n = _axis_size(axis_name)

    comms = [c for c in comm.communicators(axis_name) if c.nranks == n]
    if not comms:
        unsupported = [u for u in comm.unsupported(axis_name) if u.nranks == n]
        if unsupported:
            return cannot(unsupported[0].reason)
        raise NotInitializedError(
            f"sifar_jax.sifar_psum: no communicator for axis {axis_name!r} of size {n}; "
            f"call sifar_jax.init(mesh) with the mesh you pass to shard_map first"
        )
    platform = comms[0].platform
    chosen = _pick(algorithm, platform)
    if chosen == algorithms.MULTICAST:
        if platform != "cuda":
            return cannot("multicast needs NVLink GPUs")
        multicast.require_enabled()  # raises a clear error while it is off

    nbytes = x.size * dtype.itemsize
    padded = -(-nbytes // _LINE) * _LINE
    slot = min(c.slot_bytes for c in comms)
    if padded > slot:
        return cannot(
            f"payload of {padded} bytes exceeds the {slot}-byte slot "
            f"(raise it with sifar_jax.init(mesh, slot_bytes=...))"
        )
    if x.size == 0:
        return x

    flat = x.reshape(-1)
    pad = (padded - nbytes) // dtype.itemsize
    if pad:
        flat = jnp.pad(flat, (0, pad))
    call = jax.ffi.ffi_call(
        _ext.TARGET,
        jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        # On XLA:CPU independent custom calls may run concurrently; marking the
        # call side-effecting keeps every rank's all-reduces in program order.
        has_side_effect=(platform == "cpu"),
    )
    out = call(
        flat,
        axis_key=np.int32(comms[0].axis_key),
        nranks=np.int32(n),
        algorithm=np.int32(algorithms.IDS[chosen]),
        repeat=np.int32(_repeat),
    )
    if pad:
        out = out[: x.size]
    return out.reshape(x.shape)
