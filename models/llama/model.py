"""The Llama 3.x family: its MLP and block on the shared attention and decoder stack, its
tensor-parallel split, and LLAMA, the family object the decoder, loader and CLI use (its
config: config.py, its Hugging Face loader: hf.py, its fast one-token step: step.py).

Tensor-parallel layout (Megatron style; tp = size of the mesh axis), beside the attention's
(core/attention.py) and the stack's (core/transformer.py):
  mlp.gate_up[hidden, 2, ffn]  split over ffn (dim 2); one matmul for both
  mlp.down   [ffn, hidden]     split over ffn (dim 0), row-parallel
Each row-parallel output (attention's o, the MLP's down) is followed by one all-reduce: 2 per
layer. Every all-reduce is followed at once by a residual add and the next RMSNorm (after
attention: the post-attention norm; after the MLP: the next layer's input norm, or the final norm
after the last layer), so the three can run as one fused call (`sifar_jax.psum_add_rmsnorm`,
fused=True) or unfused (the default).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from ..core import attention, sharding, transformer
from ..core.attention import Attention, Step
from ..core.tp import RMSNorm, TPContext, normal, project
from ..family import ModelFamily
from ..weights.types import Projection
from . import hf
from .config import LlamaConfig
from .step import PERSISTENT

# Which dimension of each (global) parameter is split over the tp axis (others are replicated),
# and each linear weight's fan-in from its shape (random init).
TP_DIM = {**attention.TP_DIM, "gate_up": 2, "down": 0, **transformer.TP_DIM}
FAN_IN = {**attention.FAN_IN, "gate_up": lambda shape: shape[0], "down": lambda shape: shape[0],
          **transformer.FAN_IN}
# The projections an FP8 model holds as Fp8Weight (weights.types.Projection: contracted dims);
# norms and the embedding are not in it and stay in the model dtype.
PROJECTIONS = {**attention.PROJECTIONS, "gate_up": Projection(n_in=1), "down": Projection(n_in=1),
               **transformer.PROJECTIONS}


class MLP(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c = config
        dt = jnp.dtype(c.dtype)
        self.gate_up = nnx.Param(normal(rngs, (c.hidden_size, 2, c.intermediate_size),
                                        c.hidden_size ** -0.5, dt))
        self.down = nnx.Param(normal(rngs, (c.intermediate_size, c.hidden_size),
                                     c.intermediate_size ** -0.5, dt))

    def __call__(self, x, rows: int = 1):
        """This rank's partial sum of the down projection (the caller all-reduces it); rows:
        see tp.project."""
        h = project("bth,hcf->btcf", x, self.gate_up[...], rows)
        a = jax.nn.silu(h[..., 0, :]) * h[..., 1, :]
        return project("btf,fh->bth", a, self.down[...], rows)  # row-parallel: partial sum


class Block(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        dt = jnp.dtype(config.dtype)
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.attn = Attention(config, rngs=rngs)
        self.post_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, h, x, cache, layer: int, step: Step, tp: TPContext,
                 next_norm: RMSNorm, next_weight: Optional[jax.Array] = None):
        """h = input_norm(x), already computed by the previous all-reduce; x the residual
        stream. Returns (next_norm(new x), new x, new cache): each all-reduce is followed by the
        residual add and the norm after it, fused or not (TPContext.add_norm). next_weight: the
        first weight read after this block (the next layer's qkv, or the LM head)."""
        a, cache = self.attn(h, cache, layer, step)
        h, x = tp.add_norm(a, x, self.post_norm, self.mlp.gate_up[...])
        h, x = tp.add_norm(self.mlp(h, step.gemm_rows), x, next_norm, next_weight)
        return h, x, cache


class Llama(transformer.CausalLM):
    def make_block(self, config: LlamaConfig, index: int, *, rngs: nnx.Rngs) -> Block:
        return Block(config, rngs=rngs)


def check_tp(config: LlamaConfig, tp: int) -> None:
    """Raise a clear error if the model cannot be split tp ways."""
    sharding.check_tp(config, tp, [("intermediate_size", config.intermediate_size, ""),
                                   ("vocab_size", config.vocab_size, "lm_head is split over vocab")])


LLAMA = ModelFamily(
    name="llama", config_type=LlamaConfig,
    presets={"tiny": LlamaConfig.tiny, "llama_step_tiny": LlamaConfig.llama_step_tiny,
             "llama3_8b": LlamaConfig.llama3_8b},
    model=Llama, tp_dims=TP_DIM, check_tp=check_tp, fan_in=FAN_IN, projections=PROJECTIONS,
    loader=hf, hf_model_types=("llama",), fast_step=PERSISTENT)
