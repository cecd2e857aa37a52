"""Llama 3.x decoder in Flax NNX, written as the computation of ONE tensor-parallel rank.

The modules are built with global shapes (so `nnx.split` gives the global parameter pytree that the
loader shards onto the mesh) but their `__call__` only ever sees a rank's local shards: inside
`jax.shard_map` we `nnx.merge` the graphdef with the local pieces. All local sizes are therefore
read from the weights' shapes, never from the config.

Tensor-parallel layout (Megatron style; tp = size of the mesh axis):
  attn.qkv   [hidden, kv_heads, group+2, head_dim]  split over kv heads (dim 1). Each KV group
             holds its `group` query heads, then k, then v, so a contiguous split hands a rank
             whole GQA groups and the layout does not depend on tp. One matmul for q, k and v.
  attn.o     [heads, head_dim, hidden]              split over heads (dim 0), row-parallel
  mlp.gate_up[hidden, 2, ffn]                       split over ffn (dim 2); one matmul for both
  mlp.down   [ffn, hidden]                          split over ffn (dim 0), row-parallel
  embed      [vocab, hidden]                        replicated (a lookup is cheap; sharding it
                                                    would add a third all-reduce per token)
  lm_head    [hidden, vocab]                        split over vocab (dim 1): at 8B shapes a
                                                    replicated head would be 1 GB read per token
                                                    per GPU. The logits leave shard_map vocab-
                                                    sharded; XLA gathers/argmaxes outside.
  norms                                             replicated
Each row-parallel output (o, down) is followed by one all-reduce: 2 per layer. Every all-reduce is
followed at once by a residual add and the next RMSNorm (after attention: the post-attention norm;
after the MLP: the next layer's input norm, or the final norm after the last layer), so the three
can run as one fused call (`sifar_jax.psum_add_rmsnorm`, fused=True) or unfused (the default).

KV heads are replicated when tp > num_kv_heads (tp a multiple of it): the layout is then that of
an equivalent model with tp KV heads, each original head copied to tp/num_kv_heads ranks, each copy
with its share of the group's query heads (`tp_layout`). Parameter values do not depend on tp.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import LlamaConfig

AllReduceFn = Callable[[jax.Array, str], jax.Array]
# sifar_buffers: sifar with explicit dual buffers threaded through the decode state.
ALLREDUCE_KINDS = ("psum", "sifar", "sifar_buffers", "identity")


# ---- the one switch between all-reduce implementations -------------------------------------------

def make_allreduce(kind: str = "psum", algorithm: str = "auto") -> AllReduceFn:
    """Return f(x, axis_name) -> sum of x over the mesh axis (inside shard_map).

    "psum": jax.lax.psum.  "sifar": sifar_jax.sifar_psum (requires sifar_jax.init(mesh) first;
    the Decoder does that).  "identity": no communication at all — wrong numbers, but the timing
    upper bound for a free all-reduce.
    """
    if kind == "psum":
        return lambda x, axis_name: jax.lax.psum(x, axis_name)
    if kind == "identity":
        return lambda x, axis_name: x
    if kind in ("sifar", "sifar_buffers"):  # sifar_buffers: see make_allreduce_into
        def sifar(x, axis_name):
            import sifar_jax  # lazily: the models work without the extension built

            return sifar_jax.sifar_psum(x, axis_name, algorithm=algorithm)

        return sifar
    raise ValueError(f"allreduce must be one of {ALLREDUCE_KINDS}, got {kind!r}")


def make_allreduce_into(algorithm: str = "auto"):
    """f(x, axis_name, buf, prev) -> (sum, buf): sifar with explicit dual buffers."""
    def sifar_into(x, axis_name, buf, prev):
        import sifar_jax

        return sifar_jax.sifar_psum_into(x, axis_name, buf, prev, algorithm=algorithm)

    return sifar_into


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Llama's RMSNorm: float32 statistics, then the scale in the activation dtype (as
    transformers does): weight * bf16(x * rsqrt(mean(x^2) + eps))."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def unfused_psum_add_rmsnorm(x, residual, weight, axis_name, *, eps: float,
                             allreduce: AllReduceFn = jax.lax.psum):
    """The contract of `sifar_jax.psum_add_rmsnorm`, as three separate ops:
    new_residual = residual + allreduce(x) (in x.dtype, rounded once), normed = rms_norm(it).
    Returns (normed, new_residual)."""
    new_residual = residual + allreduce(x, axis_name)
    return rms_norm(new_residual, weight, eps), new_residual


def fused_add_norm_available() -> Optional[str]:
    """None when sifar_jax.psum_add_rmsnorm exists, else why not."""
    try:
        import sifar_jax
    except Exception as e:  # noqa: BLE001 - extension not built
        return f"import sifar_jax failed: {e!r}"
    if not hasattr(sifar_jax, "psum_add_rmsnorm"):
        return "sifar_jax has no psum_add_rmsnorm (the fused all-reduce + add + RMSNorm) yet"
    return None


def make_fused_add_norm(allreduce: str, algorithm: str = "auto",
                        prefetch_bytes: Optional[int] = None):
    """f(x, residual, weight, axis_name, *, eps, prefetch=None) -> (normed, new_residual) as one
    fused call; `prefetch` (the next matmul's weight) gets its first prefetch_bytes (None:
    sifar_jax's default, 0: none) brought into L2 while the all-reduce waits."""
    if allreduce != "sifar":
        raise ValueError(f"fused=True needs allreduce='sifar' (the fused kernel is sifar's), "
                         f"got allreduce={allreduce!r}")
    why = fused_add_norm_available()
    if why:
        raise NotImplementedError(f"fused=True: {why}")
    import sifar_jax

    if prefetch_bytes is not None and prefetch_bytes < 0:
        raise ValueError(f"prefetch_bytes must be >= 0 (or None: the default), got {prefetch_bytes}")
    return functools.partial(sifar_jax.psum_add_rmsnorm, algorithm=algorithm,
                             prefetch_bytes=prefetch_bytes)


FUSED_MODES = (False, True)


class TPContext:
    """Per-trace view of the tensor-parallel axis that every layer receives.

    Lives only while one shard_map body is traced. `buffers` is the pytree threaded through the
    decode state as state["ar"] (empty unless sifar_buffers) and returned, updated, by the forward.
    `fused_add_norm` (optional) replaces all-reduce + residual add + RMSNorm by one call.
    """

    def __init__(self, axis_name: str, size: int, allreduce: AllReduceFn, buffers: Any = None,
                 allreduce_into=None, fused_add_norm=None):
        self.axis_name = axis_name
        self.size = size
        self._allreduce = allreduce
        self._allreduce_into = allreduce_into
        self._fused_add_norm = fused_add_norm
        self.buffers = {} if buffers is None else dict(buffers)
        self.count = 0  # all-reduces issued so far in this trace

    def rank(self) -> jax.Array:
        return jax.lax.axis_index(self.axis_name)

    def all_reduce(self, x: jax.Array) -> jax.Array:
        if self.buffers:
            # Explicit dual buffering: all-reduce k writes into buffer k % 2 and keeps the other
            # (the one all-reduce k-1 wrote) alive. The decode state donates state["ar"] every
            # step, so both are written in place and keep their registered addresses.
            cur, prev = ("a", "b") if self.count % 2 == 0 else ("b", "a")
            y, self.buffers[cur] = self._allreduce_into(x, self.axis_name, self.buffers[cur],
                                                        self.buffers[prev])
        else:
            y = self._allreduce(x, self.axis_name)
        self.count += 1
        return y

    def add_norm(self, x: jax.Array, residual: jax.Array, norm: "RMSNorm",
                 next_weight: Optional[jax.Array] = None):
        """All-reduce the row-parallel partial x, add it to the residual stream, normalise with
        `norm`: (normed, new_residual). One fused call when fused, else the composition.
        next_weight: the weight the next matmul reads; the fused call prefetches its start into
        L2 while it waits for the other ranks (the unfused composition ignores it)."""
        weight = norm.weight[...]
        if self._fused_add_norm is not None:
            self.count += 1
            return self._fused_add_norm(x, residual, weight, self.axis_name, eps=norm.eps,
                                        prefetch=next_weight)
        return unfused_psum_add_rmsnorm(x, residual, weight, self.axis_name, eps=norm.eps,
                                        allreduce=lambda v, _: self.all_reduce(v))


def check_tp(config: LlamaConfig, tp: int) -> None:
    """Raise a clear error if the model cannot be split tp ways."""
    problems = []
    if config.num_kv_heads % tp and tp % config.num_kv_heads:
        problems.append(f"num_kv_heads={config.num_kv_heads} or be a multiple of it (each rank "
                        f"holds whole KV heads, or one replicated head)")
    if config.num_heads % tp:
        problems.append(f"num_heads={config.num_heads}")
    if config.intermediate_size % tp:
        problems.append(f"intermediate_size={config.intermediate_size}")
    if config.vocab_size % tp:
        problems.append(f"vocab_size={config.vocab_size} (lm_head is split over vocab)")
    if problems:
        raise ValueError(f"tensor parallelism tp={tp} must divide " + ", ".join(problems))


def kv_replicas(config: LlamaConfig, tp: int) -> int:
    """How many ranks hold a copy of each KV head (1 unless tp > num_kv_heads)."""
    return max(1, tp // config.num_kv_heads)


def tp_layout(config: LlamaConfig, tp: int) -> LlamaConfig:
    """The config whose shapes the tp-way layout uses: `config` itself, or, when tp > num_kv_heads,
    the equivalent model with tp KV heads (each head copied kv_replicas times, the group's query
    heads split among the copies; query head order unchanged)."""
    check_tp(config, tp)
    r = kv_replicas(config, tp)
    return config if r == 1 else config.replace(num_kv_heads=config.num_kv_heads * r)


def replicate_kv(qkv, r: int):
    """[hidden, kv, g+2, d] -> [hidden, kv*r, g/r+2, d]: copy j of KV head i holds query heads
    j*g/r .. (j+1)*g/r - 1 of group i, then k and v of head i (works on numpy and jax arrays)."""
    if r == 1:
        return qkv
    xp = jnp if isinstance(qkv, jax.Array) else np
    h, kv, g2, d = qkv.shape
    g = g2 - 2
    q = qkv[:, :, :g].reshape(h, kv, r, g // r, d)
    k = xp.broadcast_to(qkv[:, :, None, g:], (h, kv, r, 2, d))
    return xp.concatenate([q, k], axis=3).reshape(h, kv * r, g // r + 2, d)


# ---- rotary embeddings ----------------------------------------------------------------------------

def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """Inverse frequencies [head_dim/2], with Llama 3 scaling (as transformers' `llama3` rope)."""
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
    """cos, sin [T, head_dim] (the half-frequencies repeated twice: HF's rotate_half layout)."""
    ang = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., T, heads..., head_dim]; cos/sin already broadcastable to x."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


# ---- modules (per-rank __call__) ------------------------------------------------------------------

# KV cache layouts, by the einsum letters of a cache tensor: b batch, s positions, k kv heads,
# d head dim. Which one a platform reads in place: default_kv_layout.
KV_LAYOUTS = {"bshd": "bskd", "bhsd": "bksd"}


def _to_cache(x, dims: str, dtype):
    """[B, T, kv heads, D] keys or values in the cache's layout (`dims`) and dtype."""
    return (x if dims == "bskd" else jnp.swapaxes(x, 1, 2)).astype(dtype)


def _normal(rngs: nnx.Rngs, shape, std: float, dtype) -> jax.Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c = config
        dt = jnp.dtype(c.dtype)
        self.group = c.group_size
        self.head_dim = c.head_dim
        self.qkv = nnx.Param(_normal(rngs, (c.hidden_size, c.num_kv_heads, c.group_size + 2,
                                            c.head_dim), c.hidden_size ** -0.5, dt))
        self.o = nnx.Param(_normal(rngs, (c.num_heads, c.head_dim, c.hidden_size),
                                   (c.num_heads * c.head_dim) ** -0.5, dt))

    def __call__(self, x, cos, sin, kv_cache, positions, attend_len: Optional[int] = None,
                 kv_layout: str = "bshd"):
        """x [B, T, hidden]; kv_cache {"k","v"}: [B, S, local_kv_heads, head_dim] ("bshd") or
        [B, local_kv_heads, S, head_dim] ("bhsd"), see KV_LAYOUTS.
        Returns (this rank's partial sum of the output projection, new cache): the caller
        all-reduces it. Attention runs over the first `attend_len` cache positions (all S if
        None): the caller guarantees positions[-1] < attend_len."""
        g, d = self.group, self.head_dim
        qkv = jnp.einsum("bth,hkgd->btkgd", x, self.qkv[...])  # k: local kv heads
        q, k, v = qkv[..., :g, :], qkv[..., g, :], qkv[..., g + 1, :]
        q = apply_rope(q, cos[None, :, None, None, :], sin[None, :, None, None, :])
        k = apply_rope(k, cos[None, :, None, :], sin[None, :, None, :])

        # write this step's keys/values in place (the cache is donated), then attend over a
        # static prefix of the cache with a position mask: one compiled step per length bucket,
        # whose cost is that of the bucket, not of the whole cache.
        dims = KV_LAYOUTS[kv_layout]
        s_axis = dims.index("s")
        at = [0, 0, 0, 0]
        at[s_axis] = positions[0]
        kc = jax.lax.dynamic_update_slice(kv_cache["k"], _to_cache(k, dims, kv_cache["k"].dtype), at)
        vc = jax.lax.dynamic_update_slice(kv_cache["v"], _to_cache(v, dims, kv_cache["v"].dtype), at)
        n = kc.shape[s_axis] if attend_len is None else attend_len
        ka = jax.lax.slice_in_dim(kc, 0, n, axis=s_axis)
        va = jax.lax.slice_in_dim(vc, 0, n, axis=s_axis)

        scores = jnp.einsum(f"btkgd,{dims}->bkgts", q, ka, preferred_element_type=jnp.float32)
        scores = scores * (d ** -0.5)
        visible = positions[:, None] >= jnp.arange(n)[None, :]  # [T, n]
        scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(va.dtype)
        out = jnp.einsum(f"bkgts,{dims}->btkgd", probs, va, preferred_element_type=jnp.float32)
        out = out.astype(x.dtype).reshape(*x.shape[:2], -1, d)  # heads in (kv group, group) order
        partial = jnp.einsum("bthd,hdm->btm", out, self.o[...])  # row-parallel: partial sum
        return partial, {"k": kc, "v": vc}


class MLP(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c = config
        dt = jnp.dtype(c.dtype)
        self.gate_up = nnx.Param(_normal(rngs, (c.hidden_size, 2, c.intermediate_size),
                                         c.hidden_size ** -0.5, dt))
        self.down = nnx.Param(_normal(rngs, (c.intermediate_size, c.hidden_size),
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

    def __call__(self, h, x, cos, sin, kv_cache, positions, tp: TPContext, next_norm: RMSNorm,
                 attend_len: Optional[int] = None, kv_layout: str = "bshd",
                 next_weight: Optional[jax.Array] = None):
        """h = input_norm(x), already computed by the previous all-reduce; x the residual
        stream. Returns (next_norm(new x), new x, new cache): each all-reduce is followed by the
        residual add and the norm after it, fused or not (TPContext.add_norm). next_weight: the
        first weight read after this block (the next layer's qkv, or the LM head)."""
        a, kv_cache = self.attn(h, cos, sin, kv_cache, positions, attend_len, kv_layout)
        h, x = tp.add_norm(a, x, self.post_norm, self.mlp.gate_up[...])
        h, x = tp.add_norm(self.mlp(h), x, next_norm, next_weight)
        return h, x, kv_cache


class Llama(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        dt = jnp.dtype(config.dtype)
        self.config = config
        self.embed = nnx.Param(_normal(rngs, (config.vocab_size, config.hidden_size), 1.0, dt))
        self.layers = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(_normal(rngs, (config.hidden_size, config.vocab_size),
                                             config.hidden_size ** -0.5, dt))

    def __call__(self, tokens, positions, cache, tp: TPContext, last_only: bool = False,
                 attend_len: Optional[int] = None, kv_layout: str = "bshd"):
        """tokens [B, T] int32; positions [T] int32, contiguous, shared by the batch (the cache
        is written at positions[0]); cache: list over layers of {"k","v"}; attend_len: see
        Attention; kv_layout: the cache's KV_LAYOUTS key. Returns (local logits
        [B, T or 1, vocab/tp] float32, new cache)."""
        x = jnp.take(self.embed[...], tokens, axis=0)
        cos, sin = rope_cos_sin(positions, rope_inv_freq(self.config))
        layers = list(self.layers)
        next_norms = [layer.input_norm for layer in layers[1:]] + [self.norm]
        # The LM head's local shard; the tied embedding's rows are a slice (not prefetched).
        head = None if self.config.tie_word_embeddings else self.lm_head[...]
        next_weights = [layer.attn.qkv[...] for layer in layers[1:]] + [head]
        h = layers[0].input_norm(x)  # the only norm not preceded by an all-reduce
        new_cache = []
        for layer, kv, next_norm, next_weight in zip(layers, cache, next_norms, next_weights):
            h, x, kv = layer(h, x, cos, sin, kv, positions, tp, next_norm, attend_len, kv_layout,
                             next_weight)
            new_cache.append(kv)
        x = h  # self.norm(residual), from the last layer's MLP all-reduce
        if last_only:
            x = x[:, -1:]
        if self.config.tie_word_embeddings:
            # this rank's vocab slice of the (replicated) embedding table
            n = self.config.vocab_size // tp.size
            w = jax.lax.dynamic_slice_in_dim(self.embed[...], tp.rank() * n, n, axis=0)
            logits = jnp.einsum("bth,vh->btv", x, w, preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("bth,hv->btv", x, self.lm_head[...],
                                preferred_element_type=jnp.float32)
        return logits, new_cache


# ---- global pytrees: shapes, shardings, the shard_map'd forward ------------------------------------

# Which dimension of each (global) parameter is split over the tp axis; others are replicated.
TP_DIM = {"qkv": 1, "o": 0, "gate_up": 2, "down": 0, "lm_head": 1}


@functools.lru_cache(maxsize=None)
def abstract_model(config: LlamaConfig) -> tuple[nnx.GraphDef, dict]:
    """(graphdef, pure-dict pytree of ShapeDtypeStruct) without allocating anything."""
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def _spec_for(name: str, ndim: int, axis_name: str) -> P:
    dim = TP_DIM.get(name)
    if dim is None:
        return P()
    return P(*[axis_name if i == dim else None for i in range(ndim)])


def param_specs(params: dict, axis_name: str = "tp") -> dict:
    """PartitionSpec pytree for a parameter pytree (arrays or ShapeDtypeStructs)."""
    def spec(path, leaf):
        return _spec_for(str(getattr(path[-1], "key", path[-1])), len(leaf.shape), axis_name)

    return jax.tree_util.tree_map_with_path(spec, params)


def param_shardings(config: LlamaConfig, mesh: Mesh, axis_name: str = "tp") -> dict:
    """NamedSharding pytree of the parameters laid out for `mesh` (see tp_layout)."""
    _, abstract = abstract_model(tp_layout(config, mesh.shape[axis_name]))
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(abstract, axis_name))


def default_kv_layout(mesh: Mesh) -> str:
    """The KV cache layout whose attention matmuls read it in place on `mesh`'s platform:
    "bhsd" on GPUs (the matmuls batch over (B, kv heads), which XLA:GPU wants major: with "bshd"
    it copied every cache tensor in and out of each step at batch > 1, bench/NOTES.md); "bshd"
    elsewhere (XLA:CPU updates it in place and copies "bhsd", tests/test_decode_loops.py)."""
    return "bhsd" if mesh.devices.flat[0].platform == "gpu" else "bshd"


def cache_spec(axis_name: str = "tp", kv_layout: str = "bshd") -> P:
    """Split over kv heads, whichever axis holds them."""
    return P(*(axis_name if d == "k" else None for d in KV_LAYOUTS[kv_layout]))


def init_cache(config: LlamaConfig, mesh: Mesh, batch_size: int, max_seq_len: int,
               axis_name: str = "tp", kv_layout: str = "bshd") -> list:
    """Zero KV cache, created directly sharded (no host copy). With tp > num_kv_heads each rank
    holds its copy of one KV head."""
    config = tp_layout(config, mesh.shape[axis_name])
    sizes = {"b": batch_size, "s": max_seq_len, "k": config.num_kv_heads, "d": config.head_dim}
    shape = tuple(sizes[d] for d in KV_LAYOUTS[kv_layout])
    sharding = NamedSharding(mesh, cache_spec(axis_name, kv_layout))
    make = jax.jit(lambda: [{"k": jnp.zeros(shape, config.dtype), "v": jnp.zeros(shape, config.dtype)}
                            for _ in range(config.num_layers)],
                   out_shardings=sharding)
    return make()


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
    (see Attention); kv_layout: the cache's (KV_LAYOUTS). fused=True (allreduce="sifar"):
    all-reduce + residual add + RMSNorm as one sifar_jax.psum_add_rmsnorm call, which brings the
    first prefetch_bytes of the next matmul's weight into L2 while it waits (None: sifar_jax's
    default; 0: no prefetch). Works for a 1-device mesh (tp=1) too.
    """
    tp = mesh.shape[axis_name]
    config = tp_layout(config, tp)
    graphdef, abstract = abstract_model(config)
    pspecs = param_specs(abstract, axis_name)
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {sorted(KV_LAYOUTS)}, got {kv_layout!r}")
    cspec = [{"k": cache_spec(axis_name, kv_layout), "v": cache_spec(axis_name, kv_layout)}] \
        * config.num_layers
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
