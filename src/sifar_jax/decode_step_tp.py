"""`llama_step` across devices: the decode step of a TP=R Llama model, one rank per device of a
mesh axis, inside `jax.shard_map` (`sifar_jax.llama_step(..., axis_name="tp")`).

Each device runs the persistent step (ffi/step/llama_step_tp.h) on its shard: its KV heads
(their qkv rows, their cache, their columns of o), its FFN rows (gate_up's gate and up rows,
down's columns) and, with a head, its share of the vocabulary (the head's rows: the logits come
back sharded). The all-reduce after o and after down is a phase of the step that reads the
peers' partials through the communicator `sifar_jax.init(mesh)` set up for the axis (the
same memory, epochs, lanes and failure records as `sifar_psum`): "sifar" (epoch-tagged words
in dual buffers, read speculatively, no barrier) or "oneshot" (barriers across the ranks
before and after the reads). The partials are rounded to bf16 and added in rank order in
float32, rounded once: every rank computes the same h, bit for bit the step of the same model
as virtual ranks (`llama_step_virtual_ranks`, ranks=R) computes it.

Failures are the communicator's: every wait is bounded by its timeout; a peer that never
arrives leaves NaN in h and every logit, and `sifar_jax.check()` raises SifarError naming the
rank, the missing peer and the phase; after `shutdown()` and `init(mesh)` the next step is
exact. The invariant that makes the words of consecutive launches safe without zeroing them:
docs/step_across_devices.md.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from . import _ext, _jax_compat, ordering
from . import decode_step as _ds
from .plan import Fallback, axis_size, route

__all__ = ["llama_step", "llama_step_tp", "tp_layout", "tp_in_specs", "tp_out_specs", "ALLREDUCE_PHASES"]

ALLREDUCE_PHASES = ("sifar", "oneshot")
_API = "llama_step"
_NAME = "sifar_jax.llama_step"


def tp_layout(layers: Sequence[_ds.LlamaLayer], ranks: int) -> list:
    """The TP=1 model's layers with gate_up (and a per-channel gate_up scale) re-laid rank-major:
    rank r's gate rows, then its up rows, for r = 0..R-1, so that sharding dim 0 over the axis
    hands each device its shard ([2F/R, H]: its gate rows, then its up rows). Every other
    operand is sharded as it is (tp_in_specs)."""
    out = []
    for layer in layers:
        f = layer.gate_up.shape[0] // 2
        if f % ranks:
            raise ValueError(f"{_NAME}: F={f} does not split over {ranks} ranks")

        def rank_major(a):
            return a.reshape(2, ranks, f // ranks, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)

        s = layer.gate_up_scale
        out.append(layer._replace(gate_up=rank_major(layer.gate_up),
                                  gate_up_scale=rank_major(s) if s.shape[0] > 1 else s))
    return out


def tp_in_specs(layers: Sequence[_ds.LlamaLayer], axis: str, head=None) -> tuple:
    """shard_map in_specs for (x, rope, pos, final_norm, layers, cache[, head]) over `axis`:
    x, rope, pos and the norms replicated; qkv's rows (its KV heads, with a per-channel scale),
    o's columns, gate_up's rows (tp_layout's order, with a per-channel scale), down's columns,
    o's and down's scales replicated (one per output row, the same on every rank); the cache's
    KV heads; the head's rows and a per-row scale."""
    def rows(s):
        return P(axis) if s.shape[0] > 1 else P()

    specs = [_ds.LlamaLayer(P(), P(axis), rows(layer.qkv_scale), P(None, axis), P(), P(),
                            P(axis), rows(layer.gate_up_scale), P(None, axis), P())
             for layer in layers]
    out = (P(), P(), P(), P(), specs, P(None, None, None, axis))
    if head is not None:
        out += ((P(axis), rows(head[1])),)
    return out


def tp_out_specs(axis: str, head: bool = False) -> tuple:
    """shard_map out_specs of llama_step's results over `axis`: h replicated (every rank's is
    the same), the cache's KV heads, the logits' vocabulary."""
    out = (P(), P(None, None, None, axis))
    return out + (P(axis),) if head else out


def _check_shard(layers, cache, kv_heads: int, group: int, n: int, axis_name: str):
    """This rank's shapes against a shard of the model over the n devices of the axis."""
    where = f"{_NAME}(axis_name={axis_name!r})"
    if kv_heads < 1 or kv_heads % n:
        raise ValueError(f"{where}: kv_heads={kv_heads} (the model's) do not split over the {n} "
                         f"devices of {axis_name!r}")
    kv = kv_heads // n
    hint = (f"inside shard_map each device passes its shard (sifar_jax.decode_step_tp."
            f"tp_layout and tp_in_specs give the layout and the in_specs)")
    for i, layer in enumerate(layers):
        rows = kv * (group + 2) * _ds.HEAD_DIM
        if layer.qkv.ndim != 2 or layer.qkv.shape[0] != rows:
            raise ValueError(f"{where}: layer {i} qkv is {list(layer.qkv.shape)} here; a shard "
                             f"of kv_heads={kv_heads} over {n} devices has {kv} KV heads, "
                             f"{rows} rows ({kv} x (group {group} + 2) x {_ds.HEAD_DIM}): "
                             f"{hint}")
        if layer.o.ndim != 2 or layer.o.shape[1] != kv * group * _ds.HEAD_DIM:
            raise ValueError(f"{where}: layer {i} o is {list(layer.o.shape)} here; a shard has "
                             f"{kv * group * _ds.HEAD_DIM} columns (its {kv} KV heads' query "
                             f"heads): {hint}")
        f2 = layer.gate_up.shape[0] if layer.gate_up.ndim == 2 else -1
        if layer.down.ndim != 2 or f2 != 2 * layer.down.shape[1]:
            raise ValueError(f"{where}: layer {i} gate_up {list(layer.gate_up.shape)} and down "
                             f"{list(layer.down.shape)} are not one shard of the FFN (gate_up "
                             f"[2F/{n}, H]: its gate rows then its up rows; down [H, F/{n}]): "
                             f"{hint}")
        if (f2 // 2) % 16:
            raise ValueError(f"{where}: layer {i}: the FFN shard F/{n}={f2 // 2} must be a "
                             f"multiple of 16")
    if cache.ndim != 6 or cache.shape[3] != kv:
        raise ValueError(f"{where}: the cache is {list(cache.shape)} here; a shard holds its {kv} "
                         f"KV heads ([layers, 2, 1, {kv}, S, {_ds.HEAD_DIM}]): {hint}")
    return kv


def llama_step(x: jax.Array, rope: jax.Array, pos: jax.Array, final_norm: jax.Array,
               layers: Sequence[_ds.LlamaLayer], cache: jax.Array, *, kv_heads: int, group: int,
               eps: float, head: Optional[tuple[jax.Array, jax.Array]] = None,
               axis_name: Optional[str] = None, allreduce: str = "sifar") -> tuple:
    """sifar_jax.llama_step: the step on one device (decode_step.llama_step: its operands and
    results), or with axis_name (inside jax.shard_map, after sifar_jax.init(mesh)) the step of a
    TP model over that mesh axis, one rank per device, each passing its shard, the all-reduce
    after o and down ("sifar" or "oneshot": `allreduce`) a phase of the step reading the peers'
    memory (llama_step_tp: the shards, the results' sharding, failures)."""
    if axis_name is None:
        return _ds.llama_step(x, rope, pos, final_norm, layers, cache, kv_heads=kv_heads,
                              group=group, eps=eps, head=head)
    return llama_step_tp(x, rope, pos, final_norm, layers, cache, kv_heads=kv_heads, group=group,
                         eps=eps, axis_name=axis_name, allreduce=allreduce, head=head)


def llama_step_tp(x: jax.Array, rope: jax.Array, pos: jax.Array, final_norm: jax.Array,
                  layers: Sequence[_ds.LlamaLayer], cache: jax.Array, *, kv_heads: int,
                  group: int, eps: float, axis_name: str, allreduce: str = "sifar",
                  head: Optional[tuple[jax.Array, jax.Array]] = None) -> tuple:
    """One decode step of a TP model over the mesh axis `axis_name`, inside jax.shard_map after
    sifar_jax.init(mesh): returns (h, new cache), with `head` (h, new cache, logits).

    The operands are this device's shard (tp_layout, tp_in_specs): x, rope, pos, final_norm and
    the norm scales replicated; per layer qkv [kv/R * (group + 2) * 128, H] (its KV heads' rows,
    per-channel scales likewise), o [H, kv/R * group * 128] (their columns), gate_up [2F/R, H]
    (its gate rows, then its up rows), down [H, F/R]; o's and down's scales replicated; the
    cache [layers, 2, 1, kv/R, S, 128]; the head [V/R, H] (its rows of the vocabulary). kv_heads
    is the model's (all ranks'). h [H] is the same on every rank (out_specs P()); the cache and
    the logits [V/R] are the rank's (tp_out_specs). allreduce: "sifar" or "oneshot"."""
    h, new_cache, logits, _ = _step_tp(x, rope, pos, final_norm, layers, cache,
                                       kv_heads=kv_heads, group=group, eps=eps,
                                       axis_name=axis_name, allreduce=allreduce, head=head)
    return (h, new_cache) if head is None else (h, new_cache, logits)


def _step_tp(x, rope, pos, final_norm, layers, cache, *, kv_heads, group, eps, axis_name,
             allreduce, head):
    """llama_step_tp, with the rank's status words (uint32 [8]: StepStatus.from_words) too."""
    if allreduce not in ALLREDUCE_PHASES:
        raise ValueError(f"{_NAME}: allreduce must be one of {ALLREDUCE_PHASES} across devices, "
                         f"got {allreduce!r}")
    if not isinstance(axis_name, str):
        raise TypeError(f"{_NAME}: axis_name must name one mesh axis (a str), got "
                        f"{axis_name!r}")
    n = axis_size(axis_name, _API)  # an unbound name: UnboundAxisError
    if axis_name not in _jax_compat.manual_axes():
        raise ValueError(f"{_NAME}: axis {axis_name!r} is not a mesh axis of an enclosing "
                         f"jax.shard_map (a vmap axis has no devices to run the ranks on)")
    if n > _ds.MAX_RANKS:
        raise ValueError(f"{_NAME}: axis {axis_name!r} has {n} devices; the step runs on 1.."
                         f"{_ds.MAX_RANKS}")
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError(f"{_NAME}: layers must be a non-empty sequence of LlamaLayer")
    if n == 1:  # nothing to reduce: the step of this device
        h, new_cache, logits, status = _ds._step(x, rope, pos, final_norm, layers, cache,
                                                 kv_heads=kv_heads, group=group, eps=eps,
                                                 head=head)
        return h, new_cache, logits, status
    kv = _check_shard(layers, cache, kv_heads, group, n, axis_name)
    ffn, wdt = _ds._check(x, rope, pos, final_norm, layers, cache, kv, group)
    vocab = _ds._check_head(head, x.shape[0], wdt) if head is not None else 0
    plan, rest = route((axis_name,), allreduce, _API)  # not initialised: NotInitializedError
    if isinstance(plan, Fallback) or rest:  # a named algorithm raises instead; not expected
        raise ValueError(f"{_NAME}: axis {axis_name!r} cannot run the step across devices")
    hidden = x.shape[0]
    need = int(_ext.lib.llama_step_tp_slot_bytes(hidden))
    if plan.slot < need:
        raise ValueError(f"{_NAME}(axis_name={axis_name!r}): the step's tagged words of H="
                         f"{hidden} rows need a slot of {need} bytes, the communicator has "
                         f"{plan.slot}: sifar_jax.init(mesh, slot_bytes={need}) or more")
    ws = int(_ext.lib.llama_step_tp_workspace_bytes(hidden, kv, group, ffn, len(layers), n))
    operands = [x, rope, pos, final_norm]
    for layer in layers:
        operands.extend(layer)
    operands.append(cache)
    cache_at = len(operands) - 1
    if head is not None:
        operands.extend(head)
    after = ordering.operands(x)
    chain = ordering.chain_id(x, plan.scope)
    operands = _jax_compat.same_varying(*operands, *after)
    vma = _jax_compat.varying_axes(jax.typeof(operands[0]))
    like = jax.typeof(operands[0])

    def typed(shape, dtype, axes):
        return _jax_compat.with_varying(like.update(shape=tuple(shape), dtype=jnp.dtype(dtype)),
                                        axes)

    results = (typed(x.shape, x.dtype, vma - {axis_name}),  # h: the same on every rank
               typed(cache.shape, cache.dtype, vma),
               typed((ws,), jnp.uint8, vma),
               typed((vocab,), jnp.float32, vma))
    call = jax.ffi.ffi_call(_ext.TARGETS.llama_step_tp, results,
                            input_output_aliases={cache_at: 1},
                            has_side_effect=plan.platform == "cpu")
    attrs = dataclasses.replace(plan, chain=chain).attrs()
    h, new_cache, work, logits = call(
        *operands, layers=np.int64(len(layers)), kv_heads=np.int64(kv), group=np.int64(group),
        eps=np.float32(eps), after=np.int64(len(after)), **attrs)
    ordering.remember(x, h)
    status = jax.lax.bitcast_convert_type(
        work[:4 * _ds.STATUS_WORDS].reshape(_ds.STATUS_WORDS, 4), jnp.uint32)
    return h, new_cache, logits, status
