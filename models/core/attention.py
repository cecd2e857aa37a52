"""The attention every model family shares: GQA with rotary embeddings, the KV cache written in
place, attention over a static prefix of the cache (a bucket), and optional q/k RMSNorm (Qwen3).

One rank's computation (see tp.py). Tensor-parallel layout (Megatron style):
  attn.qkv   [hidden, kv_heads, group+2, head_dim]  split over kv heads (dim 1). Each KV group
             holds its `group` query heads, then k, then v, so a contiguous split hands a rank
             whole GQA groups and the layout does not depend on tp. One matmul for q, k and v.
  attn.o     [heads, head_dim, hidden]              split over heads (dim 0), row-parallel: the
                                                    caller all-reduces its output
  attn.q_norm, attn.k_norm  [head_dim]              (qk_norm only) replicated
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..weights.types import Projection
from .pallas_attention import decode_attention
from .sharding import KV_LAYOUTS
from .tp import RMSNorm, normal, project

# Which dimension of each attention parameter is split over the tp axis, and each one's fan-in
# from its shape (random init); a family's tables include these.
TP_DIM = {"qkv": 1, "o": 0}
FAN_IN = {"qkv": lambda shape: shape[0], "o": lambda shape: shape[0] * shape[1]}
# The projections (FP8-quantizable weights): how many leading dims each contracts.
PROJECTIONS = {"qkv": Projection(n_in=1), "o": Projection(n_in=2)}
KV_PARAM = "qkv"  # the parameter holding the KV heads (sharding.replicate_kv's layout)


# ---- rotary embeddings ----------------------------------------------------------------------------

def rope_inv_freq(config: Any) -> np.ndarray:
    """Inverse frequencies [head_dim/2] from config.head_dim and rope_theta, with Llama 3 scaling
    when config.rope_scaling is set (as transformers' `llama3` rope)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    s = config.rope_scaling
    if s is None:
        return inv_freq.astype(np.float32)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., head_dim] for positions [...] (the half-frequencies repeated twice: HF's
    rotate_half layout)."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., T, heads..., head_dim]; cos/sin already broadcastable to x."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


# ---- what every layer of one forward call shares ---------------------------------------------------

# How a step of one new token per row attends: "xla" the einsums of Attention.__call__, "pallas"
# JAX's Pallas flash-decoding kernel (core/pallas_attention.py; where it does not apply, and for
# steps of several tokens, the einsums run).
from ..decoder.options import ATTN_IMPLS, DecodeOptions, check_attn_impl  # noqa: E402 - re-exported


@dataclasses.dataclass(frozen=True)
class Step:
    """The positions one forward call fills and how its layers read the cache (trace-time only).

    positions [T] int32, contiguous cache slots, shared by the batch (the cache is written at
    positions[0]); attend_len: attention over that many cache slots (all of them if None; the
    caller guarantees positions[-1] < attend_len). start [B] int32 or None (0): each row's first
    slot. A row's slots before it (left padding, so that prompts of different lengths end at the
    same slot) are never attended to, and its token in slot p is at position p - start (its
    rotary angle), as in a run of that row alone. cos/sin: the rotary factors, [T, head_dim], or
    [B, T, head_dim] with start. options: the decoder's resolved options.DecodeOptions, of which
    the layers read kv_layout (the cache's KV_LAYOUTS key), gemm_rows (the rows a single-row
    projection runs with, tp.project) and attn_impl (ATTN_IMPLS: how a step of one token
    attends)."""

    positions: jax.Array
    cos: jax.Array
    sin: jax.Array
    attend_len: Optional[int] = None
    start: Optional[jax.Array] = None
    options: Any = None  # a resolved DecodeOptions (None: DecodeOptions' CPU defaults)

    @classmethod
    def at(cls, config: Any, positions: jax.Array, attend_len: Optional[int] = None,
           start: Optional[jax.Array] = None, options: Any = None) -> "Step":
        if options is None:
            options = DecodeOptions(kv_layout="bshd", gemm_rows=1, attn_impl="xla")
        if not options.resolved:
            raise ValueError("Step needs resolved options (DecodeOptions.resolve(mesh))")
        check_attn_impl(options.attn_impl)
        rope_positions = positions if start is None else positions[None, :] - start[:, None]
        cos, sin = rope_cos_sin(rope_positions, rope_inv_freq(config))
        return cls(positions, cos, sin, attend_len, start, options)

    @property
    def kv_layout(self) -> str:
        return self.options.kv_layout

    @property
    def gemm_rows(self) -> int:
        return self.options.gemm_rows

    @property
    def attn_impl(self) -> str:
        return self.options.attn_impl

    def rope(self, x: jax.Array) -> jax.Array:
        """The rotary embedding of x [B, T, heads..., head_dim]."""
        cos, sin = (self.cos, self.sin) if self.cos.ndim == 3 else (self.cos[None], self.sin[None])
        shape = cos.shape[:2] + (1,) * (x.ndim - 3) + cos.shape[2:]
        return apply_rope(x, cos.reshape(shape), sin.reshape(shape))

    def visible(self, n: int) -> jax.Array:
        """Which of the first n cache slots each query sees: [T, n], or [B, 1, 1, T, n] with
        start (broadcast against scores [B, kv heads, group, T, n])."""
        slots = jnp.arange(n)
        causal = self.positions[:, None] >= slots[None, :]
        if self.start is None:
            return causal
        return (causal[None] & (slots[None, None, :] >= self.start[:, None, None]))[:, None, None]


def _to_cache(k, v, dims: str, dtype):
    """This step's keys and values [B, T, kv heads, D] as the cache's update [1, 2, ...] for one
    layer: keys then values, each in the layer's layout (`dims`) and the cache's dtype."""
    kv = jnp.stack([k, v])[None]
    return (kv if dims == "bskd" else jnp.swapaxes(kv, 3, 4)).astype(dtype)


class Attention(nnx.Module):
    """GQA self-attention of one rank. config: hidden_size, num_heads, num_kv_heads, head_dim,
    group_size, dtype (and rms_norm_eps with qk_norm). qk_norm: RMSNorm over head_dim on each
    query and key head before the rotary embedding (Qwen3)."""

    def __init__(self, config: Any, *, rngs: nnx.Rngs, qk_norm: bool = False):
        c = config
        dt = jnp.dtype(c.dtype)
        self.group = c.group_size
        self.head_dim = c.head_dim
        self.qkv = nnx.Param(normal(rngs, (c.hidden_size, c.num_kv_heads, c.group_size + 2,
                                           c.head_dim), c.hidden_size ** -0.5, dt))
        self.o = nnx.Param(normal(rngs, (c.num_heads, c.head_dim, c.hidden_size),
                                  (c.num_heads * c.head_dim) ** -0.5, dt))
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dt)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dt)

    def __call__(self, x: jax.Array, cache: jax.Array, layer: int, step: Step):
        """x [B, T, hidden]; cache: every layer's keys and values as one array [layers, 2, ...]
        (sharding.cache_dims: [..., B, S, local_kv_heads, head_dim] ("bshd") or [..., B,
        local_kv_heads, S, head_dim] ("bhsd")), of which this is layer `layer`.
        Returns (this rank's partial sum of the output projection, new cache): the caller
        all-reduces it."""
        g, d = self.group, self.head_dim
        qkv = project("bth,hkgd->btkgd", x, self.qkv[...], step.gemm_rows)  # k: local kv heads
        q, k, v = qkv[..., :g, :], qkv[..., g, :], qkv[..., g + 1, :]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = step.rope(q), step.rope(k)

        # write this step's keys/values in place (the cache is donated; a layer's keys and
        # values are one update, one kernel), then attend over a static prefix of the cache with
        # a position mask: one compiled step per length bucket, whose cost is that of the
        # bucket, not of the whole cache.
        dims = KV_LAYOUTS[step.kv_layout]
        s_axis = dims.index("s")
        at = [layer, 0, 0, 0, 0, 0]
        at[2 + s_axis] = step.positions[0]
        cache = jax.lax.dynamic_update_slice(cache, _to_cache(k, v, dims, cache.dtype), at)
        n = cache.shape[2 + s_axis] if step.attend_len is None else step.attend_len
        out = None
        if step.attn_impl == "pallas" and x.shape[1] == 1 and step.kv_layout == "bhsd":
            out = decode_attention(q[:, 0], cache, layer, step.positions[0], step.start, n)
        if out is None:
            # this layer's first n slots of keys and of values (static slices of the cache)
            ka, va = (jax.lax.slice_in_dim(cache[layer, c], 0, n, axis=s_axis) for c in (0, 1))
            scores = jnp.einsum(f"btkgd,{dims}->bkgts", q, ka, preferred_element_type=jnp.float32)
            scores = scores * (d ** -0.5)
            scores = jnp.where(step.visible(n), scores, jnp.finfo(jnp.float32).min)
            probs = jax.nn.softmax(scores, axis=-1).astype(va.dtype)
            out = jnp.einsum(f"bkgts,{dims}->btkgd", probs, va, preferred_element_type=jnp.float32)
        out = out.astype(x.dtype).reshape(*x.shape[:2], -1, d)  # heads in (kv group, group) order
        partial = project("bthd,hdm->btm", out, self.o[...], step.gemm_rows)  # row-parallel partial
        return partial, cache
