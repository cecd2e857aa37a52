"""How a model family's parameters and KV cache are laid out over the tp mesh axis.

Generic over families: a family declares which dimension of each parameter is split (its
`tp_dims` table: parameter name -> dimension; a name not in it is replicated) and its KV geometry
through its config (num_layers, num_heads, num_kv_heads, head_dim, dtype, and `replace`).

KV heads are replicated when tp > num_kv_heads (tp a multiple of it): the layout is then that of
an equivalent model with tp KV heads, each original head copied to tp/num_kv_heads ranks, each copy
with its share of the group's query heads (`tp_layout`, `replicate_kv`). Parameter values do not
depend on tp.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..weights.types import Fp8Weight, RowWeight, is_fp8, is_projection

# KV cache layouts, by the einsum letters of one layer's keys (or values): b batch, s positions,
# k kv heads, d head dim. Which one a platform reads in place: default_kv_layout.
KV_LAYOUTS = {"bshd": "bskd", "bhsd": "bksd"}
# The whole cache is one array: every layer's keys and values stacked in front of that layout
# (l layer, c 0 for keys and 1 for values). One array, not two per layer, because each array a
# step takes and donates costs the host time on every call (docs/performance.md), and a layer's
# keys and values are then written by one kernel.
STACK_DIMS = "lc"


def cache_dims(kv_layout: str) -> str:
    """The einsum letters of the whole cache array in `kv_layout` (STACK_DIMS + KV_LAYOUTS)."""
    return STACK_DIMS + KV_LAYOUTS[kv_layout]


# ---- tensor parallelism of the attention, and what else a family splits ---------------------------

def check_tp(config: Any, tp: int, splits: Sequence[tuple[str, int, str]] = ()) -> None:
    """Raise a clear error unless tp splits the attention (whole KV heads per rank, or one
    replicated head; whole query heads) and every size of `splits`: (name, size, why) triples,
    `why` said in the message when not empty."""
    if tp < 1:
        raise ValueError(f"tensor parallelism tp={tp} must be >= 1")
    problems = []
    if config.num_kv_heads % tp and tp % config.num_kv_heads:
        problems.append(f"num_kv_heads={config.num_kv_heads} or be a multiple of it (each rank "
                        f"holds whole KV heads, or one replicated head)")
    if config.num_heads % tp:
        problems.append(f"num_heads={config.num_heads}")
    for name, size, why in splits:
        if size % tp:
            problems.append(f"{name}={size}" + (f" ({why})" if why else ""))
    if problems:
        raise ValueError(f"tensor parallelism tp={tp} must divide " + ", ".join(problems))


def kv_replicas(config: Any, tp: int) -> int:
    """How many ranks hold a copy of each KV head (1 unless tp > num_kv_heads)."""
    return max(1, tp // config.num_kv_heads)


def tp_layout(config: Any, tp: int) -> Any:
    """The config whose shapes the tp-way layout uses: `config` itself, or, when tp > num_kv_heads,
    the equivalent model with tp KV heads (each head copied kv_replicas times, the group's query
    heads split among the copies; query head order unchanged). The family checks tp first."""
    r = kv_replicas(config, tp)
    return config if r == 1 else config.replace(num_kv_heads=config.num_kv_heads * r)


def replicate_kv(qkv, r: int):
    """[hidden, kv, g+2, d] -> [hidden, kv*r, g/r+2, d]: copy j of KV head i holds query heads
    j*g/r .. (j+1)*g/r - 1 of group i, then k and v of head i (works on numpy and jax arrays)."""
    if r == 1:
        return qkv
    xp = jnp if isinstance(qkv, jax.Array) else np
    h, kv, g2, d = qkv.shape
    g = g2 - 2
    q = qkv[:, :, :g].reshape(h, kv, r, g // r, d)
    k = xp.broadcast_to(qkv[:, :, None, g:], (h, kv, r, 2, d))
    return xp.concatenate([q, k], axis=3).reshape(h, kv * r, g // r + 2, d)


# ---- parameters ----------------------------------------------------------------------------------

def leaf_name(path) -> str:
    """The parameter name of a pytree path: its last key ("qkv", "weight", ...)."""
    return str(getattr(path[-1], "key", path[-1]))


def spec_for(name: str, ndim: int, tp_dims: Mapping[str, int], axis_name: str = "tp") -> P:
    """Split over axis_name along tp_dims[name]; replicated if the name is not in the table."""
    dim = tp_dims.get(name)
    if dim is None:
        return P()
    return P(*[axis_name if i == dim else None for i in range(ndim)])


def _scale_split(w, qdim: int, tp: int) -> Optional[int]:
    """The dim of w.scale split like q's dim qdim, or None: the scale stays whole on every rank
    (one block along that dim, or a block grid the shards do not line up with: local_fp8 then
    takes the rank's blocks by offset). scale is [*out[:-1], grid over out[-1], grid over K]."""
    n_out = w.q.ndim - w.n_in
    if qdim < n_out - 1:  # an out dim the scale has whole
        return qdim
    size, grid, block, axis = ((w.q.shape[qdim], w.scale.shape[n_out - 1], w.block[0], n_out - 1)
                               if qdim == n_out - 1 else
                               (math.prod(w.q.shape[n_out:]), w.scale.shape[-1], w.block[1],
                                w.scale.ndim - 1))
    if grid == 1:
        return None
    if qdim > n_out:  # the 2D view's K is the in dims flattened: only the first splits evenly
        raise ValueError(f"an Fp8Weight {tuple(w.q.shape)} split on contracted dim {qdim} "
                         f"(not the first, {n_out}) with a block grid over K: unsupported")
    local = size // tp
    return axis if local % block == 0 and grid == tp * (local // block) else None


def fp8_spec(w, dim: Optional[int], proj, axis_name: str, tp: int):
    """The Fp8Weight of PartitionSpecs of an Fp8Weight `w` (global shapes) whose einsum weight
    is split along `dim` (None: replicated): q's spec is the einsum weight's permuted
    (proj: quant.Projection), the scale's out dims split like q's where its block grid lines up
    with the shards (_scale_split)."""
    if dim is None or tp == 1:
        return Fp8Weight(P(), P(), w.n_in, w.block)
    qdim = proj.q_dim(w.q.ndim, dim)
    sdim = _scale_split(w, qdim, tp)
    one = lambda n, d: P(*[axis_name if i == d else None for i in range(n)])  # noqa: E731
    return Fp8Weight(one(w.q.ndim, qdim), one(w.scale.ndim, sdim), w.n_in, w.block)


def row_spec(w: RowWeight, dim: Optional[int], proj, axis_name: str) -> RowWeight:
    """The RowWeight of a PartitionSpec of a RowWeight whose einsum weight is split along `dim`
    (None: replicated): the einsum weight's spec, permuted as w is (proj: quant.Projection)."""
    if dim is None:
        return RowWeight(P(), w.n_in)
    qdim = proj.q_dim(w.w.ndim, dim)
    return RowWeight(P(*[axis_name if i == qdim else None for i in range(w.w.ndim)]), w.n_in)


def param_specs(params: dict, tp_dims: Mapping[str, int], axis_name: str = "tp",
                projections: Optional[Mapping[str, Any]] = None, tp: int = 1) -> dict:
    """PartitionSpec pytree for a parameter pytree (arrays or ShapeDtypeStructs); an Fp8Weight
    leaf gets an Fp8Weight of specs (fp8_spec: its family's `projections` entry, and the tp
    size, which decides whether a block grid lines up with the shards), a RowWeight a RowWeight
    of one (row_spec)."""
    def spec(path, leaf):
        name = leaf_name(path)
        if is_projection(leaf):
            if not projections or name not in projections:
                raise ValueError(f"a {type(leaf).__name__} at {jax.tree_util.keystr(path)}: "
                                 f"{name!r} is not a projection of this family (its "
                                 f"`projections` table)")
            if isinstance(leaf, RowWeight):
                return row_spec(leaf, tp_dims.get(name), projections[name], axis_name)
            return fp8_spec(leaf, tp_dims.get(name), projections[name], axis_name, tp)
        return spec_for(name, len(leaf.shape), tp_dims, axis_name)

    return jax.tree_util.tree_map_with_path(spec, params, is_leaf=is_projection)


def param_shardings(abstract: dict, mesh: Mesh, tp_dims: Mapping[str, int],
                    axis_name: str = "tp", projections: Optional[Mapping[str, Any]] = None
                    ) -> dict:
    """NamedSharding pytree for a parameter pytree laid out for `mesh` (see tp_layout)."""
    specs = param_specs(abstract, tp_dims, axis_name, projections, mesh.shape[axis_name])
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def _local_blocks(scale, axis: int, block: int, local: int, rank):
    """The scale rows (along `axis`, blocks of `block`) of a rank's `local` rows of a dim split
    evenly, on a grid of gcd(block, local) that starts at the rank's first row."""
    fine = math.gcd(block, local)
    idx = (rank * local + jnp.arange(local // fine) * fine) // block
    return jnp.take(scale, idx, axis=axis), fine


def local_fp8(params: dict, specs: dict, axis_name: str = "tp") -> dict:
    """Inside shard_map: each Fp8Weight whose q is split but whose scale was left whole
    (fp8_spec: a grid the shards do not line up with) gets this rank's blocks of it, by the
    rank's offset; everything else is returned as it is."""
    def one(w, spec):
        if not is_fp8(w):
            return w
        split = [i for i, a in enumerate(spec.q) if a == axis_name]
        if not split or axis_name in tuple(spec.scale):
            return w
        n_out, qdim = w.q.ndim - w.n_in, split[0]
        if qdim < n_out - 1:
            return w  # the scale has this dim whole: cannot happen with fp8_spec's specs
        rank = jax.lax.axis_index(axis_name)
        if qdim == n_out - 1:
            if w.scale.shape[n_out - 1] == 1:
                return w
            s, fine = _local_blocks(w.scale, n_out - 1, w.block[0], w.q.shape[qdim], rank)
            return Fp8Weight(w.q, s, w.n_in, (fine, w.block[1]))
        if w.scale.shape[-1] == 1:
            return w
        s, fine = _local_blocks(w.scale, w.scale.ndim - 1, w.block[1],
                                math.prod(w.q.shape[n_out:]), rank)
        return Fp8Weight(w.q, s, w.n_in, (w.block[0], fine))

    return jax.tree.map(one, params, specs, is_leaf=is_fp8)


# ---- the KV cache ----------------------------------------------------------------------------------

def default_kv_layout(mesh: Mesh) -> str:
    """The KV cache layout whose attention matmuls read it in place on `mesh`'s platform:
    "bhsd" on GPUs (the matmuls batch over (B, kv heads), which XLA:GPU wants major: with "bshd"
    it copied every cache tensor in and out of each step at batch > 1, docs/performance.md); "bshd"
    elsewhere (XLA:CPU updates it in place and copies "bhsd", tests/models/test_decode_loops.py)."""
    return "bhsd" if mesh.devices.flat[0].platform == "gpu" else "bshd"


def check_kv_layout(kv_layout: str) -> None:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {sorted(KV_LAYOUTS)}, got {kv_layout!r}")


def cache_spec(axis_name: str = "tp", kv_layout: str = "bshd") -> P:
    """The cache array's spec: split over kv heads, whichever axis holds them."""
    return P(*(axis_name if d == "k" else None for d in cache_dims(kv_layout)))


def cache_shape(layout: Any, batch_size: int, max_seq_len: int,
                kv_layout: str = "bshd") -> tuple[int, ...]:
    """The global shape of the cache array (cache_dims) of a tp layout's config."""
    sizes = {"l": layout.num_layers, "c": 2, "b": batch_size, "s": max_seq_len,
             "k": layout.num_kv_heads, "d": layout.head_dim}
    return tuple(sizes[d] for d in cache_dims(kv_layout))


def init_cache(layout: Any, mesh: Mesh, batch_size: int, max_seq_len: int,
               axis_name: str = "tp", kv_layout: str = "bshd") -> jax.Array:
    """Zero KV cache of a tp layout's config (tp_layout: with tp > num_kv_heads each rank holds
    its copy of one KV head), created directly sharded (no host copy): one array, cache_dims."""
    shape = cache_shape(layout, batch_size, max_seq_len, kv_layout)
    sharding = NamedSharding(mesh, cache_spec(axis_name, kv_layout))
    return jax.jit(lambda: jnp.zeros(shape, layout.dtype), out_shardings=sharding)()
