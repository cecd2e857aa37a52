"""Random parameters for any model family, created directly sharded on the devices (no host copy,
so 8B bf16 is fine), with values that depend on (model, seed) only, not on the mesh."""

from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from ..core.attention import KV_PARAM
from ..core.sharding import leaf_name, replicate_kv


def mix32(x: int) -> int:
    """murmur3 finaliser on a Python int (host side: derives per-tensor salts)."""
    x &= 0xFFFFFFFF
    for m in (0x85EBCA6B, 0xC2B2AE35):
        x = ((x ^ (x >> 16)) * m) & 0xFFFFFFFF
    return x ^ (x >> 16)


def hash_uniform(shape, salt: int) -> jax.Array:
    """Uniform in (-1, 1), never 0, as a hash of each element's global index. Elementwise on an
    iota, so under jit with out_shardings every device computes only its own shard, the values do
    not depend on the sharding (same model at every TP size), and it compiles in well under a
    second (threefry over dozens of distinct shapes took seconds on XLA:CPU)."""
    idx = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for ax in reversed(range(len(shape))):  # row-major flat index (wraps past 2**32: harmless)
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, ax) * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= shape[ax]
    x = idx * jnp.uint32(0x9E3779B1) + jnp.uint32(salt)
    for m in (0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F):
        x = (x ^ (x >> 16)) * jnp.uint32(m)
    x = x ^ (x >> 15)
    return ((x >> 8).astype(jnp.float32) + 0.5) * (2.0 / 2 ** 24) - 1.0


def random_params(abstract: dict, shardings: dict, seed: int,
                  fan_in: Mapping[str, Callable[[tuple], int]], kv_replicas: int = 1) -> dict:
    """Random values for the parameter pytree `abstract` (ShapeDtypeStructs of the model itself,
    KV heads not replicated), placed as `shardings` (those of the tp layout). Linear weights
    (names in fan_in: name -> f(shape) -> fan-in) are uniform with std 1/sqrt(fan_in), RMSNorm
    gains ("weight") 1 +- 0.1, anything else (the embedding) std 1; never zero. The attention's
    packed qkv gets its KV heads copied kv_replicas times (sharding.replicate_kv)."""
    def init():
        leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        out = []
        for i, (path, sds) in enumerate(leaves):
            name = leaf_name(path)
            u = hash_uniform(sds.shape, mix32(mix32(seed) + 0x632BE5AB * (i + 1)))
            if name == "weight":  # RMSNorm gain
                w = 1.0 + 0.1 * u
            else:  # uniform with the target std
                std = fan_in[name](sds.shape) ** -0.5 if name in fan_in else 1.0
                w = u * (std * 3 ** 0.5)
            if name == KV_PARAM:
                w = replicate_kv(w, kv_replicas)
            out.append(w.astype(sds.dtype))
        return jax.tree_util.tree_unflatten(treedef, out)

    return jax.jit(init, out_shardings=shardings)()
