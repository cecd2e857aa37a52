"""A decoder's small replicated vectors (the norms' scales) packed into one array per dtype.

Every array a compiled step takes costs the host time on each call (docs/performance.md), paid
once per waited (sync) step. Llama-3.1-8B has 65 norm scales among its 195 weights,
Qwen3-30B-A3B 193 (two norms and the per-head q/k norms per layer) among ~435. Packed, each becomes a static
slice of one array inside the step, which XLA fuses into the norm that reads it (no copy).

Only vectors (1-D arrays) that are replicated over the mesh and at most `max_bytes` are packed:
a sharded weight cannot share a buffer with a replicated one, and a matmul's weight is kept as it
is, however small (a matmul reading a slice of a larger array ran ~18% slower,
`stacked_weights`). A caller keeps others out with `keep`: the decoder keeps the norm scales the
fused all-reduce takes, an operand of a custom call, where XLA would copy a slice first.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

MAX_BYTES = 64 * 1024  # a norm scale is 4-16 KB; the smallest matmul weight is ~1 MB
ALIGN = 64  # elements: each packed slice starts 128-byte aligned for bf16 (vector loads)


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """How `pack` split a list of leaves: `kept` leaves are passed as they are, in order, then one
    packed array per entry of `groups`: (dtype, ((leaf index, offset, shape), ...))."""
    n_leaves: int
    kept: tuple[int, ...]
    groups: tuple[tuple[str, tuple[tuple[int, int, tuple[int, ...]], ...]], ...]

    @property
    def n_packed(self) -> int:
        return sum(len(members) for _, members in self.groups)


def _packable(a, max_bytes: int) -> bool:
    return (isinstance(a, jax.Array) and a.ndim == 1 and 0 < a.nbytes <= max_bytes
            and a.sharding.is_fully_replicated)


def pack(leaves: Sequence[jax.Array], mesh, max_bytes: int = MAX_BYTES,
         keep: Optional[Sequence[bool]] = None) -> tuple[PackPlan, list[jax.Array]]:
    """(plan, arrays): the kept leaves, then one replicated array per dtype holding the small
    vectors back to back. keep[i]: pass leaf i as it is. A dtype with a single small vector is
    kept as it is (nothing to save)."""
    by_dtype: dict[str, list[int]] = {}
    for i, a in enumerate(leaves):
        if not (keep is not None and keep[i]) and _packable(a, max_bytes):
            by_dtype.setdefault(str(a.dtype), []).append(i)
    by_dtype = {d: ix for d, ix in by_dtype.items() if len(ix) > 1}
    packed_ix = {i for ix in by_dtype.values() for i in ix}
    kept = tuple(i for i in range(len(leaves)) if i not in packed_ix)
    groups, arrays = [], [leaves[i] for i in kept]
    rep = NamedSharding(mesh, P())
    for dtype, ix in by_dtype.items():
        members, parts, off = [], [], 0
        for i in ix:
            a = leaves[i]
            members.append((i, off, tuple(a.shape)))
            pad = -a.size % ALIGN
            # the local copy (a replicated array is whole on each process's devices)
            parts.append(np.asarray(a.addressable_data(0)).reshape(-1))
            if pad:
                parts.append(np.zeros(pad, parts[-1].dtype))
            off += a.size + pad
        groups.append((dtype, tuple(members)))
        arrays.append(jax.device_put(np.concatenate(parts), rep))
    return PackPlan(len(leaves), kept, tuple(groups)), arrays


def unpack(plan: PackPlan, arrays: Sequence[jax.Array]) -> list[jax.Array]:
    """The original leaves from pack's arrays (inside jit: static slices of the packed ones)."""
    if len(arrays) != len(plan.kept) + len(plan.groups):
        raise ValueError(f"unpack: {len(arrays)} arrays for a plan of {len(plan.kept)} kept "
                         f"leaves and {len(plan.groups)} packed groups")
    out: list = [None] * plan.n_leaves
    for i, a in zip(plan.kept, arrays):
        out[i] = a
    for (_, members), buf in zip(plan.groups, arrays[len(plan.kept):]):
        for i, off, shape in members:
            out[i] = jax.lax.slice(buf, (off,), (off + int(np.prod(shape, dtype=np.int64)),)
                                   ).reshape(shape)
    return out


class PackedParams:
    """A decoder's parameters as the flat list of arrays every call takes, flattened once (no
    per-call flattening of a nested dict), packed with `pack` when `packed` (keep[i]: leaf i
    stays an array of its own)."""

    def __init__(self, params: dict, mesh, packed: bool = True,
                 keep: Optional[Sequence[bool]] = None):
        self.params = params
        paths, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        self.paths = [p for p, _ in paths]
        leaves = [a for _, a in paths]
        self.plan, self.leaves = pack(leaves, mesh, keep=keep) if packed else (None, leaves)

    def unflatten(self, leaves) -> dict:
        """The params tree from the arrays a call takes (packed ones unpacked: static slices)."""
        if self.plan is not None:
            leaves = unpack(self.plan, leaves)
        return jax.tree.unflatten(self.treedef, leaves)
