"""The decoder stack every model family shares: token embedding, a family's blocks, the final
norm and the LM head, written as the computation of ONE tensor-parallel rank.

The modules are built with global shapes (so `nnx.split` gives the global parameter pytree that the
loader shards onto the mesh) but their `__call__` only ever sees a rank's local shards: inside
`jax.shard_map` the forward `nnx.merge`s the graphdef with the local pieces. All local sizes are
therefore read from the weights' shapes, never from the config.

Tensor-parallel layout of the stack (the blocks declare their own):
  embed      [vocab, hidden]  replicated (a lookup is cheap; sharding it would add a third
                              all-reduce per token)
  lm_head    [hidden, vocab]  split over vocab (dim 1): at 8B shapes a replicated head would be
                              1 GB read per token per GPU. The logits leave shard_map vocab-
                              sharded; XLA gathers/argmaxes outside.
  norm                        replicated

A block is called as block(h, x, cache, layer, step, tp, next_norm, next_weight) -> (h, x,
cache): cache is every layer's keys and values as one array (sharding.cache_dims), `layer` the
block's index in it; h = its input_norm(x), already computed by the all-reduce before it; it
returns next_norm(new x), computed by its own last all-reduce (fused or not,
TPContext.add_norm). next_weight is the first weight read after it (the next block's attn.qkv,
or the LM head), which the fused all-reduce prefetches. Every block has `input_norm` (RMSNorm)
and `attn` (attention.Attention); the norm after a block's first all-reduce is its `post_norm`.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from ..weights.types import Projection
from .attention import Step
from .tp import RMSNorm, TPContext, normal, project

# The stack's split parameters and fan-ins (a family's tables include them).
TP_DIM = {"lm_head": 1}
FAN_IN = {"lm_head": lambda shape: shape[0]}
PROJECTIONS = {"lm_head": Projection(n_in=1)}


# The norms that follow an all-reduce (TPContext.add_norm): a block's input_norm and post_norm,
# and the stack's final norm. Fused, their scales are operands of sifar_jax.psum_add_rmsnorm.
FUSED_NORMS = ("input_norm", "post_norm")


def fused_norm_scale(path) -> bool:
    """Whether a parameter path (jax.tree_util keys) is the scale of a norm the fused all-reduce
    takes: a block's input_norm or post_norm, or the stack's final norm."""
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return any(k in FUSED_NORMS for k in keys) or (len(keys) >= 1 and keys[0] == "norm")


class CausalLM(nnx.Module):
    """config: vocab_size, hidden_size, num_layers, rms_norm_eps, tie_word_embeddings, dtype
    (and what attention.Step.at reads). A family subclasses it and defines make_block."""

    def __init__(self, config: Any, *, rngs: nnx.Rngs):
        dt = jnp.dtype(config.dtype)
        self.config = config
        self.embed = nnx.Param(normal(rngs, (config.vocab_size, config.hidden_size), 1.0, dt))
        self.layers = nnx.List([self.make_block(config, i, rngs=rngs)
                                for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(normal(rngs, (config.hidden_size, config.vocab_size),
                                            config.hidden_size ** -0.5, dt))

    def make_block(self, config: Any, index: int, *, rngs: nnx.Rngs) -> nnx.Module:
        """Block `index` of the stack (see the module docstring for its contract)."""
        raise NotImplementedError

    def __call__(self, tokens, positions, cache, tp: TPContext, options: Any = None,
                 last_only: bool = False, attend_len: Optional[int] = None,
                 start: Optional[jax.Array] = None):
        """tokens [B, T] int32; positions [T] int32, contiguous, shared by the batch (the cache
        is written at positions[0]); cache: the KV cache array (sharding.cache_dims); options
        (a resolved options.DecodeOptions), attend_len, start (each row's first slot): see
        attention.Step. Returns (local logits [B, T or 1, vocab/tp] float32, new cache)."""
        x = jnp.take(self.embed[...], tokens, axis=0)
        step = Step.at(self.config, positions, attend_len, start, options)
        layers = list(self.layers)
        next_norms = [layer.input_norm for layer in layers[1:]] + [self.norm]
        # The LM head's local shard; the tied embedding's rows are a slice (not prefetched).
        head = None if self.config.tie_word_embeddings else self.lm_head[...]
        next_weights = [layer.attn.qkv[...] for layer in layers[1:]] + [head]
        h = layers[0].input_norm(x)  # the only norm not preceded by an all-reduce
        for i, (layer, next_norm, next_weight) in enumerate(zip(layers, next_norms, next_weights)):
            h, x, cache = layer(h, x, cache, i, step, tp, next_norm, next_weight)
        x = h  # self.norm(residual), from the last layer's final all-reduce
        if last_only:
            x = x[:, -1:]
        if self.config.tie_word_embeddings:
            # this rank's vocab slice of the (replicated) embedding table
            n = self.config.vocab_size // tp.size
            w = jax.lax.dynamic_slice_in_dim(self.embed[...], tp.rank() * n, n, axis=0)
            logits = project("bth,vh->btv", x, w, step.gemm_rows,
                             preferred_element_type=jnp.float32)
        else:
            logits = project("bth,hv->btv", x, self.lm_head[...], step.gemm_rows,
                             preferred_element_type=jnp.float32)
        return logits, cache
