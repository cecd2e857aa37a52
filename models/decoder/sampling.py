"""Choosing the next token from the logits: greedy, or temperature / top-p sampling with a key
that lives in the decode state (so a seed reproduces the tokens, whatever loop runs the steps).

What an executable depends on is only the sampling's mode (MODES: greedy, temperature,
top_p); the temperature and top_p values are operands (the decode state holds them), so a new
temperature never compiles a new step."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

MODES = ("greedy", "temperature", "top_p")  # static: each compiles its own step


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (argmax, no randomness). Otherwise sample from
    softmax(logits / temperature) restricted to the smallest set of tokens whose probability
    reaches top_p (nucleus sampling; top_p=1: the whole vocabulary)."""

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

    @property
    def mode(self) -> str:
        """The static part (MODES): greedy steps carry no sort, top_p ones do."""
        if self.greedy:
            return "greedy"
        return "top_p" if self.top_p < 1.0 else "temperature"

    @classmethod
    def of_mode(cls, mode: str) -> "Sampling":
        """A Sampling of `mode` (for warming up its executables)."""
        if mode not in MODES:
            raise ValueError(f"sampling mode must be one of {MODES}, got {mode!r}")
        return {"greedy": cls(), "temperature": cls(1.0), "top_p": cls(1.0, 0.9)}[mode]


def key_data(seed: int) -> jax.Array:
    """The raw uint32 data of a PRNG key: the decode state holds raw data, not a typed key
    array, so every state leaf is a plain array (JAX's fast dispatch path needs that)."""
    return jax.random.key_data(jax.random.key(seed))


def next_token(logits: jax.Array, key: jax.Array, sampling, temperature: Optional[jax.Array] = None,
               top_p: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
    """logits [B, vocab] float32, key: raw key data; sampling: a Sampling or its mode (MODES),
    temperature/top_p: its values as arrays (default: the Sampling's). Returns (tokens [B]
    int32, new key data)."""
    mode = sampling.mode if isinstance(sampling, Sampling) else sampling
    if mode not in MODES:
        raise ValueError(f"sampling mode must be one of {MODES}, got {mode!r}")
    if mode == "greedy":
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), key
    if temperature is None:
        temperature = sampling.temperature
    if top_p is None:
        top_p = sampling.top_p if isinstance(sampling, Sampling) else 1.0
    key, sub = jax.random.split(jax.random.wrap_key_data(key))
    logits = logits / jnp.asarray(temperature, jnp.float32)
    if mode == "top_p":
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked higher
        keep = jnp.maximum(jnp.sum(before < jnp.asarray(top_p, jnp.float32), axis=-1), 1)  # >= 1
        threshold = jnp.take_along_axis(ordered, (keep - 1)[:, None], axis=-1)
        logits = jnp.where(logits >= threshold, logits, -jnp.inf)
    tokens = jax.random.categorical(sub, logits, axis=-1).astype(jnp.int32)
    return tokens, jax.random.key_data(key)
