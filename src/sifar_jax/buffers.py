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
XLA ever copied one, and if a rank's previous explicit call used the same
buffer.

Registrations follow the arrays' lives. The handler of rank r sees only its
own copy's address, so it must be sure that the registration it finds there
is the one every other rank finds too: that holds when at most one
registration names each address and every registration belongs to a live
array (all ranks of one array are allocated and freed together). Two rules
keep it so: a new registration drops every older one that overlaps it on any
device (that memory was freed, since a live array now occupies it), and each
`make_buffers` first drops the registrations whose arrays are no longer alive
(no live array holds exactly their addresses: donating moves an array's
memory to the step's output array, which is found the same way). A lookup
that matches two registrations is an error, never a guess.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _ext, _jax_compat, algorithms, comm, ordering
from .errors import NotInitializedError
from .plan import Fallback, flatten, plan_array, unflatten

# (comm id, registration id) -> the (device id, address) of every rank's copy.
_registered: dict[tuple[int, int], frozenset] = {}


class DualBuffers(NamedTuple):
    """A pair of symmetric all-reduce buffers for one mesh axis (a pytree)."""

    a: jax.Array
    b: jax.Array


def buffer_spec(mesh) -> P:
    """The shard_map in/out spec of each buffer: one row per device."""
    return P(tuple(mesh.axis_names))


def _drop_dead_registrations(platform: str) -> None:
    """Unregisters every buffer whose array is no longer alive (module docstring)."""
    live_ids = {c.comm_id for c in comm.communicators()}
    holders = collections.defaultdict(set)  # (device id, address) -> live arrays holding it
    for arr in jax.live_arrays(platform):
        if arr.dtype != np.uint8 or arr.ndim != 2 or arr.is_deleted():
            continue
        for s in arr.addressable_shards:
            holders[(s.device.id, s.data.unsafe_buffer_pointer())].add(id(arr))
    for (comm_id, reg), places in list(_registered.items()):
        alive = comm_id in live_ids and bool(set.intersection(*(holders[p] for p in places)))
        if not alive:
            del _registered[(comm_id, reg)]
            if comm_id in live_ids:
                _ext.lib.unregister_buffer(comm_id, reg)


def make_buffers(mesh, axis_name: str) -> DualBuffers:
    """Creates and registers the two buffers of `axis_name` on every device of `mesh`.

    Call `sifar_jax.init(mesh)` first. Each device holds one row of each buffer
    (a uint8 array of shape (mesh.size, slot_bytes_total)). The buffers stay
    registered while their arrays (or the arrays a donating step returns in
    their place) are alive. Drop them only once every rank's last call that
    used them has finished (e.g. after reading a result of that step): a peer
    may still read a buffer after its own rank is done with it.
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
    total = _ext.lib.slot_total_bytes(comms[0].comm_id)
    sharding = NamedSharding(mesh, buffer_spec(mesh))
    shape = (mesh.devices.size, total)
    make = jax.jit(lambda: jnp.zeros(shape, jnp.uint8), out_shardings=sharding)
    a, b = make(), make()  # two calls: two allocations
    _drop_dead_registrations(mesh.devices.flat[0].platform)
    for arr in (a, b):
        arr.block_until_ready()
        ptr = {s.device.id: s.data.unsafe_buffer_pointer() for s in arr.addressable_shards}
        for c in comms:
            for g, group in enumerate(c.groups):
                if all(d in ptr for d in group):
                    reg = _ext.lib.register_buffer(c.comm_id, g, [ptr[d] for d in group], total)
                    _registered[(c.comm_id, reg)] = frozenset((d, ptr[d]) for d in group)
    return DualBuffers(a, b)


# trace -> weak refs to the buffers the last sifar_psum_into traced into it
# wrote (its input and its aliased output).
_last_written: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _check_alternation(buf, prev, api: str) -> None:
    """Trace-time half of the alternation check (the handler checks addresses)."""
    if buf is prev:
        raise ValueError(f"sifar_jax.{api}: buf and prev are the same buffer; pass the two "
                         f"buffers of sifar_jax.make_buffers, alternating")
    trace = _jax_compat.trace_of(buf)
    try:
        last = _last_written.get(trace, ()) if trace is not None else ()
    except TypeError:  # a trace that cannot be weakly referenced: the handler still checks
        return
    if any(ref() is buf for ref in last):
        raise ValueError(f"sifar_jax.{api}: buf is the buffer the previous sifar_psum_into "
                         f"wrote; consecutive calls must alternate the two buffers "
                         f"(y, a = sifar_psum_into(x, axis, a, b); z, b = sifar_psum_into(y, "
                         f"axis, b, a))")


def _remember_written(buf_in, buf_out) -> None:
    trace = _jax_compat.trace_of(buf_in)
    if trace is None:
        return
    try:
        _last_written[trace] = (weakref.ref(buf_in), weakref.ref(buf_out))
    except TypeError:
        pass


def sifar_psum_into(x, axis_name, buf, prev, *, algorithm: str = "auto"):
    """`sifar_psum` that uses `buf` as this call's slot. Returns `(sum, buf)`.

    `buf` must be the buffer the previous all-reduce did NOT write (pass that
    one as `prev`): alternate the two buffers of `make_buffers`. Where the call
    cannot run (see sifar_psum), "auto" falls back to `lax.psum` and returns
    `buf` unchanged. "multicast" has its own buffers (a multicast object), so
    it cannot use these: naming it is an error, and "auto" never picks it here.
    """
    if algorithm == algorithms.MULTICAST:
        raise ValueError(
            "sifar_jax.sifar_psum_into: algorithm 'multicast' does not support explicit "
            "buffers (it reduces through its own multicast object); use sifar_psum"
        )
    x = jnp.asarray(x)
    _check_alternation(buf, prev, "sifar_psum_into")
    plan = plan_array(x, axis_name, algorithm, "sifar_psum_into")
    if isinstance(plan, Fallback):
        return plan.psum(x, axis_name, stacklevel=2), buf
    if plan.algorithm == algorithms.MULTICAST:  # what "auto" picks where multicast is on
        plan = dataclasses.replace(plan, algorithm=algorithms.SIFAR)
    if x.size == 0:
        return x, buf
    flat = flatten(x, plan)
    call = jax.ffi.ffi_call(
        _ext.TARGETS.allreduce_into,
        (jax.ShapeDtypeStruct(flat.shape, flat.dtype), jax.ShapeDtypeStruct(buf.shape, buf.dtype)),
        input_output_aliases={1: 1},
        has_side_effect=(plan.platform == "cpu"),
    )
    out, buf_out = call(flat, buf, prev, *ordering.operands(flat), **plan.attrs())
    ordering.remember(flat, out)
    _remember_written(buf, buf_out)
    return unflatten(out, x, plan), buf_out
