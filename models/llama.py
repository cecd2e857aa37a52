"""The Llama 3.x family: its MLP and block on the shared attention and decoder stack, its
tensor-parallel split, and its parameter layout.

Tensor-parallel layout (Megatron style; tp = size of the mesh axis), beside the attention's
(attention.py) and the stack's (transformer.py):
  mlp.gate_up[hidden, 2, ffn]  split over ffn (dim 2); one matmul for both
  mlp.down   [ffn, hidden]     split over ffn (dim 0), row-parallel
Each row-parallel output (attention's o, the MLP's down) is followed by one all-reduce: 2 per
layer. Every all-reduce is followed at once by a residual add and the next RMSNorm (after
attention: the post-attention norm; after the MLP: the next layer's input norm, or the final norm
after the last layer), so the three can run as one fused call (`sifar_jax.psum_add_rmsnorm`,
fused=True) or unfused (the default).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from . import attention, sharding, transformer
from .attention import Attention, Step
from .config import LlamaConfig
from .tp import (FUSED_MODES, RMSNorm, TPContext, make_allreduce, make_allreduce_into,
                 make_fused_add_norm, normal)

# Which dimension of each (global) parameter is split over the tp axis; others are replicated.
TP_DIM = {**attention.TP_DIM, "gate_up": 2, "down": 0, **transformer.TP_DIM}


class MLP(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c = config
        dt = jnp.dtype(c.dtype)
        self.gate_up = nnx.Param(normal(rngs, (c.hidden_size, 2, c.intermediate_size),
                                        c.hidden_size ** -0.5, dt))
        self.down = nnx.Param(normal(rngs, (c.intermediate_size, c.hidden_size),
                                     c.intermediate_size ** -0.5, dt))

    def __call__(self, x):
        """This rank's partial sum of the down projection (the caller all-reduces it)."""
        h = jnp.einsum("bth,hcf->btcf", x, self.gate_up[...])
        a = jax.nn.silu(h[..., 0, :]) * h[..., 1, :]
        return a @ self.down[...]  # row-parallel: partial sum


class Block(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        dt = jnp.dtype(config.dtype)
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.attn = Attention(config, rngs=rngs)
        self.post_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, h, x, kv_cache, step: Step, tp: TPContext, next_norm: RMSNorm,
                 next_weight: Optional[jax.Array] = None):
        """h = input_norm(x), already computed by the previous all-reduce; x the residual
        stream. Returns (next_norm(new x), new x, new cache): each all-reduce is followed by the
        residual add and the norm after it, fused or not (TPContext.add_norm). next_weight: the
        first weight read after this block (the next layer's qkv, or the LM head)."""
        a, kv_cache = self.attn(h, kv_cache, step)
        h, x = tp.add_norm(a, x, self.post_norm, self.mlp.gate_up[...])
        h, x = tp.add_norm(self.mlp(h), x, next_norm, next_weight)
        return h, x, kv_cache


class Llama(transformer.CausalLM):
    def make_block(self, config: LlamaConfig, index: int, *, rngs: nnx.Rngs) -> Block:
        return Block(config, rngs=rngs)


def check_tp(config: LlamaConfig, tp: int) -> None:
    """Raise a clear error if the model cannot be split tp ways."""
    sharding.check_tp(config, tp, [("intermediate_size", config.intermediate_size, ""),
                                   ("vocab_size", config.vocab_size, "lm_head is split over vocab")])


def tp_layout(config: LlamaConfig, tp: int) -> LlamaConfig:
    """The config whose shapes the tp-way layout uses (sharding.tp_layout), after check_tp."""
    check_tp(config, tp)
    return sharding.tp_layout(config, tp)


# ---- global pytrees: shapes, shardings, the shard_map'd forward ------------------------------------

@functools.lru_cache(maxsize=None)
def abstract_model(config: LlamaConfig) -> tuple[nnx.GraphDef, dict]:
    """(graphdef, pure-dict pytree of ShapeDtypeStruct) without allocating anything."""
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def param_specs(params: dict, axis_name: str = "tp") -> dict:
    """PartitionSpec pytree for a parameter pytree (arrays or ShapeDtypeStructs)."""
    return sharding.param_specs(params, TP_DIM, axis_name)


def param_shardings(config: LlamaConfig, mesh: Mesh, axis_name: str = "tp") -> dict:
    """NamedSharding pytree of the parameters laid out for `mesh` (see tp_layout)."""
    _, abstract = abstract_model(tp_layout(config, mesh.shape[axis_name]))
    return sharding.param_shardings(abstract, mesh, TP_DIM, axis_name)


def init_cache(config: LlamaConfig, mesh: Mesh, batch_size: int, max_seq_len: int,
               axis_name: str = "tp", kv_layout: str = "bshd") -> list:
    """Zero KV cache, created directly sharded (no host copy). With tp > num_kv_heads each rank
    holds its copy of one KV head."""
    return sharding.init_cache(tp_layout(config, mesh.shape[axis_name]), mesh, batch_size,
                               max_seq_len, axis_name, kv_layout)


def make_forward(config: LlamaConfig, mesh: Mesh, *, allreduce: str = "psum",
                 algorithm: str = "auto", fused=False, axis_name: str = "tp",
                 last_only: bool = False, attend_len: Optional[int] = None, ar_specs: Any = None,
                 kv_layout: str = "bshd", prefetch_bytes: Optional[int] = None):
    """The TP forward as a pure function, ready for jax.jit:

        forward(params, cache, tokens, positions, ar) -> (logits, cache, ar)

    params/cache are global arrays sharded as param_shardings/cache_spec (laid out by tp_layout);
    tokens [B, T] and positions [T] are replicated; logits [B, T (1 if last_only), vocab] come out
    split over vocab; `ar` is the all-reduce buffer pytree of the decode state ({} unless
    sifar_buffers; `ar_specs` its specs). attend_len: attention over that many cache positions
    (see attention.Step); kv_layout: the cache's (KV_LAYOUTS). fused=True (allreduce="sifar"):
    all-reduce + residual add + RMSNorm as one sifar_jax.psum_add_rmsnorm call, which brings the
    first prefetch_bytes of the next matmul's weight into L2 while it waits (None: sifar_jax's
    default; 0: no prefetch). Works for a 1-device mesh (tp=1) too.
    """
    tp = mesh.shape[axis_name]
    config = tp_layout(config, tp)
    graphdef, abstract = abstract_model(config)
    pspecs = param_specs(abstract, axis_name)
    sharding.check_kv_layout(kv_layout)
    cspec = sharding.cache_specs(config, axis_name, kv_layout)
    aspecs = {} if ar_specs is None else ar_specs
    reduce_fn = make_allreduce(allreduce, algorithm)
    if fused not in FUSED_MODES:
        raise ValueError(f"fused must be one of {FUSED_MODES}, got {fused!r}")
    fused_fn = make_fused_add_norm(allreduce, algorithm, prefetch_bytes) if fused else None

    def per_rank(params, cache, tokens, positions, ar):
        model = nnx.merge(graphdef, params)
        ctx = TPContext(axis_name, tp, reduce_fn, ar, make_allreduce_into(algorithm), fused_fn)
        logits, cache = model(tokens, positions, cache, ctx, last_only=last_only,
                              attend_len=attend_len, kv_layout=kv_layout)
        if ctx.buffers and ctx.count % 2:
            # The next step starts with buffer "a" again: an odd count would reuse the buffer
            # the last all-reduce wrote, which dual buffering forbids.
            raise ValueError(f"explicit dual buffers need an even number of all-reduces per step, "
                             f"got {ctx.count}")
        return logits, cache, ctx.buffers

    return jax.shard_map(
        per_rank, mesh=mesh,
        in_specs=(pspecs, cspec, P(), P(), aspecs),
        out_specs=(P(None, None, axis_name), cspec, aspecs),
        check_vma=True)
