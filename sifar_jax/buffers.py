"""Explicit dual buffering: the all-reduce slots as arrays the program owns.

`sifar_psum` hides its two slots inside the library and picks one by epoch
parity. The explicit form makes the alternation visible to XLA instead:

    bufs = sifar_jax.make_buffers(mesh, "tp")        # once, after init(mesh)
    spec = sifar_jax.buffer_spec(mesh)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(x, bufs):
        def body(x, a, b):
            y, a = sifar_jax.sifar_psum_into(x, "tp", a, b)   # writes into a
            z, b = sifar_jax.sifar_psum_into(y, "tp", b, a)   # writes into b
            return z, a, b
        z, a, b = jax.shard_map(body, mesh=mesh,
                                in_specs=(P(), spec, spec),
                                out_specs=(P(), spec, spec))(x, *bufs)
        return z, sifar_jax.DualBuffers(a, b)

Each call writes its partial into `buf` (aliased in place and returned) and
keeps `prev`, the buffer of the call before, alive: consecutive all-reduces
must alternate between the two, which is what makes the missing bottom
barrier safe. Donating the buffers keeps their addresses across steps; the
handler checks every buffer against the registered addresses and raises if
XLA ever copied one.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _ext, comm, ordering, psum
from .errors import NotInitializedError


class DualBuffers(NamedTuple):
    """A pair of symmetric all-reduce buffers for one mesh axis (a pytree)."""

    a: jax.Array
    b: jax.Array


def buffer_spec(mesh) -> P:
    """The shard_map in/out spec of each buffer: one row per device."""
    return P(tuple(mesh.axis_names))


def make_buffers(mesh, axis_name: str) -> DualBuffers:
    """Creates and registers the two buffers of `axis_name` on every device of `mesh`.

    Call `sifar_jax.init(mesh)` first. Each device holds one row of each buffer
    (a uint8 array of shape (mesh.size, slot_bytes_total)).
    """
    comms = comm.communicators(axis_name)
    if not comms:
        raise NotInitializedError(
            f"sifar_jax.make_buffers: no communicator for axis {axis_name!r}; "
            f"call sifar_jax.init(mesh) first"
        )
    if any(c.processes for c in comms):
        raise NotImplementedError(
            f"sifar_jax.make_buffers: axis {axis_name!r} spans several processes; explicit "
            f"buffers need every rank in one process (use sifar_psum there)"
        )
    total = _ext._sifar.slot_total_bytes(comms[0].comm_id)
    sharding = NamedSharding(mesh, buffer_spec(mesh))
    shape = (mesh.devices.size, total)
    make = jax.jit(lambda: jnp.zeros(shape, jnp.uint8), out_shardings=sharding)
    a, b = make(), make()  # two calls: two allocations
    for arr in (a, b):
        arr.block_until_ready()
        ptr = {s.device.id: s.data.unsafe_buffer_pointer() for s in arr.addressable_shards}
        for c in comms:
            for g, group in enumerate(c.groups):
                if all(d in ptr for d in group):
                    _ext._sifar.register_buffer(c.comm_id, g, [ptr[d] for d in group])
    return DualBuffers(a, b)


def sifar_psum_into(x, axis_name, buf, prev, *, algorithm: str = "auto"):
    """`sifar_psum` that uses `buf` as this call's slot. Returns `(sum, buf)`.

    `buf` must be the buffer the previous all-reduce did NOT write (pass that
    one as `prev`): alternate the two buffers of `make_buffers`. Where the call
    cannot run (see sifar_psum), "auto" falls back to `lax.psum` and returns
    `buf` unchanged.
    """
    x = jnp.asarray(x)
    plan = psum._plan(x, axis_name, algorithm, "sifar_psum_into")
    if isinstance(plan, str):
        return psum._fallback(x, axis_name, plan), buf
    if x.size == 0:
        return x, buf
    flat = psum._flat(x, plan)
    call = jax.ffi.ffi_call(
        _ext.TARGET_INTO,
        (jax.ShapeDtypeStruct(flat.shape, flat.dtype), jax.ShapeDtypeStruct(buf.shape, buf.dtype)),
        input_output_aliases={1: 1},
        has_side_effect=(plan.platform == "cpu"),
    )
    out, buf = call(flat, buf, prev, *ordering.operands(flat), **plan.attrs())
    ordering.remember(flat, out)
    return psum._unflat(out, x, plan), buf
