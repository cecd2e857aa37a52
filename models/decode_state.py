"""A decoder's per-step state on the device, its host mirrors, and the cache's capacity.

The state is a dict donated to every call, so XLA updates it in place and every buffer keeps
its address from step to step (a buffer that moves makes XLA:GPU re-record the step's command
buffer):

    cache  one array, every layer's keys and values: [layers, 2, B, capacity, kv_heads,
           head_dim] or [layers, 2, B, kv_heads, capacity, head_dim] (the options' kv_layout,
           sharding.cache_dims), split over the tp axis
    pos    int32, the next cache slot        tok   [B, 1] int32, the last token chosen
    done   [B] bool, a stop id was produced  eos   [MAX_STOP_IDS] int32, the stop ids (-1: none)
    key    uint32 raw PRNG key data          ar    all-reduce buffers (sifar_buffers), else {}
    start  [B] int32, each row's first slot  temp, top_p  float32, the sampling's values

The KV cache holds options.max_seq_len positions when given; otherwise it is sized to the
request (rounded up to a power of two), grown when a sequence outgrows it, never beyond
config.max_seq_len. Prompts of different lengths share a batch left-padded to one prompt bucket
(capacity.prompt_bucket): each row's `start` is its first real slot.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .capacity import MAX_STOP_IDS, attention_buckets, bucket_up, prompt_bucket
from .random_weights import hash_uniform, mix32
from .sampling import Sampling, key_data
from .sharding import cache_dims, cache_spec


@functools.partial(jax.jit, static_argnums=(1, 2), donate_argnums=0)
def _random_like(a, seed: int, sharding):
    """An array like `a` (the KV cache), uniform in (-1, 1), laid out as `sharding` (cheap to
    compile, and each device computes its own shard). Each layer (a's first axis) is hashed with
    a salt of its own: a flat index over the whole cache would wrap at 2**32 elements (Llama-8B
    at batch 8 and 16K positions has 2**33) and repeat the first layers' values."""
    layers = [hash_uniform(a.shape[1:], mix32(seed * 7919 + i)) for i in range(a.shape[0])]
    return jax.lax.with_sharding_constraint(jnp.stack(layers).astype(a.dtype), sharding)


class DecodeState:
    """The state dict (`arrays`), the cache's capacity, and the host's mirrors of the device
    state: pos (the next slot: picks buckets, checks bounds, never synced), step (the bucket
    limit and executable of the current step), last_tok (the last step's token copy)."""

    def __init__(self, config: Any, mesh, options, family, layout, buffers=None):
        self.config, self.mesh, self.options = config, mesh, options
        self.family, self.layout = family, layout
        self.rows = options.batch_size
        self.rep = NamedSharding(mesh, P())
        self.cache_sharding = NamedSharding(mesh, cache_spec(options.axis_name,
                                                             options.kv_layout))
        self._buffers = buffers  # sifar_buffers' two buffers, owned by the state once made
        self.arrays: Optional[dict] = None
        self.capacity = 0
        self.pos = 0
        self.step: tuple = (0, None)
        self.last_tok: Optional[jax.Array] = None
        self.sampling = Sampling()

    def put(self, value) -> jax.Array:
        return jax.device_put(np.asarray(value), self.rep)

    # ---- capacity -------------------------------------------------------------------------------

    def limit(self) -> int:
        return self.options.max_seq_len or self.config.max_seq_len

    def capacity_for(self, need: int) -> int:
        if need > self.limit():
            raise ValueError(f"sequence of {need} positions would exceed "
                             f"max_seq_len={self.limit()}")
        return self.options.max_seq_len or min(bucket_up(need), self.limit())

    def ensure_capacity(self, need: int) -> None:
        if need <= self.capacity:
            return
        new = self.capacity_for(need)
        if self.arrays is None:
            self.reset(need)
            return
        old = self.capacity
        # (a larger output cannot reuse the input)
        grow = jax.jit(lambda c: jnp.pad(c, [(0, new - old if d == "s" else 0)
                                             for d in cache_dims(self.options.kv_layout)]),
                       out_shardings=self.cache_sharding)
        cache, self.arrays["cache"] = self.arrays["cache"], None
        self.arrays["cache"] = grow(cache)
        self.capacity, self.step = new, (0, None)

    def bucket(self, end: int) -> int:
        """The attention length for a call that fills positions up to `end` (exclusive)."""
        self.ensure_capacity(end)
        return next(b for b in attention_buckets(self.capacity) if b >= end)

    def reset(self, capacity: Optional[int] = None) -> None:
        """Position 0, with a cache of at least `capacity` positions (kept if large enough:
        stale entries are masked and overwritten before they become visible)."""
        need = capacity or 1
        if self.arrays is None or self.capacity < need:
            size = self.capacity_for(need)
            ar = {}
            if self.arrays is not None:
                ar = self.arrays["ar"]
                self.arrays = None  # free the old cache before allocating the new one
            elif self._buffers is not None:
                ar, self._buffers = dict(self._buffers._asdict()), None  # the state owns them
            cache = self.family.init_cache(self.layout, self.mesh, self.rows, size,
                                           self.options.axis_name, self.options.kv_layout)
            self.arrays = {"cache": cache, "ar": ar}
            self.capacity = size
        b = self.rows
        self.arrays.update(
            pos=self.put(np.int32(0)), tok=self.put(np.zeros((b, 1), np.int32)),
            done=self.put(np.zeros(b, bool)), eos=self.put(self.stop_array(())),
            key=self.put(key_data(0)), start=self.put(np.zeros(b, np.int32)),
            temp=self.put(np.float32(0)), top_p=self.put(np.float32(1)))
        self.pos, self.step, self.last_tok = 0, (0, None), None

    def seek(self, position: int, token) -> None:
        """Continue from `position` of the current cache with `token` ([B]) as the last token."""
        self.ensure_capacity(position + 1)
        tok = self.check_ids(token).reshape(self.rows, 1)
        self.arrays.update(pos=self.put(np.int32(position)), tok=self.put(tok),
                           done=self.put(np.zeros(self.rows, bool)),
                           start=self.put(np.zeros(self.rows, np.int32)))
        self.pos, self.step, self.last_tok = position, (0, None), None

    def randomize_cache(self, seed: int = 0) -> None:
        if self.arrays is None:
            self.reset()
        self.arrays["cache"] = _random_like(self.arrays["cache"], seed, self.cache_sharding)

    # ---- a request's host values ----------------------------------------------------------------

    def check_ids(self, tokens) -> np.ndarray:
        """tokens as int32, or a ValueError naming the first id outside [0, vocab_size) (an id
        past the embedding table would be read as garbage, never as an error, on a device)."""
        tokens = np.asarray(tokens)
        if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got {tokens.dtype}")
        bad = (tokens < 0) | (tokens >= self.config.vocab_size)
        if bad.any():
            raise ValueError(f"token id {int(tokens[bad].flat[0])} is outside the vocabulary "
                             f"[0, {self.config.vocab_size})")
        return tokens.astype(np.int32)

    def _batch(self, tokens: np.ndarray, what: str) -> np.ndarray:
        if tokens.ndim == 1:
            tokens = tokens[None, :] if self.rows == 1 else tokens[:, None]
        if tokens.ndim != 2 or tokens.shape[0] != self.rows:
            raise ValueError(f"{what} of shape {tokens.shape}: expected [batch_size="
                             f"{self.rows}, T]")
        return tokens

    def tokens(self, tokens) -> jax.Array:
        """tokens [B, T] (or [T] for batch 1) checked and on the devices."""
        return self.put(self._batch(self.check_ids(tokens), "tokens"))

    def prompts(self, prompt) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [batch_size, T], lengths [batch_size]) of a prompt [B, T] (or [T] for batch
        1), or of B sequences of different lengths (a list: each row's tokens first, then
        zeros); ids checked."""
        if isinstance(prompt, (list, tuple)) and prompt and all(
                np.ndim(p) == 1 for p in prompt) and len({len(p) for p in prompt}) > 1:
            if len(prompt) != self.rows:
                raise ValueError(f"{len(prompt)} prompts for batch_size={self.rows}")
            rows = [self.check_ids(p) for p in prompt]
            lengths = np.array([len(r) for r in rows], np.int32)
            if not lengths.min():
                raise ValueError("empty prompt: a sequence needs at least one token")
            tokens = np.zeros((len(rows), lengths.max()), np.int32)
            for row, r in enumerate(rows):
                tokens[row, :len(r)] = r
            return tokens, lengths
        tokens = self._batch(self.check_ids(prompt), "prompt")
        if tokens.shape[1] == 0:
            raise ValueError("empty prompt: a sequence needs at least one token")
        return tokens, np.full(self.rows, tokens.shape[1], np.int32)

    def prompt_width(self, t: int, reserve: int) -> int:
        """The slots a prompt of t tokens takes: its bucket, or t itself where the bucket and
        the reserve would not fit the cache's limit (an executable of its own)."""
        width = prompt_bucket(t)
        return width if width + reserve <= self.limit() else t

    def stop_array(self, ids: tuple) -> np.ndarray:
        for e in ids:
            if not 0 <= e < self.config.vocab_size:
                raise ValueError(f"stop id {e} is outside the vocabulary [0, "
                                 f"{self.config.vocab_size})")
        return np.array(list(ids) + [-1] * (MAX_STOP_IDS - len(ids)), np.int32)

    def begin(self, prompt, stops: tuple, sampling: Sampling, seed: int,
              reserve: int) -> tuple[jax.Array, int]:
        """A new request's state: `prompt` left-padded to its width, the cache reset to hold it
        and `reserve` positions more, the stop ids and sampling values in the state. Returns
        (the padded prompt on the devices, its width)."""
        tokens, lengths = self.prompts(prompt)
        stop_arr = self.stop_array(stops)
        reserve = max(reserve, 1)
        width = self.prompt_width(tokens.shape[1], reserve)
        pad = width - lengths  # left padding: every row's last prompt token in slot width - 1
        padded = np.zeros((self.rows, width), np.int32)
        for row, (toks, n) in enumerate(zip(tokens, lengths)):
            padded[row, pad[row]:] = toks[:n]
        self.reset(width + reserve)
        self.sampling = sampling
        self.arrays.update(eos=self.put(stop_arr), key=self.put(key_data(seed)),
                           start=self.put(pad), temp=self.put(np.float32(sampling.temperature)),
                           top_p=self.put(np.float32(sampling.top_p)))
        return self.put(padded), width
