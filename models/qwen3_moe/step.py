"""The persistent decode step of the Qwen3-MoE family (DecodeOptions(step="persistent"), or
"auto" on a GPU), QWEN3_MOE's fast_step: a batch-1 step of one token as ONE op,
sifar_jax.qwen3_moe_step (on CUDA GPUs one cooperative launch of a persistent kernel that
routes each token and streams only the chosen experts' rows; on CPU host devices the op's C++
reference, only where it is asked for by name), with an untied LM head of the layers' weight
type inside it (any other head runs in XLA on the op's output).

It serves what its kernel serves: TP = 1 (the op's ranks are virtual ranks on one device),
batch 1, the "bhsd" cache in bf16, head_dim 128, 1-4 or 8 query heads per KV head, at most the op's MAX_EXPERTS experts
and MAX_TOP_K per token, and projections (attention, experts, head) that are all FP8 with
per-channel or per-tensor scales (Fp8Weight: load or make them with quantize="fp8") or all bf16
rows (RowWeight: models.to_rows, the expert stacks as [E, 2, I, H] and [E, H, I], the op's
gate_up [E, 2I, H] and down [E, H, I] as they lie; the XLA step and prefill read the same
rows). A bf16 model's dense projections are in the einsum layout: on CPU host devices (the
reference) each step transposes them to rows (slow, for tests and small models); on a GPU
`reason` refuses them (the kernel would copy every expert each step). prepare_params
(llama.rows_for_step) moves them to rows wherever the step would then run, for callers that
own the params (the CLI). The router is the model's dense [H, E], transposed to the op's
[E, H] rows in each step (E x H values a layer). decoder/step_choice.py decides where it runs;
prefills always run the XLA forward; both steps write the same cache.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from ..core.attention import rope_inv_freq
from ..core.step_operands import (head_operands, operands, step_operands, unstreamable,
                                  xla_head)
from ..llama import step as llama
from ..weights.types import Fp8Weight, RowWeight

_PROJECTIONS = (("attn", "qkv"), ("attn", "o"), ("moe", "gate_up"), ("moe", "down"))


def reason(family, layout, mesh: Mesh, options, params: Any, *,
           reference: bool = False, dense: bool = True) -> Optional[str]:
    """None when the persistent step can run this decoder of a Qwen3-MoE model (options:
    resolved; reference: the op's CPU reference counts, on CPU host devices), else why not.
    dense=False: dense bf16 projections do not count even there (prepare_params: rows then)."""
    from sifar_jax import moe_step

    c, s, tp = layout.config, layout.shapes, layout.tp
    why = llama.backend_reason(mesh, reference)
    if why:
        return why
    if tp != 1:
        return f"tp={tp}: the Qwen3-MoE persistent step runs at TP = 1 only"
    why = llama.options_reason(c, options, s.group_size)
    if why:
        return why
    if c.num_experts > moe_step.MAX_EXPERTS or c.num_experts_per_tok > moe_step.MAX_TOP_K:
        return (f"{c.num_experts} experts, {c.num_experts_per_tok} a token: the kernel takes at "
                f"most {moe_step.MAX_EXPERTS} and {moe_step.MAX_TOP_K}")
    if c.hidden_size % 16 or c.moe_intermediate_size % 16:
        return (f"hidden_size={c.hidden_size} and moe_intermediate_size="
                f"{c.moe_intermediate_size} must be multiples of 16 (the GEMV's unit)")
    return _params_reason(c, params,
                          dense and mesh.devices.flat[0].platform == "cpu" and reference)


def _params_reason(c, params: Any, dense_ok: bool) -> Optional[str]:
    """Why the op cannot take the projections of `params`, or None. dense_ok: dense bf16
    einsum-layout weights count (transposed in each step: the CPU reference only)."""
    layers = params.get("layers", {})
    kinds = set()
    for i in range(c.num_layers):
        for group, name in _PROJECTIONS:
            w = layers[i][group][name]
            if isinstance(w, (Fp8Weight, RowWeight)):
                why = unstreamable(w, f"layer {i} {group}.{name}")
                if why:
                    return why
            elif not dense_ok or jnp.dtype(w.dtype) != jnp.bfloat16:
                return (f"layer {i} {group}.{name} is {jnp.dtype(w.dtype).name} in the einsum "
                        f"layout; the kernel streams [N, K] rows: hold the projections as rows "
                        f"(models.to_rows(params, config, donate=True): both steps read them) "
                        f"or as FP8 (load with quantize='fp8'); dense bf16 runs only on the "
                        f"CPU reference, transposed in each step")
            kinds.add(type(w) is Fp8Weight)  # dense bf16 and bf16 rows: the op's same rows
    if len(kinds) > 1:
        return "the projections mix FP8 and bf16: the persistent step streams one weight type"
    return None


def _rows(w, n_in: int, stack: bool = False):
    """(rows, float32 scale) of a projection as the op takes it: an Fp8Weight's e4m3 values as
    [N, K] (a stack: [E, N, K]) and its scales flattened (per row of every expert, or one); a
    RowWeight's bf16 rows as they lie, scale 1; a dense bf16 einsum weight [*(E,) *in, *out]
    transposed to rows, scale 1."""
    if isinstance(w, RowWeight):
        if not stack:
            return operands(w)
        return w.w.reshape(w.w.shape[0], -1, math.prod(w.in_dims)), jnp.ones((1,), jnp.float32)
    if isinstance(w, Fp8Weight):
        if not stack:
            return operands(w)
        k = math.prod(w.in_dims)
        return w.q.reshape(w.q.shape[0], -1, k), w.scale.reshape(-1).astype(jnp.float32)
    lead = w.shape[:1] if stack else ()
    k = math.prod(w.shape[len(lead):len(lead) + n_in])
    rows = jnp.swapaxes(w.reshape(lead + (k, -1)), -1, -2)
    return rows, jnp.ones((1,), jnp.float32)


def _layer_operands(block) -> "sifar_jax.Qwen3MoeLayer":
    import sifar_jax

    attn, moe = block.attn, block.moe
    qkv, qkv_s = _rows(attn.qkv[...], 1)
    o, o_s = _rows(attn.o[...], 2)
    gu, gu_s = _rows(moe.gate_up[...], 1, stack=True)
    dn, dn_s = _rows(moe.down[...], 1, stack=True)
    return sifar_jax.Qwen3MoeLayer(
        block.input_norm.weight[...], qkv, qkv_s, attn.q_norm.weight[...],
        attn.k_norm.weight[...], o, o_s, block.post_norm.weight[...],
        moe.router[...].T.astype(jnp.bfloat16), gu, gu_s, dn, dn_s)


def make_step_forward(family, layout, options, virtual_ranks: int = 1, *,
                      mesh: Optional[Mesh] = None):
    """forward(params, cache, tokens [1, 1], positions [1], ar, start=None) -> (logits [1, 1,
    vocab] float32, cache, ar), the XLA forward's contract for one token, as the persistent
    step (check `reason` first). virtual_ranks > 1 (tests; tp = 1): the step of a TP model of
    that many ranks (sifar_jax.qwen3_moe_step_virtual_ranks)."""
    import sifar_jax

    c = layout.config
    graphdef, _ = family.abstract_model(layout.shapes)
    inv_freq = rope_inv_freq(c)

    def forward(params, cache, tokens, positions, ar, start=None):
        model = nnx.merge(graphdef, params)
        head = head_operands(model, c)
        args = (*step_operands(model, c, tokens, positions, start, inv_freq),
                [_layer_operands(b) for b in model.layers], cache)
        kw = dict(kv_heads=c.num_kv_heads, group=c.group_size, top_k=c.num_experts_per_tok,
                  norm_topk_prob=c.norm_topk_prob, eps=c.rms_norm_eps, head=head)
        if virtual_ranks > 1:
            h, cache, *logits = sifar_jax.qwen3_moe_step_virtual_ranks(
                *args, ranks=virtual_ranks, **kw)
        else:
            h, cache, *logits = sifar_jax.qwen3_moe_step(*args, **kw)
        if head is not None:  # the kernel streamed the head too
            return logits[0][None, None], cache, ar
        return xla_head(model, c, h, options.gemm_rows), cache, ar

    return forward


class Qwen3MoePersistentStep:
    """The persistent step as a FastStep (family.py): QWEN3_MOE's fast_step."""

    name = "persistent"

    def reason(self, family, layout, mesh: Mesh, options, params: Any, *,
               reference: bool = False) -> Optional[str]:
        return reason(family, layout, mesh, options, params, reference=reference)

    def make_forward(self, family, layout, options, **kw):
        return make_step_forward(family, layout, options, **kw)

    def describe(self, layout, mesh: Mesh, options) -> str:
        platform = mesh.devices.flat[0].platform
        return ("CUDA kernel" if platform == "gpu" else
                f"sifar_jax.qwen3_moe_step's {platform.upper()} reference on host devices, slow")

    def prepare_params(self, family, config, mesh: Mesh, options, params: Any) -> Any:
        # rows wherever the step would run on them, the CPU reference too: it would transpose
        # dense projections in every step
        return llama.rows_for_step(family, config, mesh, options, params,
                                   why=functools.partial(reason, dense=False))


PERSISTENT = Qwen3MoePersistentStep()
