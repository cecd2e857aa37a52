"""Random parameters for any model family, created directly sharded on the devices (no host copy,
so 8B bf16 is fine), with values that depend on (model, seed) only, not on the mesh. Made one
weight at a time (one jit per distinct weight shape, compiled once), so that a model quantized
as it is made (quantize="fp8") never exists dense as a whole."""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

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


def _salt(seed: int, i: int) -> int:
    """The hash salt of the i-th leaf (flattening order) of a model seeded `seed`."""
    return mix32(mix32(seed) + 0x632BE5AB * (i + 1))


@functools.lru_cache(maxsize=None)
def _leaf_init(shape: tuple, dtype: str, scale: float, kv_replicas: int, out_sharding) -> Callable:
    """The jitted init of one leaf, salt -> hash_uniform x scale as dtype, placed as
    out_sharding: compiled once per (shape, dtype, scale, replicas, sharding), the salt an
    argument (a model's repeated shapes, layer after layer, share one executable)."""
    def init(salt):
        w = hash_uniform(shape, salt) * scale
        return replicate_kv(w, kv_replicas).astype(dtype)

    return jax.jit(init, out_shardings=out_sharding)


@functools.lru_cache(maxsize=None)
def _plus_one(dtype: str, out_sharding) -> Callable:
    """1 + t as dtype, jitted apart from t's product: 1 + 0.1 u with the product rounded first
    (as one jit over the whole tree computed it; a jit of its own lets XLA:CPU fuse the two into
    one multiply-add, an ulp off)."""
    return jax.jit(lambda t: (1.0 + t).astype(dtype), out_shardings=out_sharding)


def random_params(abstract: dict, shardings: dict, seed: int,
                  fan_in: Mapping[str, Callable[[tuple], int]], kv_replicas: int = 1,
                  then: Optional[Callable[[str, jax.Array], Any]] = None) -> dict:
    """Random values for the parameter pytree `abstract` (ShapeDtypeStructs of the model itself,
    KV heads not replicated), placed as `shardings` (those of the tp layout). Linear weights
    (names in fan_in: name -> f(shape) -> fan-in) are uniform with std 1/sqrt(fan_in), RMSNorm
    gains ("weight") 1 +- 0.1, anything else (the embedding) std 1; never zero. The attention's
    packed qkv gets its KV heads copied kv_replicas times (sharding.replicate_kv).

    One weight at a time, each by its own jit (_leaf_init), so the peak beyond what is already
    made is one weight; then(name, weight), where given, replaces each weight as soon as it is
    made (quantize="fp8": its Fp8Weight, the dense weight deleted), so a model is never held
    dense as a whole. The values are those one jit over the whole tree made, bit for bit
    (tests/models/test_random_init.py)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    out = []
    for i, ((path, sds), sh) in enumerate(zip(leaves, treedef.flatten_up_to(shardings))):
        name = leaf_name(path)
        shape, dtype, salt = tuple(sds.shape), jnp.dtype(sds.dtype).name, np.uint32(_salt(seed, i))
        if name == "weight":  # an RMSNorm gain: 1 + 0.1 u
            w = _plus_one(dtype, sh)(_leaf_init(shape, "float32", 0.1, 1, sh)(salt))
        else:  # uniform with the target std
            std = fan_in[name](sds.shape) ** -0.5 if name in fan_in else 1.0
            w = _leaf_init(shape, dtype, std * 3 ** 0.5, kv_replicas if name == KV_PARAM else 1,
                           sh)(salt)
        out.append(w if then is None else then(name, w))
    return jax.tree_util.tree_unflatten(treedef, out)
