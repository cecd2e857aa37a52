"""A tiny dense Llama-like decoder in the two styles JAX LLM code is written in,
for the adoption tests: `auto_forward` (jit + NamedSharding, no shard_map: XLA
inserts the all-reduce after each row-parallel matmul, or the caller's
`row_parallel` runs it) and `shard_map_forward` (explicit shard_map with
`jax.lax.psum` after each row-parallel matmul, as third-party code writes it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 96
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 4
    ffn: int = 128
    layers: int = 2
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# Which matrices are split over tp, and how: column-parallel (out features) or
# row-parallel (in features: their products are the partial sums reduced).
COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")
ROW = ("wo", "w_down")


def init_params(cfg: Config, key, dtype):
    keys = iter(jax.random.split(key, 4 + 8 * cfg.layers))
    normal = lambda shape, scale: (scale * jax.random.normal(next(keys), shape)).astype(dtype)  # noqa: E731
    h, d = cfg.hidden, cfg.head_dim
    layers = []
    for _ in range(cfg.layers):
        layers.append(dict(
            attn_norm=jnp.ones((h,), dtype), mlp_norm=jnp.ones((h,), dtype),
            wq=normal((h, cfg.heads * d), h ** -0.5), wk=normal((h, cfg.kv_heads * d), h ** -0.5),
            wv=normal((h, cfg.kv_heads * d), h ** -0.5), wo=normal((cfg.heads * d, h), h ** -0.5),
            w_gate=normal((h, cfg.ffn), h ** -0.5), w_up=normal((h, cfg.ffn), h ** -0.5),
            w_down=normal((cfg.ffn, h), cfg.ffn ** -0.5)))
    return dict(embed=normal((cfg.vocab, h), 1.0), norm=jnp.ones((h,), dtype),
                head=normal((h, cfg.vocab), h ** -0.5), layers=layers)


def param_specs(params, axis: str = "tp"):
    def spec(path, leaf):
        name = path[-1].key if hasattr(path[-1], "key") else None
        if name in COLUMN:
            return P(None, axis)
        if name in ROW:
            return P(axis, None)
        return P()
    return jax.tree_util.tree_map_with_path(spec, params)


def rms_norm(x, w, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def _attention(cfg: Config, q, k, v):
    """q [T, Hq*d], k/v [T, Hkv*d] (this rank's heads) -> [T, Hq*d]."""
    t, d = q.shape[0], cfg.head_dim
    q, k, v = (a.reshape(t, -1, d).transpose(1, 0, 2) for a in (q, k, v))
    k = jnp.repeat(k, q.shape[0] // k.shape[0], axis=0)
    v = jnp.repeat(v, q.shape[0] // v.shape[0], axis=0)
    s = (q @ k.transpose(0, 2, 1)).astype(jnp.float32) * d ** -0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    return (p @ v).transpose(1, 0, 2).reshape(t, -1)


def _layers(cfg: Config, params, tokens, row_parallel):
    """The decoder; row_parallel(x, w) is the row-parallel projection and its all-reduce."""
    x = params["embed"][tokens]
    for lp in params["layers"]:
        h = rms_norm(x, lp["attn_norm"], cfg.eps)
        attn = _attention(cfg, h @ lp["wq"], h @ lp["wk"], h @ lp["wv"])
        x = x + row_parallel(attn, lp["wo"])
        h = rms_norm(x, lp["mlp_norm"], cfg.eps)
        x = x + row_parallel(jax.nn.silu(h @ lp["w_gate"]) * (h @ lp["w_up"]), lp["w_down"])
    return rms_norm(x, params["norm"], cfg.eps) @ params["head"]


def auto_forward(cfg: Config, row_parallel=None):
    """logits = f(params, tokens) in the auto-sharded style: plain matmuls
    (row_parallel=None: XLA's all-reduce) or the caller's row_parallel."""
    proj = row_parallel or (lambda x, w: x @ w)
    return jax.jit(functools.partial(_layers, cfg, row_parallel=proj))


def shard_map_forward(cfg: Config, mesh, axis: str = "tp"):
    """The same decoder in the explicit style: shard_map over the tp axis,
    `jax.lax.psum` after each row-parallel matmul (looked up at call time)."""
    def body(params, tokens):
        return _layers(cfg, params, tokens, lambda x, w: jax.lax.psum(x @ w, axis))

    def forward(params, tokens):
        specs = param_specs(params, axis)
        return jax.shard_map(body, mesh=mesh, in_specs=(specs, P()), out_specs=P())(params, tokens)

    return jax.jit(forward)


def shard(params, mesh, axis: str = "tp"):
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params,
                        param_specs(params, axis))


def greedy(forward, params, prompt, steps: int):
    """Greedy tokens (recomputing the whole sequence each step) and every step's logits."""
    tokens, logits = list(prompt), []
    for _ in range(steps):
        out = forward(params, jnp.asarray(tokens, jnp.int32))
        logits.append(jax.device_get(out[-1]))
        tokens.append(int(jnp.argmax(out[-1])))
    return tokens[len(prompt):], logits
