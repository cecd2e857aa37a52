"""Choosing the next token from the logits: greedy, or temperature / top-p sampling with a key
that lives in the decode state (so a seed reproduces the tokens, whatever loop runs the steps)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (argmax, no randomness). Otherwise sample from
    softmax(logits / temperature) restricted to the smallest set of tokens whose probability
    reaches top_p (nucleus sampling; top_p=1: the whole vocabulary).

    Static: each distinct Sampling compiles its own step (greedy steps carry no sort)."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def key_data(seed: int) -> jax.Array:
    """The raw uint32 data of a PRNG key: the decode state holds raw data, not a typed key
    array, so every state leaf is a plain array (JAX's fast dispatch path needs that)."""
    return jax.random.key_data(jax.random.key(seed))


def next_token(logits: jax.Array, key: jax.Array, sampling: Sampling) -> tuple[jax.Array, jax.Array]:
    """logits [B, vocab] float32, key: raw key data. Returns (tokens [B] int32, new key data)."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), key
    key, sub = jax.random.split(jax.random.wrap_key_data(key))
    logits = logits / jnp.float32(sampling.temperature)
    if sampling.top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked higher
        keep = jnp.maximum(jnp.sum(before < sampling.top_p, axis=-1), 1)  # >= 1 token
        threshold = jnp.take_along_axis(ordered, (keep - 1)[:, None], axis=-1)
        logits = jnp.where(logits >= threshold, logits, -jnp.inf)
    tokens = jax.random.categorical(sub, logits, axis=-1).astype(jnp.int32)
    return tokens, jax.random.key_data(key)
