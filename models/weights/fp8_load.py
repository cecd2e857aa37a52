"""FP8 projections onto a mesh: the hub's FP8 checkpoints (fp8_checkpoint.py's layouts) and bf16
ones quantized per output channel as they load (quantize="fp8"), each projection an Fp8Weight
(types.py) placed shard by shard from the memory-mapped files; and the way back (fp8_to_hf).

The projections' e4m3 values go through the family's own builders (its loader's hf_builders:
q/k/v fused per KV head with KV replication, gate/up interleaved, expert
stacks), which only slice, transpose and concatenate, so they move float8 as they move bf16.
The scales are small (one per channel, tensor or 128x128 block) and are laid out whole on the
host in our layout: each fused segment (a head's rows of q, k or v; gate or up; an expert) takes
its source tensor's scale rows. The grid stays the checkpoint's (a grid the TP shards do not line
up with stays whole on every rank, sharding.fp8_spec), except in qkv, whose segments are heads:
a block that neither holds whole heads nor a whole number of them per head (head_dim 192 in
blocks of 128) is regridded to gcd(block, head_dim) rows.

What stays in the compute dtype: embeddings, norms, the router, and the LM head where the
checkpoint has it in bf16. Every check runs before anything is placed on a device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Optional

import jax
import numpy as np

from ..core.sharding import leaf_name
from . import checkpoint, fp8_placement
from .fp8_checkpoint import (DTYPES, E4M3_MAX, Fp8CheckpointError, Fp8Scheme, channel_scale,
                             parse_quantization_config, quantization_config, read_fp8_weight,
                             read_safetensors, scheme_from_spec, write_fp8_weight)
from .hf import hf_name
from .types import Fp8Weight, is_fp8, is_quantized

E4M3 = DTYPES["F8_E4M3"]


# ---- readers: checkpoint.Checkpoint's interface, float8 included -------------------------------

class MemmapCheckpoint:
    """Name -> slice reader over a folder's .safetensors files, memory-mapped (float8 too)."""

    def __init__(self, path: str):
        # with an index, the tensors it maps, each from the file it names (a folder may hold
        # other files); every header checked first (checkpoint.read_index)
        self.index = checkpoint.read_index(path)
        files = {fn: read_safetensors(os.path.join(path, fn)) for fn in self.index.headers}
        self.tensors = {k: files[fn][k] for k, fn in self.index.weight_map.items()}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str, dim: int = 0, lo: Optional[int] = None, hi: Optional[int] = None):
        if name not in self.tensors:
            raise self.index.missing(name)
        a = self.tensors[name]
        return np.array(a if lo is None else a[(slice(None),) * dim + (slice(lo, hi),)])


class QuantizingCheckpoint:
    """A bf16 checkpoint read as a compressed-tensors per-channel FP8 one: each of `modules`'
    weight slices quantized as it is read, with the scale channel_scale(max |row|) of the whole
    row (one pass over the rows in chunks), so the bits are fp8_checkpoint.quantize_per_channel's of the
    whole tensor whatever the TP split."""

    ROWS = 2048  # rows per chunk of the scale's pass

    def __init__(self, ck: checkpoint.Checkpoint, modules):
        self.ck, self.modules, self._scales = ck, set(modules), {}

    def __contains__(self, name: str) -> bool:
        return name in self.ck

    def scale(self, module: str) -> np.ndarray:
        if module not in self._scales:
            name = f"{module}.weight"
            n = self.ck.shape(name)[0]
            amax = [np.abs(np.asarray(self.ck.read(name, 0, lo, min(n, lo + self.ROWS)),
                                      np.float32)).max(axis=1, keepdims=True)
                    for lo in range(0, n, self.ROWS)]
            a = np.concatenate(amax)
            self._scales[module] = channel_scale(a)
        return self._scales[module]

    def read(self, name: str, dim: int = 0, lo: Optional[int] = None, hi: Optional[int] = None):
        w = self.ck.read(name, dim, lo, hi)
        module = name[: -len(".weight")]
        if not name.endswith(".weight") or module not in self.modules:
            return w
        s = self.scale(module)
        s = s[lo:hi] if dim == 0 and lo is not None else s
        return np.clip(np.asarray(w, np.float32) / s, -E4M3_MAX, E4M3_MAX).astype(E4M3)


# ---- each projection's source tensors and its scale grid in our layout -------------------------

def _stacked(mods, scales) -> tuple[np.ndarray, tuple[int, int]]:
    """Segments of one shape (gate and up; experts): their grids stacked, their block."""
    blocks = {scales[m][1] for m in mods}
    if len(blocks) != 1:
        raise Fp8CheckpointError(f"{mods[0]}...: scale blocks {sorted(blocks)} differ")
    return np.stack([scales[m][0] for m in mods]), blocks.pop()


def _qkv_scale(c, r: int, i: int, scales) -> tuple[np.ndarray, tuple[int, int]]:
    """qkv's grid [kv, g + 2, rows, SK] (c: the layout's config, r: KV replicas): layout head j
    holds query heads j*g .. j*g + g - 1, then k and v of checkpoint head j // r."""
    d, g = c.head_dim, c.group_size
    mods = [hf_name(f"self_attn.{p}_proj", i)[: -len(".weight")] for p in "qkv"]
    bns, bks = {scales[m][1][0] for m in mods}, {scales[m][1][1] for m in mods}
    if len(bks) != 1:
        raise Fp8CheckpointError(f"{mods[0]}: q/k/v scale blocks over the input differ ({bks})")
    bn = next(iter(bns))
    if len(bns) > 1 or (d % bn and bn % d):  # per tensor, or blocks that straddle heads
        bn = math.gcd(d, *bns)
    offs = np.arange(0, d, bn) if bn < d else np.zeros(1, np.int64)

    def rows(m, head):
        grid, (sbn, _) = scales[m]
        return grid[(head * d + offs) // sbn]

    out = np.stack([np.stack([rows(mods[0], j * g + s) for s in range(g)]
                             + [rows(mods[1], j // r), rows(mods[2], j // r)])
                    for j in range(c.num_kv_heads)])
    return out, (bn, bks.pop())


def projection_modules(family_name: str, c, i: Optional[int]) -> dict[str, list[str]]:
    """Layer i's (or, i None, the stack's) projections -> the HF modules each reads."""
    if i is None:
        return {} if c.tie_word_embeddings else {"lm_head": ["lm_head"]}

    def mod(name):
        return hf_name(name, i)[: -len(".weight")]

    out = {"qkv": [mod(f"self_attn.{p}_proj") for p in "qkv"], "o": [mod("self_attn.o_proj")]}
    if family_name == "qwen3_moe":
        e = range(c.num_experts)
        out["gate_up"] = [mod(f"mlp.experts.{j}.{p}_proj") for j in e for p in ("gate", "up")]
        out["down"] = [mod(f"mlp.experts.{j}.down_proj") for j in e]
    else:
        out["gate_up"] = [mod("mlp.gate_proj"), mod("mlp.up_proj")]
        out["down"] = [mod("mlp.down_proj")]
    return out


def scale_grid(name: str, mods: list[str], layout, i: Optional[int], scales):
    """A projection's scale grid in our layout and its block (Fp8Weight.scale, .block)."""
    if name == "qkv":
        return _qkv_scale(layout.shapes, layout.kv_replicas, i, scales)
    grid, block = _stacked(mods, scales)
    if name == "gate_up" and len(mods) > 2:  # experts: [E, 2, SN, SK]
        grid = grid.reshape((len(mods) // 2, 2) + grid.shape[1:])
    elif name in ("o", "down", "lm_head") and len(mods) == 1:
        grid = grid[0]
    return grid, block


# ---- the checks, then the placement -------------------------------------------------------------

def _plan(family, layout, lm_head_fp8: bool):
    """{param path keys: (name, modules)} of every projection loaded in FP8."""
    c, out = layout.shapes, {}
    for name, mods in projection_modules(family.name, c, None).items():
        if lm_head_fp8:
            out[(name,)] = (name, mods)
    for i in range(c.num_layers):
        block = "moe" if family.name == "qwen3_moe" else "mlp"
        for name, mods in projection_modules(family.name, c, i).items():
            out[("layers", i, "attn" if name in ("qkv", "o") else block, name)] = (name, mods)
    return out


def check_float8(tensors: dict, modules: set) -> None:
    """Every float8 tensor of the checkpoint must be a projection's weight we read as FP8 (a
    router or norm in float8 would otherwise be cast without its scale)."""
    for name, a in tensors.items():
        if a.dtype in (DTYPES["F8_E4M3"], DTYPES["F8_E5M2"]) and (
                not name.endswith(".weight") or name[: -len(".weight")] not in modules):
            raise Fp8CheckpointError(f"{name}: a float8 tensor that is not one of the "
                                     f"projections read in FP8 (embeddings, norms, the router "
                                     f"and an unquantized LM head must be bf16/f16/f32)")


def read_scales(ck, plan: dict, scheme: Fp8Scheme) -> dict:
    """{module: (scale grid float32, block)} of every planned module, each checked."""
    out = {}
    for _, mods in plan.values():
        for m in mods:
            if isinstance(ck, QuantizingCheckpoint):
                s = ck.scale(m)
                out[m] = (s, (1, ck.ck.shape(f"{m}.weight")[1]))
            else:
                _, s, block = read_fp8_weight(ck.tensors, m, scheme)
                out[m] = (s, block)
    return out


def check_k_blocks(plan: dict, grids: dict, tensors: dict, tp: int) -> None:
    """A row-parallel projection's blocks over its input must give each rank's K a grid of
    multiples of 16 (what the FP8 GEMV reads): a rank's K that starts inside a block is
    regridded to gcd(block, K / tp) columns (sharding.local_fp8)."""
    for keys, (name, mods) in plan.items():
        grid, (_, bk) = grids[keys]
        if name not in ("o", "down") or grid.shape[-1] == 1 or tp == 1:
            continue
        local = tensors[f"{mods[0]}.weight"].shape[1] // tp
        fine = math.gcd(bk, local)
        if local % bk and fine < local and fine % 16:
            raise Fp8CheckpointError(
                f"{mods[0]}.weight: its scale blocks of {bk} input columns do not line up with "
                f"TP={tp}'s shards of {local} columns (a rank's blocks would be {fine} wide; "
                f"the FP8 GEMV takes multiples of 16): load it at another TP size")


def check_local_k(family, layout, mesh, axis_name: str, paths=None) -> None:
    """Each FP8 projection of the tp layout (those at `paths`, param path keys; all of the
    family's table when None) must leave a rank a multiple of the FP8 GEMV's 16 contracted
    columns (sifar_jax.fp8_matvec): checked on the layout's shapes and shardings, before
    anything is read or made, so a TP that cannot run it is one ValueError, not a failed trace."""
    from sifar_jax.fp8_matvec import CHUNK

    _, abstract = family.abstract_model(layout.shapes)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    for (path, sds), sh in zip(flat, treedef.flatten_up_to(
            family.param_shardings(layout, mesh, axis_name))):
        name = leaf_name(path)
        if name not in family.projections or (
                paths is not None and fp8_placement.path_keys(path) not in paths):
            continue
        proj = family.projections[name]
        contracted = slice(proj.lead, proj.lead + proj.n_in)
        k = math.prod(sh.shard_shape(sds.shape)[contracted])
        if k % CHUNK:
            raise ValueError(f"FP8 weights: {name!r} has {k} contracted columns per rank at "
                             f"TP={layout.tp} (in dims {tuple(sds.shape[contracted])}), not a "
                             f"multiple of {CHUNK}, the FP8 GEMV's unit: use a tensor-parallel "
                             f"size that leaves each rank a multiple of {CHUNK}, or dense "
                             f"weights")


def _lm_head_fp8(family, layout, ck, scheme: Fp8Scheme, quantizing: bool) -> bool:
    """Whether the LM head loads in FP8: with quantize="fp8" always (untied); from an FP8
    checkpoint where its layout quantizes it (fine-grained FP8 leaves the head in bf16 unless
    it ships its scale, as transformers does)."""
    if layout.shapes.tie_word_embeddings:
        return False
    if quantizing:
        return True
    if not scheme.quantized("lm_head"):
        return False
    return scheme.layout != "fp8" or f"lm_head.{scheme.scale_suffix}" in ck


def _open(path: str, stack, hf: dict, quantize: Optional[str]):
    """(reader, scheme, quantizing) of the checkpoint at path."""
    if quantize not in (None, "fp8"):
        raise ValueError(f"quantize must be None or 'fp8', got {quantize!r}")
    scheme = parse_quantization_config(hf)
    if scheme is not None:
        return MemmapCheckpoint(path), scheme, False
    base = checkpoint.Checkpoint(path, stack)
    return QuantizingCheckpoint(base, ()), Fp8Scheme("compressed-tensors", "channel"), True


def load_fp8(family, path: str, mesh, layout, axis_name: str, quantize: Optional[str]):
    """(config, params) of the checkpoint at path, its projections as Fp8Weight leaves (see the
    module docstring): an FP8 checkpoint's own, or with quantize="fp8" a bf16 checkpoint's
    quantized per output channel as they load."""
    hf = checkpoint.read_hf_config(path)
    with contextlib.ExitStack() as stack:
        ck, scheme, quantizing = _open(path, stack, hf, quantize)
        _, abstract = family.abstract_model(layout.shapes)  # the e4m3 weights have these shapes
        checkpoint.check_reads(
            ck.ck.index if quantizing else ck.index, family.hf_shapes(layout), abstract,
            family.param_shardings(layout, mesh, axis_name), family.tp_dims,
            lambda reader: family.loader.hf_builders(layout.shapes, reader, layout.kv_replicas),
            float8=not quantizing)
        head = _lm_head_fp8(family, layout, ck, scheme, quantizing)
        plan = _plan(family, layout, head)
        modules = {m for _, mods in plan.values() for m in mods}
        if quantizing:
            ck.modules = modules
            check_local_k(family, layout, mesh, axis_name, plan)  # before the scales' pass
        else:
            check_float8(ck.tensors, modules)
        scales = read_scales(ck, plan, scheme)
        grids = {k: scale_grid(name, mods, layout, k[1] if len(k) > 1 else None, scales)
                 for k, (name, mods) in plan.items()}
        if not quantizing:  # the blocks first: their message is the more specific
            check_k_blocks(plan, grids, ck.tensors, layout.tp)
            check_local_k(family, layout, mesh, axis_name, plan)
        builders = family.loader.hf_builders(layout.shapes, ck, layout.kv_replicas)
        params = fp8_placement.place(family, layout, mesh, axis_name, builders, grids)
    return layout.config.replace(quantization=scheme.spec), params


# ---- the way back: HF tensors in the layout they came from ---------------------------------------

def _source_grid(name: str, e: np.ndarray, scheme: Fp8Scheme) -> np.ndarray:
    """A source tensor's scale grid from its per-element scales e [N, K] (exact, or an error)."""
    n, k = e.shape
    bn, bk = {"channel": (1, k), "tensor": (n, k)}.get(scheme.strategy, scheme.block)
    grid = e[::bn, ::bk]
    back = np.repeat(np.repeat(grid, bn, axis=0)[:n], bk, axis=1)[:, :k]
    if not np.array_equal(back, e):
        raise Fp8CheckpointError(f"{name}: its scales are not one per {scheme.strategy} "
                                 f"{scheme.block if scheme.strategy == 'block' else ''}: cannot "
                                 f"write it as {scheme.spec}")
    return grid


def expand_scale(w: Fp8Weight) -> np.ndarray:
    """An Fp8Weight's (global) scales broadcast over its q [*out, *in], float32 on the host."""
    q_shape, n_out = w.q.shape, w.q.ndim - w.n_in
    last, k = q_shape[n_out - 1], math.prod(q_shape[n_out:])
    s = np.asarray(jax.device_get(w.scale), np.float32)
    s = np.repeat(np.repeat(s, w.block[0], axis=-2)[..., :last, :], w.block[1], axis=-1)[..., :k]
    return s.reshape(q_shape)


def _einsum_views(params: dict, family):
    """(q tree, per-element scale tree): each Fp8Weight as its e4m3 values, and as its scales
    broadcast over them, both in the einsum layout the family's writer takes."""
    def views(path, w):
        if not isinstance(w, Fp8Weight):
            return w, w
        inv = np.argsort(family.projections[leaf_name(path)].q_perm(w.q.ndim))
        return (np.transpose(np.asarray(jax.device_get(w.q)), inv),
                np.transpose(expand_scale(w), inv))

    both = jax.tree_util.tree_map_with_path(views, params, is_leaf=is_fp8)
    is_pair = lambda x: isinstance(x, tuple)  # noqa: E731
    return (jax.tree.map(lambda t: t[0], both, is_leaf=is_pair),
            jax.tree.map(lambda t: t[1], both, is_leaf=is_pair))


def fp8_to_hf(family, params: dict, config) -> tuple[dict, Optional[dict]]:
    """(HF tensors, quantization_config or None): Fp8Weight leaves written in the layout the
    config records (config.quantization; compressed-tensors per channel when None), each
    checked to be exactly representable so; the rest as the family writes it."""
    if not is_quantized(params):
        return family.to_hf_tensors(params, config), None
    scheme = scheme_from_spec(getattr(config, "quantization", None) or "compressed-tensors:channel")
    qs, es = _einsum_views(params, family)
    qt, st = family.to_hf_tensors(qs, config), family.to_hf_tensors(es, config)
    out, head_fp8 = {}, False
    for name, a in qt.items():
        if a.dtype != E4M3:
            out[name] = a
            continue
        module = name[: -len(".weight")]
        head_fp8 |= module == "lm_head"
        write_fp8_weight(out, module, a, _source_grid(name, st[name], scheme), scheme)
    ignore = [] if head_fp8 or config.tie_word_embeddings else ["lm_head"]
    if family.name == "qwen3_moe":
        ignore.append("re:.*mlp.gate$")  # the routers, as compressed-tensors checkpoints say
    return out, quantization_config(dataclasses.replace(scheme, ignore=tuple(ignore)))

