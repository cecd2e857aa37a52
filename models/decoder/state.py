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

from ..core.sharding import cache_dims, cache_spec
from ..weights.random import hash_uniform, mix32
from .capacity import attention_buckets, bucket_up
from .prompts import as_batch, check_ids, left_pad, prompt_rows, prompt_width, stop_array
from .sampling import Sampling, key_data


@functools.partial(jax.jit, static_argnums=(1, 2), donate_argnums=0)
def _random_like(a, seed: int, sharding):
    """An array like `a` (the KV cache), uniform in (-1, 1), laid out as `sharding` (cheap to
    compile, and each device computes its own shard). Each layer (a's first axis) is hashed with
    a salt of its own: a flat index over the whole cache would wrap at 2**32 elements (Llama-8B
    at batch 8 and 16K positions has 2**33) and repeat the first layers' values."""
    layers = [hash_uniform(a.shape[1:], mix32(seed * 7919 + i)) for i in range(a.shape[0])]
    return jax.lax.with_sharding_constraint(jnp.stack(layers).astype(a.dtype), sharding)


class CacheState:
    """The state dict (`arrays`) and its KV cache's capacity: allocated, grown (never beyond
    the limit), filled with random values. step: the bucket limit and executable of the current
    step (a cache that grows invalidates it)."""

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
        self.step: tuple = (0, None)

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

    def allocate(self, need: int) -> None:
        """A cache of at least `need` positions, unless the one held is large enough (its stale
        entries are masked and overwritten before they become visible)."""
        if self.arrays is not None and self.capacity >= need:
            return
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

    def randomize_cache(self, seed: int = 0) -> None:
        if self.arrays is None:
            self.reset()
        self.arrays["cache"] = _random_like(self.arrays["cache"], seed, self.cache_sharding)


class DecodeState(CacheState):
    """CacheState, and the host's mirrors of the device state: pos (the next slot: picks
    buckets, checks bounds, never synced), last_tok (the last step's token copy), sampling."""

    def __init__(self, config: Any, mesh, options, family, layout, buffers=None):
        super().__init__(config, mesh, options, family, layout, buffers)
        self.pos = 0
        self.last_tok: Optional[jax.Array] = None
        self.sampling = Sampling()

    def reset(self, capacity: Optional[int] = None) -> None:
        """Position 0, with a cache of at least `capacity` positions (allocate)."""
        self.allocate(capacity or 1)
        b = self.rows
        self.arrays.update(
            pos=self.put(np.int32(0)), tok=self.put(np.zeros((b, 1), np.int32)),
            done=self.put(np.zeros(b, bool)), eos=self.put(stop_array((), self.config.vocab_size)),
            key=self.put(key_data(0)), start=self.put(np.zeros(b, np.int32)),
            temp=self.put(np.float32(0)), top_p=self.put(np.float32(1)))
        self.pos, self.step, self.last_tok = 0, (0, None), None

    def seek(self, position: int, token) -> None:
        """Continue from `position` of the current cache with `token` ([B]) as the last token."""
        self.ensure_capacity(position + 1)
        tok = check_ids(token, self.config.vocab_size).reshape(self.rows, 1)
        self.arrays.update(pos=self.put(np.int32(position)), tok=self.put(tok),
                           done=self.put(np.zeros(self.rows, bool)),
                           start=self.put(np.zeros(self.rows, np.int32)))
        self.pos, self.step, self.last_tok = position, (0, None), None

    # ---- a request's host values (prompts.py) ----------------------------------------------------

    def tokens(self, tokens) -> jax.Array:
        """tokens [B, T] (or [T] for batch 1) checked and on the devices."""
        return self.put(as_batch(check_ids(tokens, self.config.vocab_size), self.rows))

    def begin(self, prompt, stops: tuple, sampling: Sampling, seed: int,
              reserve: int) -> tuple[jax.Array, int]:
        """A new request's state: `prompt` left-padded to its width, the cache reset to hold it
        and `reserve` positions more, the stop ids and sampling values in the state. Returns
        (the padded prompt on the devices, its width)."""
        vocab = self.config.vocab_size
        tokens, lengths = prompt_rows(prompt, self.rows, vocab)
        stop_arr = stop_array(stops, vocab)
        reserve = max(reserve, 1)
        width = prompt_width(tokens.shape[1], reserve, self.limit())
        padded, pad = left_pad(tokens, lengths, width)
        self.reset(width + reserve)
        self.sampling = sampling
        self.arrays.update(eos=self.put(stop_arr), key=self.put(key_data(seed)),
                           start=self.put(pad), temp=self.put(np.float32(sampling.temperature)),
                           top_p=self.put(np.float32(sampling.top_p)))
        return self.put(padded), width
