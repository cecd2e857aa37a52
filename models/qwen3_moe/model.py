"""The Qwen3-MoE family: its sparse MoE block on the shared attention (q/k RMSNorm) and decoder
stack, its tensor-parallel split, and QWEN3_MOE, the family object the decoder, loader and CLI
use (its config and presets: config.py; its Hugging Face loader: hf.py).

Every layer is attention, then a sparse MoE block: a router (a linear map to num_experts logits,
softmax in float32, the top-k experts, their weights renormalised to sum to 1 with
norm_topk_prob) and per-expert SwiGLU FFNs, no shared expert. Dense layers (decoder_sparse_step
> 1, mlp_only_layers) are not supported.

Tensor-parallel layout, beside the attention's (core/attention.py) and the stack's
(core/transformer.py):
  moe.router  [hidden, experts]        replicated: every rank routes every token itself
  moe.gate_up [experts, hidden, 2, I]  split over I (dim 3): each expert's FFN split as a dense
  moe.down    [experts, I, hidden]     split over I (dim 1)   MLP's, row-parallel
A rank's MoE output is the routing-weighted sum over the chosen experts of its partial down
projections, so ONE all-reduce per MoE block sums it (fused with the residual add and the next
RMSNorm like the dense decoder's: TPContext.add_norm). 2 all-reduces per layer.

Which experts' weights a step reads (moe_impl, a config field so it is part of the compiled
model):
  "gather"  at few tokens (tokens x top_k < experts: decoding) the chosen experts'
            slices are gathered (jnp.take) and multiplied; at more tokens (prefill) every
            expert runs on every token and the unchosen ones get weight 0 (reads each weight
            once, never a per-token copy).
  "matvec"  (default) at few tokens, both projections of every (token, slot) pair as one
            sifar_jax.matvec call each: a streaming kernel that reads each chosen expert's
            weights where they lie, no gathered copy (CUDA; XLA's ops elsewhere: the same
            products as "gather"); more tokens: as "gather". A step is faster than with
            "gather" on GPUs (docs/performance.md).
All give the same numbers up to float summation order. Expert stacks held as rows (RowWeight,
models.to_rows: the persistent step's layout) are read in their stored order by "gather" and
the many-token path; "matvec" takes the gather path for them (its kernel reads [E, K, N]).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from ..core import attention, sharding, transformer
from ..core.attention import Attention, Step
from ..core.tp import RMSNorm, TPContext, normal
from ..family import ModelFamily
from ..weights.types import Fp8Weight, Projection, RowWeight, matvec_fp8
from . import hf
from .config import MOE_IMPLS, Qwen3MoeConfig
from .step import PERSISTENT


# ---- the experts ------------------------------------------------------------------------------------

def route(x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool):
    """x [N, hidden] -> (weights [N, k] in x.dtype, expert ids [N, k] int32), as transformers'
    Qwen3MoeTopKRouter: logits in x.dtype, softmax in float32, top-k, renormalised."""
    logits = (x @ router).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), ids.astype(jnp.int32)


def _swiglu(h: jax.Array) -> jax.Array:
    """h [..., 2, I] (gate, up) -> silu(gate) * up [..., I]."""
    return jax.nn.silu(h[..., 0, :]) * h[..., 1, :]


def _stacks(gate_up, down):
    """(gate_up, down, their per-expert einsum subscripts): the einsum layout's [E, hidden, 2, I]
    and [E, I, hidden], or RowWeight stacks' stored order [E, 2, I, hidden] and [E, hidden, I]
    (models.to_rows), read as they lie: the same products, each sum's order XLA's."""
    if isinstance(gate_up, RowWeight):
        return gate_up.w, down.w, "cfh", "hf"
    return gate_up, down, "hcf", "fh"


def experts_gather(x, weights, ids, gate_up, down, rows: int = 1):
    """The chosen experts only: each (token, slot)'s expert slices gathered and multiplied.
    x [N, hidden], weights/ids [N, k], gate_up [E, hidden, 2, I], down [E, I, hidden] (this
    rank's I; or both as RowWeight stacks) -> this rank's partial output [N, hidden]. Reads N*k
    expert slices. rows: each slice's one-row product runs as that many copies of the row, the
    first kept (tp.project says why: XLA:GPU's one-row products stream their weights slowly)."""
    gate_up, down, gu, dn = _stacks(gate_up, down)
    n, k = ids.shape
    flat = ids.reshape(-1)
    xs = jnp.repeat(x, k, axis=0)[:, None]  # [N*k, 1, hidden], row m is token m // k
    xs = jnp.broadcast_to(xs, (xs.shape[0], rows, xs.shape[2]))
    h = jnp.einsum(f"mrh,m{gu}->mrcf", xs, jnp.take(gate_up, flat, axis=0, mode="clip"))
    y = jnp.einsum(f"mrf,m{dn}->mrh", _swiglu(h), jnp.take(down, flat, axis=0, mode="clip"))
    return jnp.einsum("nkh,nk->nh", y[:, 0].reshape(n, k, -1), weights)


def experts_matvec(x, weights, ids, gate_up, down):
    """As experts_gather, each projection of all (token, slot) pairs as one sifar_jax.matvec call
    that reads the chosen experts' weights in place (the kernel on CUDA, XLA's ops elsewhere)."""
    from sifar_jax.matvec import matvec  # lazily: the models work without the extension built

    n, k = ids.shape
    flat = ids.reshape(-1)
    xs = jnp.repeat(x, k, axis=0)  # [N*k, hidden], row m is token m // k
    h = matvec(xs, gate_up, flat)  # [N*k, 2, I]
    y = matvec(_swiglu(h), down, flat)  # [N*k, hidden]
    return jnp.einsum("nkh,nk->nh", y.reshape(n, k, -1), weights)


def experts_dense(x, weights, ids, gate_up, down):
    """Every expert on every token, the unchosen ones weighted 0 (as experts_gather). For many
    tokens: reads each expert's weights once, computes E/k times the useful work."""
    gate_up, down, gu, dn = _stacks(gate_up, down)
    # [N, E]: each token's weight of every expert, 0 where not chosen (ids are distinct per row)
    combine = jnp.einsum("nke,nk->ne", jax.nn.one_hot(ids, gate_up.shape[0], dtype=x.dtype),
                         weights)
    h = jnp.einsum(f"nh,e{gu}->necf", x, gate_up)
    a = _swiglu(h) * combine[..., None]
    return jnp.einsum(f"nef,e{dn}->nh", a, down)


def experts(x, weights, ids, gate_up, down, impl: str = "matvec", rows: int = 1):
    """This rank's partial MoE output [N, hidden] (see the module docstring for `impl`; rows:
    see experts_gather)."""
    if isinstance(gate_up, Fp8Weight):  # FP8 experts: always read in place, as matvec does
        n, k = ids.shape
        h = matvec_fp8(jnp.repeat(x, k, axis=0), gate_up, ids.reshape(-1), "the experts' gate_up")
        y = matvec_fp8(_swiglu(h), down, ids.reshape(-1), "the experts' down")
        return jnp.einsum("nkh,nk->nh", y.reshape(n, k, -1), weights)
    if impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {impl!r}")
    if ids.size < _stacks(gate_up, down)[0].shape[0]:  # fewer slices than experts: only those
        # sifar_jax.matvec reads [E, K, N] weights, not rows: RowWeight stacks take the gather
        if impl == "matvec" and not isinstance(gate_up, RowWeight):
            return experts_matvec(x, weights, ids, gate_up, down)
        return experts_gather(x, weights, ids, gate_up, down, rows)
    return experts_dense(x, weights, ids, gate_up, down)


# ---- the layers -------------------------------------------------------------------------------------

# Which dimension of each (global) parameter is split over the tp axis (others, the router
# included, are replicated), and each linear weight's fan-in from its shape (random init).
TP_DIM = {**attention.TP_DIM, "gate_up": 3, "down": 1, **transformer.TP_DIM}
FAN_IN = {**attention.FAN_IN, "router": lambda shape: shape[0],
          "gate_up": lambda shape: shape[1], "down": lambda shape: shape[1], **transformer.FAN_IN}
# The projections an FP8 model holds as Fp8Weight: the attention's, the expert stacks (one
# leading expert dim) and the LM head; the router, norms and embedding stay in the model dtype.
PROJECTIONS = {**attention.PROJECTIONS, "gate_up": Projection(n_in=1, lead=1),
               "down": Projection(n_in=1, lead=1), **transformer.PROJECTIONS}


class MoE(nnx.Module):
    def __init__(self, config: Qwen3MoeConfig, *, rngs: nnx.Rngs):
        c = config
        dt = jnp.dtype(c.dtype)
        e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.router = nnx.Param(normal(rngs, (h, e), h ** -0.5, dt))
        self.gate_up = nnx.Param(normal(rngs, (e, h, 2, i), h ** -0.5, dt))
        self.down = nnx.Param(normal(rngs, (e, i, h), i ** -0.5, dt))
        self.top_k = c.num_experts_per_tok
        self.norm_topk_prob = c.norm_topk_prob
        self.impl = c.moe_impl

    def __call__(self, x, rows: int = 1):
        """x [B, T, hidden] (replicated) -> this rank's partial sum [B, T, hidden] (the caller
        all-reduces it); rows: see experts_gather."""
        b, t, h = x.shape
        xs = x.reshape(b * t, h)
        weights, ids = route(xs, self.router[...], self.top_k, self.norm_topk_prob)
        y = experts(xs, weights, ids, self.gate_up[...], self.down[...], self.impl, rows)
        return y.reshape(b, t, h)


class Block(nnx.Module):
    def __init__(self, config: Qwen3MoeConfig, *, rngs: nnx.Rngs):
        dt = jnp.dtype(config.dtype)
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.attn = Attention(config, rngs=rngs, qk_norm=True)
        self.post_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.moe = MoE(config, rngs=rngs)

    def __call__(self, h, x, cache, layer: int, step: Step, tp: TPContext,
                 next_norm: RMSNorm, next_weight: Optional[jax.Array] = None):
        """The block contract of core/transformer.py: h = input_norm(x); returns
        (next_norm(new x), new x, new cache). The all-reduce after attention prefetches the
        router (the next weight read; which experts follow is not known yet)."""
        a, cache = self.attn(h, cache, layer, step)
        h, x = tp.add_norm(a, x, self.post_norm, self.moe.router[...])
        h, x = tp.add_norm(self.moe(h, step.gemm_rows), x, next_norm, next_weight)
        return h, x, cache


class Qwen3Moe(transformer.CausalLM):
    def make_block(self, config: Qwen3MoeConfig, index: int, *, rngs: nnx.Rngs) -> Block:
        return Block(config, rngs=rngs)


def check_tp(config: Qwen3MoeConfig, tp: int) -> None:
    """Raise a clear error if the model cannot be split tp ways."""
    sharding.check_tp(config, tp, [
        ("moe_intermediate_size", config.moe_intermediate_size, "every expert is split over it"),
        ("vocab_size", config.vocab_size, "lm_head is split over vocab")])


def _routed_share(config: Qwen3MoeConfig) -> float:
    return config.num_experts_per_tok / config.num_experts


QWEN3_MOE = ModelFamily(
    name="qwen3_moe", config_type=Qwen3MoeConfig,
    presets={"qwen3_moe_tiny": Qwen3MoeConfig.tiny, "qwen3_30b_a3b": Qwen3MoeConfig.qwen3_30b_a3b,
             "qwen3_moe_step_tiny": Qwen3MoeConfig.qwen3_moe_step_tiny},
    model=Qwen3Moe, tp_dims=TP_DIM, check_tp=check_tp, fan_in=FAN_IN, projections=PROJECTIONS,
    loader=hf, hf_model_types=("qwen3_moe",),
    step_read_fraction={"gate_up": _routed_share, "down": _routed_share}, fast_step=PERSISTENT)
