"""The persistent decode step (DecodeOptions(step="persistent"), or "auto" on a GPU), LLAMA's
fast_step: a Llama model's batch-1 step of one token as ONE op, sifar_jax.llama_step (on CUDA
GPUs one cooperative launch of a persistent kernel, no kernel boundary between the layers), with
an untied LM head of the layers' weight type inside it (a tied head, or one of another type,
runs in XLA on the op's output, split over the vocabulary as the XLA decoder splits it).

It serves what its kernel serves: the Llama family, TP = 1 to the op's MAX_RANKS ranks, batch
1, the "bhsd" cache in bf16, head_dim 128, 1-4 or 8 query heads per KV head (per KV head of a
rank's shard: with tp > num_kv_heads, the replicated layout's), and projections that are all FP8
(Fp8Weight, per-channel or per-tensor scales) or all bf16 rows (RowWeight: models.to_rows; a
dense model's [K, N] einsum weights are the XLA step's layout, and the op reads [N, K] rows, so
the decoder does not hold both: both steps read the rows). On CUDA GPUs it runs the kernel; on
CPU host devices the op's C++ reference, only where it is asked for by name (`reference`: CI,
a user without a GPU); anything else runs the XLA step under "auto" and is a ValueError under
"persistent"; `reason` says why (decoder/step_choice.py decides). Prefills and chunks of
several tokens always run the XLA forward. The two steps write the same cache: a decoder may
switch between them at any token.

At TP >= 2 the step runs inside jax.shard_map over the decoder's mesh, one rank per device,
each on its shard of the decoder's own parameters and cache as they are placed
(sifar_jax.decode_step_tp's layout is the decoder's: qkv's rows of the rank's KV heads, o's
columns of their query heads, gate_up's [2, F/R, H] shard = its gate rows then its up rows,
down's columns, the head's vocabulary rows; no re-layout), the all-reduce after o and down a
phase of the op (options.step_allreduce: "sifar" or "oneshot") through sifar_jax's
communicator on the mesh, which `reason` sets up (sifar_jax.init, idempotent) whatever
options.allreduce is.

PERSISTENT is this step as a FastStep (family.py): reason, make_forward (make_step_forward),
describe and prepare_params (rows_for_step).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jax.sharding import PartitionSpec as P

from ..core import sharding
from ..core.attention import rope_inv_freq
from ..core.step_operands import (head_operands, operands, step_operands, unstreamable,
                                  xla_head)
from ..weights.transforms import to_rows
from ..weights.types import Fp8Weight, RowWeight

KERNEL_GROUPS = (1, 2, 3, 4, 8)  # query heads per KV head the kernel is built for
_PROJECTIONS = (("attn", "qkv"), ("attn", "o"), ("mlp", "gate_up"), ("mlp", "down"))


def backend_reason(mesh: Mesh, reference: bool = False) -> Optional[str]:
    """None on a CUDA GPU with sifar_jax's CUDA backend, or on CPU host devices where the op's
    C++ reference may run (`reference`), else why not."""
    import sifar_jax

    platform = mesh.devices.flat[0].platform
    if platform == "cpu" and reference:
        return None
    if platform != "gpu":
        return (f"the persistent step is a CUDA kernel; this mesh is on {platform!r} (the op's "
                f"CPU reference runs there only when asked for by name, step='persistent')"
                if platform == "cpu" else
                f"the persistent step is a CUDA kernel; this mesh is on {platform!r}")
    if "cuda" not in sifar_jax._ext.PLATFORMS:
        return "sifar_jax was built without its CUDA backend"
    return None


def reason(family, layout, mesh: Mesh, options, params: Any, *,
           reference: bool = False) -> Optional[str]:
    """None when the persistent step can run this decoder of a Llama model (options: resolved;
    reference: the op's CPU reference counts, on CPU host devices), else why not (one
    sentence). At TP >= 2 it sets up sifar_jax's communicator on the mesh (sifar_jax.init,
    idempotent), which the step's all-reduce phase reads the peers through."""
    import sifar_jax

    c, s, tp = layout.config, layout.shapes, layout.tp
    why = backend_reason(mesh, reference)
    if why:
        return why
    if tp > sifar_jax.decode_step.MAX_RANKS:
        return (f"tp={tp}: the persistent step runs on at most "
                f"{sifar_jax.decode_step.MAX_RANKS} ranks")
    why = options_reason(c, options, s.group_size)
    if why is not None:
        if layout.kv_replicas > 1 and s.group_size not in KERNEL_GROUPS:
            why = why.replace(" per KV head:", f" per KV head (tp={tp} > num_kv_heads="
                              f"{c.num_kv_heads}: each rank holds a copy of one KV head with "
                              f"{s.group_size} of its query heads):")
        return why
    if c.hidden_size % 16 or (c.intermediate_size // tp) % 16:
        return (f"hidden_size={c.hidden_size} and intermediate_size/tp="
                f"{c.intermediate_size // tp} must be multiples of 16 (the FP8 GEMV's unit)")
    why = _params_reason(c, params)
    if why is None and tp > 1:
        why = _communicator_reason(mesh, options, c.hidden_size)
    return why


def options_reason(c, options, group: int) -> Optional[str]:
    """Why the persistent steps' kernels (sifar_jax.llama_step, qwen3_moe_step) cannot take a
    model of config c with `group` query heads per KV head (a rank's) under `options`, or None:
    batch 1, the bf16 'bhsd' cache, head_dim 128, the kernels' groups and layers."""
    import sifar_jax

    if options.batch_size != 1:
        return f"batch_size={options.batch_size}: the persistent step decodes one sequence"
    if options.kv_layout != "bhsd":
        return f"kv_layout={options.kv_layout!r}: the persistent step reads the 'bhsd' cache"
    if jnp.dtype(c.dtype) != jnp.bfloat16:
        return f"dtype={c.dtype}: the persistent step's activations and cache are bfloat16"
    if c.head_dim != sifar_jax.decode_step.HEAD_DIM:
        return f"head_dim={c.head_dim}: the kernel is built for {sifar_jax.decode_step.HEAD_DIM}"
    if group not in KERNEL_GROUPS:
        return f"{group} query heads per KV head: the kernel is built for {KERNEL_GROUPS}"
    if c.num_layers > sifar_jax.decode_step.MAX_LAYERS:
        return f"{c.num_layers} layers: the kernel takes at most {sifar_jax.decode_step.MAX_LAYERS}"
    return None


def _params_reason(c, params: Any) -> Optional[str]:
    """Why the kernel cannot stream the projections of `params`, or None."""
    layers = params.get("layers", {})
    kinds = set()
    for i in range(c.num_layers):
        for group, name in _PROJECTIONS:
            w = layers[i][group][name]
            if not isinstance(w, (RowWeight, Fp8Weight)):
                return (f"layer {i} {group}.{name} is {jnp.dtype(w.dtype).name} [K, N], the "
                        f"einsum layout; the persistent step streams [N, K] rows: hold the "
                        f"projections as rows (models.to_rows(params, config, donate=True): "
                        f"both steps read them) or as FP8 (load with quantize='fp8')")
            why = unstreamable(w, f"layer {i} {group}.{name}")
            if why:
                return why
            kinds.add(type(w))
    if len(kinds) > 1:
        return ("the projections mix FP8 and bf16 rows: the persistent step streams one weight "
                "type")
    return None


def _communicator_reason(mesh: Mesh, options, hidden: int) -> Optional[str]:
    """sifar_jax's communicator on the mesh's axis set up (sifar_jax.init, idempotent; the
    options' slot_bytes, else the library's default or the slot already set up), or why the
    step's all-reduce phase cannot have one."""
    import sifar_jax

    axis = options.axis_name
    need = int(sifar_jax._ext.lib.llama_step_tp_slot_bytes(hidden))
    if options.slot_bytes is not None and options.slot_bytes < need:
        return (f"slot_bytes={options.slot_bytes}: the persistent step's all-reduce phase at "
                f"hidden_size={hidden} needs a slot of {need} bytes")
    sifar_jax.init(mesh, slot_bytes=options.slot_bytes)
    comms = sifar_jax.communicators(axis)
    if not comms:
        why = "; ".join(u.reason for u in sifar_jax.unsupported(axis)) or "none was set up"
        return (f"sifar_jax has no communicator on the {axis!r} axis ({why}): the persistent "
                f"step's all-reduce phase reads the peers through it")
    slot = min(comm.slot_bytes for comm in comms)
    if slot < need:
        return (f"sifar_jax's communicator on the {axis!r} axis has a slot of {slot} bytes; the "
                f"persistent step's all-reduce phase at hidden_size={hidden} needs {need} "
                f"(DecodeOptions(slot_bytes={need}) or more)")
    return None


def _layer_operands(block) -> "sifar_jax.LlamaLayer":
    import sifar_jax

    qkv, qkv_s = operands(block.attn.qkv[...])
    o, o_s = operands(block.attn.o[...])
    gu, gu_s = operands(block.mlp.gate_up[...])
    dn, dn_s = operands(block.mlp.down[...])
    return sifar_jax.LlamaLayer(block.input_norm.weight[...], qkv, qkv_s, o, o_s,
                                block.post_norm.weight[...], gu, gu_s, dn, dn_s)


def make_step_forward(family, layout, options, virtual_ranks: int = 1, allreduce: str = "sifar",
                      *, mesh: Optional[Mesh] = None):
    """forward(params, cache, tokens [1, 1], positions [1], ar, start=None) -> (logits [1, 1,
    vocab] float32, cache, ar), the XLA forward's contract for one token, as the persistent
    step (check `reason` first). At layout.tp >= 2 (`mesh`: the decoder's) the step across the
    mesh's devices, options.step_allreduce inside (_tp_forward). virtual_ranks > 1 (tests,
    benchmarks; tp = 1): the step of a TP model of that many ranks, run as sets of blocks of
    the one launch with `allreduce` ("sifar" or "oneshot") inside it
    (sifar_jax.llama_step_virtual_ranks)."""
    import sifar_jax

    if layout.tp > 1:
        if mesh is None or virtual_ranks > 1:
            raise ValueError(f"the persistent step at tp={layout.tp} runs across the decoder's "
                             f"mesh (mesh=), without virtual ranks")
        return _tp_forward(family, layout, mesh, options)
    c = layout.config
    graphdef, _ = family.abstract_model(layout.shapes)
    inv_freq = rope_inv_freq(c)

    def forward(params, cache, tokens, positions, ar, start=None):
        model = nnx.merge(graphdef, params)
        head = head_operands(model, c)
        args = (*step_operands(model, c, tokens, positions, start, inv_freq),
                [_layer_operands(b) for b in model.layers], cache)
        kw = dict(kv_heads=c.num_kv_heads, group=c.group_size, eps=c.rms_norm_eps, head=head)
        if virtual_ranks > 1:
            h, cache, logits, _ = sifar_jax.llama_step_virtual_ranks(
                *args, ranks=virtual_ranks, allreduce=allreduce, **kw)
        else:
            h, cache, *logits = sifar_jax.llama_step(*args, **kw)
            logits = logits[0] if logits else None
        if head is not None:  # the kernel streamed the head too
            return logits[None, None], cache, ar
        return xla_head(model, c, h, options.gemm_rows), cache, ar

    return forward


def _tp_forward(family, layout, mesh: Mesh, options):
    """The persistent step of a tp >= 2 layout: sifar_jax.llama_step(axis_name=) inside
    jax.shard_map over `mesh`, each rank on its shard of the decoder's params and cache as
    placed (param_specs, cache_spec: the op's per-rank layout, see the module docstring); kv_heads
    and group are the layout's (with tp > num_kv_heads, its replicated KV heads). h comes back
    the same on every rank; the logits [1, 1, vocab] split over the vocabulary, as the XLA
    forward's."""
    import sifar_jax

    c, s, axis, tp = layout.config, layout.shapes, options.axis_name, layout.tp
    graphdef, _ = family.abstract_model(s)
    inv_freq = rope_inv_freq(c)
    cspec = sharding.cache_spec(axis, options.kv_layout)
    kw = dict(kv_heads=s.num_kv_heads, group=s.group_size, eps=c.rms_norm_eps,
              axis_name=axis, allreduce=options.step_allreduce)

    def forward(params, cache, tokens, positions, ar, start=None):
        pspecs = family.param_specs(params, axis, tp)

        def per_rank(params, cache, tokens, positions, start):
            model = nnx.merge(graphdef, sharding.local_fp8(params, pspecs, axis))
            head = head_operands(model, c)
            out = sifar_jax.llama_step(
                *step_operands(model, c, tokens, positions, start, inv_freq),
                [_layer_operands(b) for b in model.layers], cache, head=head, **kw)
            if head is not None:  # the kernel streamed the rank's vocabulary rows
                return out[2][None, None], out[1]
            return xla_head(model, c, out[0], options.gemm_rows,
                             jax.lax.axis_index(axis), tp), out[1]

        step = jax.shard_map(per_rank, mesh=mesh, in_specs=(pspecs, cspec, P(), P(), P()),
                             out_specs=(P(None, None, axis), cspec))
        logits, cache = step(params, cache, tokens, positions,
                             jnp.zeros((1,), jnp.int32) if start is None else start)
        return logits, cache, ar

    return forward


def rows_for_step(family, config, mesh: Mesh, options, params: Any, why=None) -> Any:
    """params as the persistent step wants them: where the step would run on the projections
    as rows but not as they are (dense bf16 [K, N]), the projections moved to rows in place
    (weights.transforms.to_rows, donate=True: the einsum-layout weights are deleted); else
    params as they are. "Would run": options.step "persistent" (the CPU reference counting),
    or "auto" on a GPU. why: the step's `reason` (None: this module's; the Qwen3-MoE step
    passes its own). For callers that own the params (the CLI, through
    decoder/step_choice.params_for_step); a Decoder never changes the params it is given."""
    why = why or reason
    layout = family.layout(config, mesh.shape[options.axis_name])
    opts = options.resolve(mesh)
    ref = options.step == "persistent"
    if why(family, layout, mesh, opts, params, reference=ref) is None:
        return params
    try:
        rows = jax.eval_shape(lambda p: to_rows(p, family), params)
    except ValueError:  # FP8 weights: not for rows
        return params
    if why(family, layout, mesh, opts, rows, reference=ref) is not None:
        return params
    return to_rows(params, family, axis_name=options.axis_name, donate=True)


def describe(layout, mesh: Mesh, options) -> str:
    """How the step runs on `mesh`: the kernel or the CPU reference, and at tp >= 2 the ranks
    and the all-reduce inside."""
    platform = mesh.devices.flat[0].platform
    where = ("CUDA kernel" if platform == "gpu" else
             f"sifar_jax.llama_step's {platform.upper()} reference on host devices, slow")
    if layout.tp > 1:
        where += (f", TP={layout.tp} one rank per device, {options.step_allreduce} all-reduce "
                  f"inside")
    return where


class PersistentStep:
    """The persistent step as a FastStep (family.py): LLAMA's fast_step. Each method calls this
    module's function at call time (a test that replaces backend_reason or make_step_forward
    changes the step a decoder runs)."""

    name = "persistent"  # the DecodeOptions.step that asks for it

    def reason(self, family, layout, mesh: Mesh, options, params: Any, *,
               reference: bool = False) -> Optional[str]:
        return reason(family, layout, mesh, options, params, reference=reference)

    def make_forward(self, family, layout, options, **kw):
        return make_step_forward(family, layout, options, **kw)

    def describe(self, layout, mesh: Mesh, options) -> str:
        return describe(layout, mesh, options)

    def prepare_params(self, family, config, mesh: Mesh, options, params: Any) -> Any:
        return rows_for_step(family, config, mesh, options, params)


PERSISTENT = PersistentStep()
