"""The persistent decode step (DecodeOptions(step="persistent")), LLAMA's fast_step: a Llama
model's batch-1 step of one token as ONE op, sifar_jax.llama_step (on CUDA GPUs one
cooperative launch of a persistent kernel, no kernel boundary between the layers), with an
untied LM head of the layers' weight type inside it (a tied head, or one of another type, runs
in XLA on the op's output).

It serves what its kernel serves: the Llama family, TP=1 (the all-reduce phase of a TP model
runs only between virtual ranks on one GPU: make_step_forward's virtual_ranks), batch 1, the
"bhsd" cache in bf16, head_dim 128, 1-4 or 8 query heads per KV head, and projections that are
all FP8 (Fp8Weight, per-channel or per-tensor scales) or all bf16 rows (RowWeight:
models.to_rows; a dense model's [K, N] einsum weights are the XLA step's layout, and the op
reads [N, K] rows, so the decoder does not hold both: both steps read the rows). Anything else
(and any GPU-less platform, where the op's CPU handler is a reference, not a speed-up) runs the
XLA step; `reason` says why (decoder/step_choice.py decides which step runs, and logs the reason
once). Prefills and chunks of several tokens always run the XLA forward. The two steps write the
same cache: a decoder may switch between them at any token.

PERSISTENT is this step as a FastStep (family.py): reason, make_forward (make_step_forward) and
prepare_params (rows_for_step).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from ..core.attention import rope_cos_sin, rope_inv_freq
from ..core.tp import project
from ..weights.transforms import to_rows
from ..weights.types import Fp8Weight, RowWeight

KERNEL_GROUPS = (1, 2, 3, 4, 8)  # query heads per KV head the kernel is built for
_PROJECTIONS = (("attn", "qkv"), ("attn", "o"), ("mlp", "gate_up"), ("mlp", "down"))


def backend_reason(mesh: Mesh) -> Optional[str]:
    """None on a CUDA GPU with sifar_jax's CUDA backend, else why not. (Tests replace it to run
    the step through the op's CPU reference.)"""
    import sifar_jax

    platform = mesh.devices.flat[0].platform
    if platform != "gpu":
        return f"the persistent step is a CUDA kernel; this mesh is on {platform!r}"
    if "cuda" not in sifar_jax._ext.PLATFORMS:
        return "sifar_jax was built without its CUDA backend"
    return None


def reason(family, layout, mesh: Mesh, options, params: Any) -> Optional[str]:
    """None when the persistent step can run this decoder of a Llama model (options: resolved),
    else why not (one sentence)."""
    import sifar_jax

    c = layout.config
    why = backend_reason(mesh)
    if why:
        return why
    if layout.tp != 1:
        return (f"tp={layout.tp}: the persistent step's all-reduce phase runs between virtual "
                f"ranks on one GPU (sifar_jax.llama_step_virtual_ranks); ranks on separate GPUs "
                f"are not built, so it runs at tp=1")
    if options.batch_size != 1:
        return f"batch_size={options.batch_size}: the persistent step decodes one sequence"
    if options.kv_layout != "bhsd":
        return f"kv_layout={options.kv_layout!r}: the persistent step reads the 'bhsd' cache"
    if jnp.dtype(c.dtype) != jnp.bfloat16:
        return f"dtype={c.dtype}: the persistent step's activations and cache are bfloat16"
    if c.head_dim != sifar_jax.decode_step.HEAD_DIM:
        return f"head_dim={c.head_dim}: the kernel is built for {sifar_jax.decode_step.HEAD_DIM}"
    if c.group_size not in KERNEL_GROUPS:
        return f"{c.group_size} query heads per KV head: the kernel is built for {KERNEL_GROUPS}"
    if c.num_layers > sifar_jax.decode_step.MAX_LAYERS:
        return f"{c.num_layers} layers: the kernel takes at most {sifar_jax.decode_step.MAX_LAYERS}"
    if c.hidden_size % 16 or c.intermediate_size % 16:
        return "hidden_size and intermediate_size must be multiples of 16 (the FP8 GEMV's unit)"
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
            if not _streamable(w):
                return (f"layer {i} {group}.{name} is {jnp.dtype(w.dtype).name} rows: the "
                        f"persistent step streams bf16 or FP8 weights"
                        if isinstance(w, RowWeight) else
                        f"layer {i} {group}.{name} has block scales {w.block}: the persistent "
                        f"step takes per-channel or per-tensor scales")
            kinds.add(type(w))
    if len(kinds) > 1:
        return ("the projections mix FP8 and bf16 rows: the persistent step streams one weight "
                "type")
    return None


def _streamable(w) -> bool:
    """Whether the kernel streams projection w: bf16 rows, or FP8 whose scales are per output
    row or per tensor (its two kinds of scale)."""
    if isinstance(w, RowWeight):
        return jnp.dtype(w.dtype) == jnp.bfloat16
    return isinstance(w, Fp8Weight) and (
        w.scale.size == 1 or (w.block[0] == 1 and w.scale.shape[-1] == 1))


def _operands(w):
    """(weight [N, K], float32 scale [N] or [1]): a projection as the op takes it (an
    Fp8Weight's e4m3 values and scales; a RowWeight's bf16 rows and a scale of one)."""
    if isinstance(w, RowWeight):
        return w.rows(), jnp.ones((1,), jnp.float32)
    q2, s2, _ = w.kernel_operands()
    return q2, s2.reshape(-1).astype(jnp.float32)


def _layer_operands(block) -> "sifar_jax.LlamaLayer":
    import sifar_jax

    qkv, qkv_s = _operands(block.attn.qkv[...])
    o, o_s = _operands(block.attn.o[...])
    gu, gu_s = _operands(block.mlp.gate_up[...])
    dn, dn_s = _operands(block.mlp.down[...])
    return sifar_jax.LlamaLayer(block.input_norm.weight[...], qkv, qkv_s, o, o_s,
                                block.post_norm.weight[...], gu, gu_s, dn, dn_s)


def _head_operands(model, c):
    """The op's head operands when the LM head is untied and of the layers' weight type (FP8
    with per-row or per-tensor scales, or bf16 rows): the kernel streams it; else None (the
    head runs in XLA on the op's h)."""
    w = None if c.tie_word_embeddings else model.lm_head[...]
    kind = type(model.layers[0].attn.qkv[...])
    if isinstance(w, kind) and _streamable(w):
        return _operands(w)
    return None


def make_step_forward(family, layout, options, virtual_ranks: int = 1, allreduce: str = "sifar"):
    """forward(params, cache, tokens [1, 1], positions [1], ar, start=None) -> (logits [1, 1,
    vocab] float32, cache, ar), the XLA forward's contract for one token, as the persistent
    step (check `reason` first). virtual_ranks > 1 (tests, benchmarks): the step of a TP model
    of that many ranks, run as sets of blocks of the one launch with `allreduce` ("sifar" or
    "oneshot") inside it (sifar_jax.llama_step_virtual_ranks)."""
    import sifar_jax

    c = layout.config
    graphdef, _ = family.abstract_model(layout.shapes)
    inv_freq = rope_inv_freq(c)

    def forward(params, cache, tokens, positions, ar, start=None):
        model = nnx.merge(graphdef, params)
        pos = positions[0].astype(jnp.int32)
        first = jnp.int32(0) if start is None else start[0].astype(jnp.int32)
        cos, sin = rope_cos_sin((pos - first)[None], inv_freq)
        x = jnp.take(model.embed[...], tokens[0, 0], axis=0)
        head = _head_operands(model, c)
        args = (x, jnp.concatenate([cos, sin]), jnp.stack([pos, first]), model.norm.weight[...],
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
        h = h[None, None]
        if c.tie_word_embeddings:
            logits = project("bth,vh->btv", h, model.embed[...], options.gemm_rows,
                             preferred_element_type=jnp.float32)
        else:
            logits = project("bth,hv->btv", h, model.lm_head[...], options.gemm_rows,
                             preferred_element_type=jnp.float32)
        return logits, cache, ar

    return forward


def rows_for_step(family, config, mesh: Mesh, options, params: Any) -> Any:
    """params as the persistent step wants them: where the step would run on the projections
    as rows but not as they are (dense bf16 [K, N]), the projections moved to rows in place
    (weights.transforms.to_rows, donate=True: the einsum-layout weights are deleted); else
    params as they are. For callers that own the params (the CLI, through
    decoder/step_choice.params_for_step, where options.step asks for this step); a Decoder
    never changes the params it is given."""
    layout = family.layout(config, mesh.shape[options.axis_name])
    opts = options.resolve(mesh)
    if reason(family, layout, mesh, opts, params) is None:
        return params
    try:
        rows = jax.eval_shape(lambda p: to_rows(p, family), params)
    except ValueError:  # FP8 weights, an MoE's stacks: not for rows
        return params
    if reason(family, layout, mesh, opts, rows) is not None:
        return params
    return to_rows(params, family, axis_name=options.axis_name, donate=True)


class PersistentStep:
    """The persistent step as a FastStep (family.py): LLAMA's fast_step. Each method calls this
    module's function at call time (a test that replaces backend_reason or make_step_forward
    changes the step a decoder runs)."""

    name = "persistent"  # the DecodeOptions.step that asks for it

    def reason(self, family, layout, mesh: Mesh, options, params: Any) -> Optional[str]:
        return reason(family, layout, mesh, options, params)  # the module's reason()

    def make_forward(self, family, layout, options, **kw):
        return make_step_forward(family, layout, options, **kw)

    def prepare_params(self, family, config, mesh: Mesh, options, params: Any) -> Any:
        return rows_for_step(family, config, mesh, options, params)


PERSISTENT = PersistentStep()
