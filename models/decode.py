"""Decoding with the whole per-step state on the device, and loops that never idle the GPU.

The decode state is a dict donated to every call, so XLA updates it in place and every buffer keeps
its address from step to step (a buffer that moves makes XLA:GPU re-record the step's command
buffer; at 8B shapes a token passed in and out of the step measured ~0.7 ms more per waited step
on an H200 than a token kept in the state):

    cache  one array, every layer's keys and values: [layers, 2, B, capacity, kv_heads,
           head_dim] or [layers, 2, B, kv_heads, capacity, head_dim] (Decoder.kv_layout,
           sharding.cache_dims), split over the tp axis
    pos    int32, the next cache slot        tok   [B, 1] int32, the last token chosen
    done   [B] bool, a stop id was produced  eos   [MAX_STOP_IDS] int32, the stop ids (-1: none)
    key    uint32 raw PRNG key data          ar    all-reduce buffers (sifar_buffers), else {}
    start  [B] int32, each row's first slot  temp, top_p  float32, the sampling's values

B is Decoder.rows: batch_size, or min_rows where that is larger (the extra rows copy the last
sequence and are never returned).

A step is `state, token = step(param_leaves, state)`: no host input, no Python scalar;
`token` [B] is the chosen token again, written by the step to pinned host memory (where the
backend has it: then the step makes no new device buffer), which the host read in 10-45 us
where the state's device token took ~250-550 us on an H200 host: the waited loop's largest cost
after the device's step.
Its executable is compiled ahead of time (exact in/out shardings, so no call re-places or
re-checks anything) per cache capacity, attention bucket and sampling mode (greedy, temperature,
top_p: the values are in the state). Attention runs over the smallest bucket (a power of two >=
MIN_BUCKET, or the capacity) that holds the filled positions, so a step costs what the filled
length costs, not the whole cache.

Prompts are left-padded to a bucket (prompt_bucket: a power of two >= MIN_PROMPT_BUCKET), so a
prefill compiles once per bucket, not once per prompt length, and prompts of different lengths
share a batch: each row's `start` is its first real slot; the slots before it are never
attended to and its tokens keep the positions (rotary angles) of the prompt run alone
(attention.Step), so a row's tokens are those of its prompt alone. `Decoder.warmup(max_prompt_len,
max_new_tokens, ...)` compiles every executable a request within those limits can need, in
parallel; an executable compiled after it is logged and counted (compiles_after_warmup).

The loops (`Decoder.decode(n, loop=...)`; all give the same tokens):
    sync       one step, read its token, repeat: what a user writes first
    stream     steps run up to `in_flight` ahead of the host; each token is fetched with
               copy_to_host_async and yielded as soon as it is ready (Decoder.stream)
    pipelined  every step dispatched back to back, the tokens read at the end
    on_device  K steps per dispatch in a lax.fori_loop (a while_loop that stops once every
               sequence produced eos with early_exit=True), streamed chunk by chunk
A stop token is seen by the host a step or two late; the tokens after it are not yielded.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
from typing import Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .attention import check_attn_impl
from . import param_pack
from .family import ModelConfig, ModelFamily
from .families import family_of
from .transformer import fused_norm_scale
from .random_weights import hash_uniform, mix32
from .sharding import cache_dims, cache_spec, check_kv_layout, default_kv_layout
from .tp import ALLREDUCE_KINDS, FUSED_MODES, make_fused_add_norm
from .sampling import MODES, Sampling, key_data, next_token

log = logging.getLogger(__name__)

MIN_BUCKET = 64  # smallest attention bucket and smallest cache (positions)
MIN_PROMPT_BUCKET = 16  # shortest padded prompt
LOOPS = ("sync", "stream", "pipelined", "on_device")
ON_DEVICE_CHUNK = 16  # tokens per dispatch of the on_device loop
SIFAR_KINDS = ("sifar", "sifar_buffers")  # all-reduce kinds that run sifar_jax (and call init)
MAX_STOP_IDS = 8  # stop ids a request may give (Llama 3 instruct has 3): a fixed-size operand


def cache_reserve(max_new_tokens: int, loop: str, chunk: int = ON_DEVICE_CHUNK) -> int:
    """Cache positions a request of max_new_tokens needs after its prompt under `loop` (the
    on_device loop's last chunk may run past max_new_tokens)."""
    return max_new_tokens + (chunk if loop == "on_device" else 0)


def make_mesh(tp: int, axis_name: str = "tp", devices: Optional[Sequence] = None) -> Mesh:
    """1-D mesh over the first tp devices (tp=1 gives a 1-device mesh)."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < tp:
        raise ValueError(f"tp={tp} needs {tp} devices, only {len(devices)} available")
    return Mesh(np.array(devices[:tp]), (axis_name,))


def default_gemm_rows(mesh: Mesh) -> int:
    """The rows a batch-1 step's projections run with (tp.project): 2 on GPUs, where XLA:GPU
    streams a one-row projection's weights ~1.3x slower than a two-row one's (H200, TP=2 per-rank
    Llama-8B shapes, docs/performance.md); 1 elsewhere."""
    return 2 if mesh.devices.flat[0].platform == "gpu" else 1


def default_attn_impl(mesh: Mesh) -> str:
    """How a step of one token attends (attention.ATTN_IMPLS): "pallas" on GPUs (JAX's Pallas
    flash-decoding kernel: 4.240 -> 4.154-4.162 ms per Llama-8B step at KV 1K on one H200,
    models.pallas_attention), "xla" elsewhere (the kernel would run in Pallas' interpreter)."""
    return "pallas" if mesh.devices.flat[0].platform == "gpu" else "xla"


def bucket_up(n: int) -> int:
    """The smallest power of two >= n, at least MIN_BUCKET."""
    b = MIN_BUCKET
    while b < n:
        b *= 2
    return b


def prompt_bucket(n: int) -> int:
    """The length a prompt of n tokens is left-padded to: the smallest power of two >= n, at
    least MIN_PROMPT_BUCKET."""
    b = MIN_PROMPT_BUCKET
    while b < n:
        b *= 2
    return b


def prompt_buckets(max_prompt_len: int) -> list[int]:
    """Every prompt bucket of prompts up to max_prompt_len tokens."""
    out = [MIN_PROMPT_BUCKET]
    while out[-1] < max_prompt_len:
        out.append(out[-1] * 2)
    return out


def attention_buckets(capacity: int) -> list[int]:
    """The attention lengths a cache of `capacity` positions compiles steps for."""
    out, b = [], MIN_BUCKET
    while b < capacity:
        out.append(b)
        b *= 2
    return out + [capacity]


def _host_memory_kind(mesh: Mesh) -> str:
    """"pinned_host" where this backend's devices have it (a result XLA writes to host memory
    the host reads without a device-to-host copy of its own), else "device"."""
    kinds = {m.kind for m in mesh.local_devices[0].addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else "device"


def _host(a) -> np.ndarray:
    """A replicated array's value on the host: every process holds it whole (with one process per
    GPU, np.asarray refuses an array that spans other processes' devices)."""
    return np.asarray(a if a.is_fully_addressable else a.addressable_data(0))


def _with_token(state: dict):
    """A step's outputs: its state and its token [B] again, as a result of its own (written to
    the decoder's _tok_sharding: pinned host memory where the backend has it)."""
    return state, state["tok"][:, 0]


@jax.jit
def _peek(tok):
    """A fresh copy of the state's token [B, 1] as [B] (the state's own buffer is donated)."""
    return tok[:, 0]


@functools.partial(jax.jit, static_argnums=(1, 2), donate_argnums=0)
def _random_like(a, seed: int, sharding):
    """An array like `a` (the KV cache), uniform in (-1, 1), laid out as `sharding` (cheap to
    compile, and each device computes its own shard). Each layer (a's first axis) is hashed with
    a salt of its own: a flat index over the whole cache would wrap at 2**32 elements (Llama-8B
    at batch 8 and 16K positions has 2**33) and repeat the first layers' values."""
    layers = [hash_uniform(a.shape[1:], mix32(seed * 7919 + i)) for i in range(a.shape[0])]
    return jax.lax.with_sharding_constraint(jnp.stack(layers).astype(a.dtype), sharding)


def stop_ids(eos_id) -> tuple[int, ...]:
    """eos_id (None, an id, or a sequence of ids) as a tuple of ids."""
    if eos_id is None:
        return ()
    ids = tuple(int(e) for e in (np.ravel(eos_id) if np.ndim(eos_id) else [eos_id]))
    if len(ids) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS} stop ids, got {len(ids)}")
    return ids


@dataclasses.dataclass
class _StopAt:
    """Host side of the stop ids: True once every sequence has produced one."""

    eos: tuple
    done: np.ndarray

    def seen(self, tok: np.ndarray) -> bool:
        if not self.eos:
            return False
        self.done |= np.isin(tok, self.eos)
        return bool(self.done.all())


class Decoder:
    """Prefill and decode for one batch of equal-length sequences of a model of `family`
    (models.families.family_of(config) by default: the family whose config type it is).

    allreduce: "psum", "sifar" (calls sifar_jax.init(mesh, slot_bytes=slot_bytes)),
    "sifar_buffers" (sifar with explicit dual buffers carried in the decode state) or "identity"
    (no all-reduce: wrong numbers, the timing upper bound). fused=True (sifar only): all-reduce,
    residual add and RMSNorm as one sifar_jax.psum_add_rmsnorm call, prefetching the first
    prefetch_bytes of the next matmul's weight into L2 while it waits (None: sifar_jax's default,
    0: none).

    The KV cache holds max_seq_len positions when given; otherwise it is sized to the request
    (prompt + max_new_tokens, rounded up to a power of two), grown when a sequence outgrows it,
    never beyond config.max_seq_len. A prefill's all-reduce payload is batch x prompt x hidden:
    past sifar's slot it falls back to lax.psum with algorithm="auto" (and raises with a named
    algorithm); raise slot_bytes to keep it on sifar. kv_layout: "bshd" or "bhsd"
    (sharding.KV_LAYOUTS), by default the one the platform updates in place
    (sharding.default_kv_layout). min_rows: run at least this many rows (sequences) on the device,
    the extra ones copies of the last real one, never returned: on an H200, XLA:GPU ran a
    batch-1 step at TP=2's per-rank shapes 20% slower than a batch-2 step (its matmuls for one
    row; docs/performance.md): min_rows=2 made batch-1 decoding 17% faster there. XLA may then pick
    other matmul kernels, whose bf16 rounding can flip a greedy token where two logits nearly
    tie (as any change of batch can); sampled tokens also depend on the row count (the random
    draws are per row). gemm_rows: the cheaper form of the same gain: only a single row's
    projections run as that many rows (tp.project), attention and the cache keep one row
    (None: default_gemm_rows, 2 on GPUs). attn_impl: how a step of one token attends
    (attention.ATTN_IMPLS; None: default_attn_impl, "pallas" on GPUs). compiler_options: XLA
    options every prefill, step and chunk executable is compiled with (`Lowered.compile`), e.g.
    {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"} (docs/performance.md: 0.05-1.3% on
    one H200, not verified with sifar on two GPUs, so not the default). pack_params (None:
    True): pass the small replicated vectors (the norm scales) as one array per dtype
    (models/param_pack.py): fewer arguments per call, a shorter waited step; when fused, the
    norm scales the fused call takes stay arrays of their own (a custom call's operand).
    """

    def __init__(self, config: ModelConfig, mesh: Mesh, params, *,
                 family: Optional[ModelFamily] = None, allreduce: str = "psum",
                 algorithm: str = "auto", fused=False, slot_bytes: Optional[int] = None,
                 axis_name: str = "tp", batch_size: int = 1, max_seq_len: Optional[int] = None,
                 kv_layout: Optional[str] = None, min_rows: int = 1,
                 prefetch_bytes: Optional[int] = None, gemm_rows: Optional[int] = None,
                 attn_impl: Optional[str] = None, compiler_options: Optional[dict] = None,
                 pack_params: Optional[bool] = None):
        if allreduce not in ALLREDUCE_KINDS:
            raise ValueError(f"allreduce must be one of {ALLREDUCE_KINDS}, got {allreduce!r}")
        if slot_bytes is not None and allreduce not in SIFAR_KINDS:
            raise ValueError(f"slot_bytes is sifar's slot size; allreduce={allreduce!r} has none")
        self.config = config
        self.family = family_of(config) if family is None else family
        self.mesh = mesh
        self.axis_name = axis_name
        self.batch_size = batch_size
        if min_rows < 1:
            raise ValueError(f"min_rows must be >= 1, got {min_rows}")
        if gemm_rows is None:
            gemm_rows = default_gemm_rows(mesh)
        if gemm_rows < 1:
            raise ValueError(f"gemm_rows must be >= 1, got {gemm_rows}")
        self.gemm_rows = gemm_rows
        self.attn_impl = attn_impl or default_attn_impl(mesh)
        check_attn_impl(self.attn_impl)
        self.rows = max(batch_size, min_rows)  # rows on the device: batch_size real, then copies
        self.max_seq_len = max_seq_len  # None: sized per request
        self.tp = mesh.shape[axis_name]
        self.kv_layout = kv_layout or default_kv_layout(mesh)
        check_kv_layout(self.kv_layout)
        self.layout = self.family.layout(config, self.tp)  # raises if tp does not split the model
        if fused not in FUSED_MODES:
            raise ValueError(f"fused must be one of {FUSED_MODES}, got {fused!r}")
        if fused:  # a clear error now, not at trace
            make_fused_add_norm(allreduce, algorithm, prefetch_bytes)
        elif prefetch_bytes:
            raise ValueError("prefetch_bytes is the fused call's (fused=True)")
        self._buffers = None
        ar_specs = None
        if allreduce in SIFAR_KINDS:
            import sifar_jax  # lazily: the models work without the extension built

            sifar_jax.init(mesh, slot_bytes=slot_bytes)
            if allreduce == "sifar_buffers":
                self._buffers = sifar_jax.make_buffers(mesh, axis_name)
                spec = sifar_jax.buffer_spec(mesh)
                ar_specs = {"a": spec, "b": spec}
        self._fwd_kw = dict(allreduce=allreduce, algorithm=algorithm, fused=fused,
                            prefetch_bytes=prefetch_bytes, axis_name=axis_name, ar_specs=ar_specs,
                            kv_layout=self.kv_layout, gemm_rows=gemm_rows,
                            attn_impl=self.attn_impl)
        if compiler_options is not None and not isinstance(compiler_options, dict):
            raise TypeError(f"compiler_options must be a dict of XLA options, got "
                            f"{type(compiler_options).__name__}")
        self.compiler_options = dict(compiler_options or {})
        self.params = self._place(params)
        # flattened once: every call passes this list (no per-call flattening of a nested dict)
        paths, self._treedef = jax.tree_util.tree_flatten_with_path(self.params)
        leaves = [a for _, a in paths]
        self.pack_params = True if pack_params is None else bool(pack_params)
        # the small replicated vectors (norm scales) as one array per dtype: fewer arguments
        # per call (models/param_pack.py); fused, the norm scales the fused call takes stay
        # arrays of their own (a custom call's operand: XLA would copy a slice of the pack)
        keep = [bool(fused) and fused_norm_scale(path) for path, _ in paths]
        self._pack, self._leaves = (param_pack.pack(leaves, mesh, keep=keep)
                                    if self.pack_params else (None, leaves))
        self._rep = NamedSharding(mesh, P())
        # Each step also writes its token [rows] to pinned host memory where the backend has it:
        # on an H200 host reading a 4-byte result took ~250-550 us from device memory and 10-45
        # us from pinned host memory (bench.probes.dispatch_cost, waited_step), a waited step's
        # largest cost after the device's.
        self._tok_sharding = NamedSharding(mesh, P(), memory_kind=_host_memory_kind(mesh))
        self._cache_sharding = NamedSharding(mesh, cache_spec(axis_name, self.kv_layout))
        self._forwards: dict = {}
        self._executables: dict = {}
        self.warmed: Optional[dict] = None  # the limits of the last warmup()
        self.compiles_after_warmup = 0  # executables compiled since, each logged
        self.sampling = Sampling()
        self.state: Optional[dict] = None
        self._capacity = 0
        self._pos = 0  # host mirror of state["pos"]: picks buckets, checks bounds, never synced
        self._step = (0, None)  # (bucket limit, executable) of the current step
        self._last_tok: Optional[jax.Array] = None  # the last step's token copy (_tok_sharding)

    def _place(self, params):
        _, abstract = self.family.abstract_model(self.layout)
        got = jax.tree.map(lambda a: tuple(a.shape), params)
        want = jax.tree.map(lambda a: tuple(a.shape), abstract)
        if got != want:
            raise ValueError(f"params do not have the shapes of the tp={self.tp} layout (KV heads "
                             f"replicated when tp > num_kv_heads): make them for this mesh with "
                             f"the family's random_params or load_hf_checkpoint")
        # a no-op for arrays already placed as the layout says
        return jax.device_put(params, self.family.param_shardings(self.config, self.mesh,
                                                                  self.axis_name))

    # ---- state -----------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Positions the KV cache holds now (0 before the first sequence)."""
        return self._capacity

    def _put(self, value) -> jax.Array:
        return jax.device_put(np.asarray(value), self._rep)

    def _capacity_for(self, need: int) -> int:
        cap = self.max_seq_len or self.config.max_seq_len
        if need > cap:
            raise ValueError(f"sequence of {need} positions would exceed max_seq_len={cap}")
        return self.max_seq_len or min(bucket_up(need), cap)

    def _ensure_capacity(self, need: int) -> None:
        if need <= self._capacity:
            return
        new = self._capacity_for(need)
        if self.state is None:
            self.reset(need)
            return
        old = self._capacity
        # (a larger output cannot reuse the input)
        grow = jax.jit(lambda c: jnp.pad(c, [(0, new - old if d == "s" else 0)
                                             for d in cache_dims(self.kv_layout)]),
                       out_shardings=self._cache_sharding)
        cache, self.state["cache"] = self.state["cache"], None
        self.state["cache"] = grow(cache)
        self._capacity, self._step = new, (0, None)

    def reset(self, capacity: Optional[int] = None) -> None:
        """Start a new sequence at position 0, with a cache of at least `capacity` positions
        (kept if it is large enough: stale entries are masked and overwritten before they
        become visible)."""
        need = capacity or 1
        if self.state is None or self._capacity < need:
            size = self._capacity_for(need)
            ar = {}
            if self.state is not None:
                ar = self.state["ar"]
                self.state = None  # free the old cache before allocating the new one
            elif self._buffers is not None:
                ar, self._buffers = dict(self._buffers._asdict()), None  # the state owns them
            cache = self.family.init_cache(self.config, self.mesh, self.rows, size,
                                           self.axis_name, self.kv_layout)
            self.state = {"cache": cache, "ar": ar}
            self._capacity = size
        b = self.rows
        self.state.update(pos=self._put(np.int32(0)), tok=self._put(np.zeros((b, 1), np.int32)),
                          done=self._put(np.zeros(b, bool)), eos=self._put(self._stop_array(())),
                          key=self._put(key_data(0)), start=self._put(np.zeros(b, np.int32)),
                          temp=self._put(np.float32(0)), top_p=self._put(np.float32(1)))
        self._pos, self._step, self._last_tok = 0, (0, None), None

    def seek(self, position: int, token) -> None:
        """Continue from `position` of the current cache (taken as the context, as it is) with
        `token` ([B] ints) as the last token. For benchmarks: a context without a prefill."""
        self._ensure_capacity(position + 1)
        tok = self._padded(self._check_ids(token).reshape(self.batch_size, 1))
        self.state.update(pos=self._put(np.int32(position)), tok=self._put(tok),
                          done=self._put(np.zeros(self.rows, bool)),
                          start=self._put(np.zeros(self.rows, np.int32)))
        self._pos, self._step, self._last_tok = position, (0, None), None

    def randomize_cache(self, seed: int = 0) -> None:
        """Fill the whole KV cache with random values in (-1, 1) (for benchmarks, with seek)."""
        if self.state is None:
            self.reset()
        self.state["cache"] = _random_like(self.state["cache"], seed, self._cache_sharding)

    def _check_ids(self, tokens: np.ndarray) -> np.ndarray:
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

    def _tokens(self, tokens) -> jax.Array:
        tokens = self._check_ids(tokens)
        if tokens.ndim == 1:
            tokens = tokens[None, :] if self.batch_size == 1 else tokens[:, None]
        if tokens.ndim != 2 or tokens.shape[0] != self.batch_size:
            raise ValueError(f"tokens of shape {tokens.shape}: expected [batch_size="
                             f"{self.batch_size}, T]")
        return self._put(self._padded(tokens))

    def _prompts(self, prompt) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [batch_size, T], lengths [batch_size]) of a prompt [B, T] (or [T] for batch
        1), or of B sequences of different lengths (a list: each row's tokens first, then
        zeros); ids checked."""
        if isinstance(prompt, (list, tuple)) and prompt and all(
                np.ndim(p) == 1 for p in prompt) and len({len(p) for p in prompt}) > 1:
            if len(prompt) != self.batch_size:
                raise ValueError(f"{len(prompt)} prompts for batch_size={self.batch_size}")
            rows = [self._check_ids(p) for p in prompt]
            lengths = np.array([len(r) for r in rows], np.int32)
            if not lengths.min():
                raise ValueError("empty prompt: a sequence needs at least one token")
            tokens = np.zeros((len(rows), lengths.max()), np.int32)
            for row, r in enumerate(rows):
                tokens[row, :len(r)] = r
            return tokens, lengths
        tokens = self._check_ids(prompt)
        if tokens.ndim == 1:
            tokens = tokens[None, :] if self.batch_size == 1 else tokens[:, None]
        if tokens.ndim != 2 or tokens.shape[0] != self.batch_size:
            raise ValueError(f"prompt of shape {tokens.shape}: expected [batch_size="
                             f"{self.batch_size}, T]")
        if tokens.shape[1] == 0:
            raise ValueError("empty prompt: a sequence needs at least one token")
        return tokens, np.full(self.batch_size, tokens.shape[1], np.int32)

    def _limit(self) -> int:
        return self.max_seq_len or self.config.max_seq_len

    def _prompt_width(self, t: int, reserve: int) -> int:
        """The slots a prompt of t tokens takes: its bucket, or t itself where the bucket and
        the reserve would not fit the cache's limit (an executable of its own)."""
        width = prompt_bucket(t)
        return width if width + reserve <= self._limit() else t

    def _padded(self, rows: np.ndarray) -> np.ndarray:
        """[batch_size, ...] host values -> [rows, ...]: the last real row repeated."""
        extra = self.rows - rows.shape[0]
        return np.concatenate([rows, np.repeat(rows[-1:], extra, axis=0)]) if extra else rows

    # ---- executables -------------------------------------------------------------------------

    def _forward(self, attend_len: int, last_only: bool):
        key = (attend_len, last_only)
        if key not in self._forwards:
            self._forwards[key] = self.family.make_forward(
                self.config, self.mesh, last_only=last_only, attend_len=attend_len, **self._fwd_kw)
        return self._forwards[key]

    def _bucket(self, end: int) -> int:
        """The attention length for a call that fills positions up to `end` (exclusive)."""
        self._ensure_capacity(end)
        return next(b for b in attention_buckets(self._capacity) if b >= end)

    def _append(self, leaves, state, tokens, attend_len: int, mode: str) -> dict:
        """Run tokens [B, T] at state["pos"]; choose the next token from the last logits
        (sampling mode `mode`, its values from the state)."""
        params = self._unflatten(leaves)
        t = tokens.shape[1]
        positions = state["pos"] + jnp.arange(t, dtype=jnp.int32)
        logits, cache, ar = self._forward(attend_len, True)(params, state["cache"], tokens,
                                                            positions, state["ar"], state["start"])
        nxt, key = next_token(logits[:, -1], state["key"], mode, state["temp"], state["top_p"])
        nxt = jnp.where(state["done"], state["tok"][:, 0], nxt)  # a finished row repeats its stop
        return dict(state, cache=cache, ar=ar, pos=state["pos"] + t, tok=nxt[:, None], key=key,
                    done=state["done"] | jnp.any(nxt[:, None] == state["eos"][None, :], axis=1))

    def _unflatten(self, leaves) -> dict:
        """The params tree from the arrays a call takes (packed ones unpacked: static slices)."""
        if self._pack is not None:
            leaves = param_pack.unpack(self._pack, leaves)
        return jax.tree.unflatten(self._treedef, leaves)

    def _lower(self, fn, *args, outputs=()) -> "jax.stages.Lowered":
        """fn(leaves, state, *args) lowered with the state donated and its shardings fixed on
        the way in and out; `outputs`: shardings of further outputs; args: arrays or
        ShapeDtypeStructs with shardings."""
        shardings = lambda tree: jax.tree.map(lambda a: a.sharding, tree)  # noqa: E731
        state_sh = shardings(self.state)
        out_sh = (state_sh, *outputs) if outputs else state_sh
        jitted = jax.jit(fn, donate_argnums=(1,), out_shardings=out_sh,
                         in_shardings=(shardings(self._leaves), state_sh,
                                       *(shardings(a) for a in args)))
        return jitted.lower(self._leaves, self.state, *args)

    def _compile(self, key, fn, *args, outputs=()):
        """The executable `key`, compiled ahead of time (see _lower) on first use. After a
        warmup() a compile is logged and counted: the request is outside the warmed limits."""
        exe = self._executables.get(key)
        if exe is None:
            if self.warmed is not None:
                self.compiles_after_warmup += 1
                log.warning("compiling %s %s: outside the limits of warmup(%s)", key[0], key[2:],
                            ", ".join(f"{k}={v}" for k, v in self.warmed.items()))
            exe = self._executables[key] = self._finish(self._lower(fn, *args, outputs=outputs))
        return exe

    def _finish(self, lowered: "jax.stages.Lowered") -> "jax.stages.Compiled":
        """A lowered executable compiled with this decoder's compiler_options."""
        return lowered.compile(compiler_options=self.compiler_options or None)

    # Each executable as (key, fn, args, outputs) for _compile; warmup() compiles them ahead.

    def _step_spec(self, n: int, mode: str):
        return (("step", self._capacity, n, mode),
                lambda p, st: _with_token(self._append(p, st, st["tok"], n, mode)), (),
                (self._tok_sharding,))

    def _prefill_spec(self, n: int, width: int, mode: str):
        tokens = jax.ShapeDtypeStruct((self.rows, width), jnp.int32, sharding=self._rep)
        return (("prefill", self._capacity, n, width, mode),
                lambda p, st, toks: _with_token(self._append(p, st, toks, n, mode)), (tokens,),
                (self._tok_sharding,))

    def _chunk_spec(self, n: int, mode: str, k: int, early_exit: bool):
        b = self.rows

        def chunk(leaves, state):
            def body(i, carry):
                st, toks = carry
                st = self._append(leaves, st, st["tok"], n, mode)
                return st, jax.lax.dynamic_update_slice(toks, st["tok"], (0, i))

            toks = jnp.full((b, k), state["eos"][0], jnp.int32)
            if not early_exit:
                return jax.lax.fori_loop(0, k, body, (state, toks))
            _, state, toks = jax.lax.while_loop(
                lambda c: (c[0] < k) & ~jnp.all(c[1]["done"]),
                lambda c: (c[0] + 1, *body(c[0], (c[1], c[2]))), (jnp.int32(0), state, toks))
            return state, toks

        return ("chunk", self._capacity, n, mode, k, early_exit), chunk, (), (self._tok_sharding,)

    def _compile_spec(self, spec):
        key, fn, args, outputs = spec
        return self._compile(key, fn, *args, outputs=outputs)

    def compiled_step(self) -> "jax.stages.Compiled":
        """The executable the next step runs (for inspection: .as_text())."""
        limit, exe = self._step
        if self._pos + 1 > limit:
            n = self._bucket(self._pos + 1)
            exe = self._compile_spec(self._step_spec(n, self.sampling.mode))
            self._step = (n, exe)
        return exe

    def compiled_chunk(self, k: int, early_exit: bool = False) -> "jax.stages.Compiled":
        """The executable of k steps in one dispatch from the current position:
        (leaves, state) -> (state, tokens [B, k]). fori_loop, or with early_exit a while_loop
        that stops once every sequence has produced a stop id (unrun steps' tokens are the
        first stop id)."""
        n = self._bucket(self._pos + k)
        return self._compile_spec(self._chunk_spec(n, self.sampling.mode, k, early_exit))

    def warmup(self, max_prompt_len: int, max_new_tokens: int, *,
               sampling: Sequence = ("greedy",), loops: Sequence[str] = ("stream",),
               chunk: int = ON_DEVICE_CHUNK, early_exit: bool = False,
               threads: Optional[int] = None) -> dict:
        """Compile every executable a request of up to max_prompt_len prompt tokens and
        max_new_tokens new ones can need, with the sampling modes (MODES, or Samplings) and
        loops given: the prefill of each prompt bucket, the step (or the on_device loop's chunk
        of `chunk` steps) of each attention bucket. Sizes the KV cache for the largest request
        and keeps it, so no smaller request reallocates it. Traces them one by one, then
        compiles them on `threads` threads (XLA compiles without the GIL; default: one per CPU).
        Ends with a short run of each loop and mode (the small helper programs they call).
        After it, an executable compiled for a request outside these limits is logged and
        counted (compiles_after_warmup). Returns {"executables": compiled now, "seconds": ...}."""
        t0 = time.perf_counter()
        modes = sorted({m.mode if isinstance(m, Sampling) else m for m in sampling})
        for m in modes:
            if m not in MODES:
                raise ValueError(f"sampling mode must be one of {MODES} (or a Sampling), got {m!r}")
        for loop in loops:
            if loop not in LOOPS:
                raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
        if max_prompt_len < 1 or max_new_tokens < 1:
            raise ValueError(f"warmup needs max_prompt_len >= 1 and max_new_tokens >= 1, got "
                             f"{max_prompt_len}, {max_new_tokens}")
        reserve = max_new_tokens + (chunk if "on_device" in loops else 0)
        widest = prompt_bucket(max_prompt_len)
        if widest + reserve > self._limit():
            raise ValueError(f"warmup: a {widest}-slot prompt bucket + {reserve} new tokens "
                             f"exceed max_seq_len={self._limit()}")
        self.warmed = None
        self.reset(widest + reserve)
        specs = []
        for mode in modes:
            specs += [self._prefill_spec(self._bucket(w), w, mode)
                      for w in prompt_buckets(max_prompt_len)]
            for n in attention_buckets(self._capacity):
                if "on_device" in loops:
                    specs.append(self._chunk_spec(n, mode, chunk, early_exit))
                if set(loops) - {"on_device"}:
                    specs.append(self._step_spec(n, mode))
        todo = {}
        for key, fn, args, outputs in specs:
            if key not in self._executables and key not in todo:
                todo[key] = self._lower(fn, *args, outputs=outputs)
        workers = max(1, min(len(todo), threads or os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for key, exe in zip(todo, pool.map(self._finish, todo.values())):
                self._executables[key] = exe
        executed = 0
        for mode in modes:
            s = Sampling.of_mode(mode)
            for loop in loops:
                self.generate(np.zeros((self.batch_size, 1), np.int32), 2, loop=loop, chunk=chunk,
                              early_exit=early_exit, temperature=s.temperature, top_p=s.top_p)
            # An executable's first run on a GPU also records its command buffer (a CUDA graph):
            # 37 ms at each attention-bucket crossing at 8B shapes on an H200, measured. So every
            # prefill and step executable runs once here, not at a request's first use of it.
            for w in prompt_buckets(max_prompt_len):
                self.generate(np.zeros((self.batch_size, w), np.int32), 1,
                              temperature=s.temperature, top_p=s.top_p)
                executed += 1
            zeros = np.zeros(self.batch_size, np.int32)
            for n in attention_buckets(self._capacity):
                if set(loops) - {"on_device"}:
                    self.seek(n - 1, zeros)  # the step writing slot n - 1 attends over n slots
                    self.advance(1)
                    executed += 1
                if "on_device" in loops and n >= chunk:
                    self.seek(n - chunk, zeros)
                    self.advance_on_device(chunk, early_exit)
                    executed += 1
            self.token()
        self.warmed = dict(max_prompt_len=max_prompt_len, max_new_tokens=max_new_tokens,
                           sampling=tuple(modes), loops=tuple(loops))
        return {"executables": len(todo), "executed": executed,
                "seconds": time.perf_counter() - t0}

    # ---- steps --------------------------------------------------------------------------------

    def prefill(self, tokens) -> jax.Array:
        """Append tokens [B, T] (or [T] for batch 1) to the sequence; logits [B, T, vocab].
        (The logits path: the sampled token in the state is left as it was.)"""
        if self.state is None:
            self.reset()
        tokens = self._tokens(tokens)
        t = tokens.shape[1]
        n = self._bucket(self._pos + t)

        def logits_fn(leaves, state, toks):
            params = self._unflatten(leaves)
            positions = state["pos"] + jnp.arange(t, dtype=jnp.int32)
            logits, cache, ar = self._forward(n, False)(params, state["cache"], toks, positions,
                                                        state["ar"], state["start"])
            return dict(state, cache=cache, ar=ar, pos=state["pos"] + t), logits

        exe = self._compile(("logits", self._capacity, n, t), logits_fn, tokens,
                            outputs=(NamedSharding(self.mesh, P(None, None, self.axis_name)),))
        self.state, logits = exe(self._leaves, self.state, tokens)
        self._pos += t
        return logits if self.rows == self.batch_size else logits[: self.batch_size]

    def step(self, token) -> jax.Array:
        """Append one token per sequence ([B] or [B, 1]); logits [B, vocab]."""
        return self.prefill(np.asarray(token, np.int32).reshape(self.batch_size, 1))[:, 0]

    def _stop_array(self, ids: tuple) -> np.ndarray:
        for e in ids:
            if not 0 <= e < self.config.vocab_size:
                raise ValueError(f"stop id {e} is outside the vocabulary [0, "
                                 f"{self.config.vocab_size})")
        return np.array(list(ids) + [-1] * (MAX_STOP_IDS - len(ids)), np.int32)

    def start(self, prompt, eos_id=None, *, temperature: float = 0.0,
              top_p: float = 1.0, seed: int = 0, reserve: int = 1) -> None:
        """New sequences: prefill `prompt` ([B, T], or [T] for batch 1, or a list of B token
        sequences of different lengths), each row left-padded to the bucket of the longest
        (prompt_bucket), and choose the first new tokens (in the state, not yet read). Each
        row's tokens are those of its prompt run alone (greedy; see the module docstring).
        The cache holds at least the padded prompt + reserve positions."""
        tokens, lengths = self._prompts(prompt)
        stops = self._stop_array(stop_ids(eos_id))
        sampling = Sampling(temperature, top_p)
        reserve = max(reserve, 1)
        width = self._prompt_width(tokens.shape[1], reserve)
        pad = width - lengths  # left padding: every row's last prompt token in slot width - 1
        padded = np.zeros((self.batch_size, width), np.int32)
        for row, (toks, n) in enumerate(zip(tokens, lengths)):
            padded[row, pad[row]:] = toks[:n]
        self.reset(width + reserve)
        self.sampling = sampling
        self.state.update(eos=self._put(stops),
                          key=self._put(key_data(seed)), start=self._put(self._padded(pad)),
                          temp=self._put(np.float32(temperature)),
                          top_p=self._put(np.float32(top_p)))
        exe = self._compile_spec(self._prefill_spec(self._bucket(width), width, sampling.mode))
        self.state, self._last_tok = exe(self._leaves, self.state,
                                         self._put(self._padded(padded)))
        self._pos = width

    def prefill_allreduce(self, prompt_len: int) -> str:
        """Which all-reduce a prefill of prompt_len tokens (padded to its bucket) runs: the
        decoder's, or for sifar "psum (fallback: ...)" where its payload (rows x padded prompt
        x hidden) does not fit sifar's slot (algorithm "auto" hands it to lax.psum; a named
        algorithm raises instead)."""
        kind = self._fwd_kw["allreduce"]
        if kind not in SIFAR_KINDS:
            return kind
        import sifar_jax

        dtype = jnp.dtype(self.config.dtype)
        if dtype not in sifar_jax.SUPPORTED_DTYPES:
            return f"psum (fallback: sifar does not reduce {dtype.name})"
        payload = self.rows * prompt_bucket(prompt_len) * self.config.hidden_size * dtype.itemsize
        slots = [c.slot_bytes for c in sifar_jax.communicators(self.axis_name)]
        if slots and -(-payload // 16) * 16 > min(slots):
            return f"psum (fallback: a {payload} B payload > sifar's {min(slots)} B slot)"
        return kind

    def advance(self, n: int = 1) -> None:
        """Dispatch n steps (nothing is read back; the steps run as the device gets to them)."""
        for _ in range(n):
            limit, exe = self._step
            if self._pos + 1 > limit:
                exe = self.compiled_step()
            self.state, self._last_tok = exe(self._leaves, self.state)
            self._pos += 1

    def advance_on_device(self, k: int, early_exit: bool = False) -> jax.Array:
        """Dispatch k steps as one on-device loop; returns their tokens [rows, k] (a device array
        whose copy to the host has started; the first batch_size rows are the sequences')."""
        exe = self.compiled_chunk(k, early_exit)
        self.state, toks = exe(self._leaves, self.state)
        self._last_tok = None  # token() reads the state's
        self._pos += k  # with early_exit an upper bound: only ever used to pick larger buckets
        toks.copy_to_host_async()
        return toks

    def token(self) -> np.ndarray:
        """The last chosen token of each sequence, [B] (waits for it)."""
        if self._last_tok is not None:
            return _host(self._last_tok)[: self.batch_size]
        return _host(self.state["tok"])[: self.batch_size, 0]

    def _snapshot(self) -> jax.Array:
        """The last chosen tokens [rows] as an array of their own (the state's token is donated
        to the next step), its copy to the host started."""
        tok = self._last_tok if self._last_tok is not None else _peek(self.state["tok"])
        tok.copy_to_host_async()
        return tok

    # ---- loops ----------------------------------------------------------------------------------

    def decode(self, n: int, *, loop: str = "stream", eos_id=None,
               in_flight: int = 2, chunk: int = ON_DEVICE_CHUNK,
               early_exit: bool = False) -> Iterator[np.ndarray]:
        """Yield the next n tokens ([B] each) from the current state: first the token already
        chosen, then one per step, run by `loop` (LOOPS). Stops after the token with which every
        sequence has produced eos_id (an id or a list of stop ids; a finished sequence repeats
        its stop id meanwhile).
        in_flight: steps (stream) or chunks of `chunk` steps (on_device) dispatched ahead of the
        token being waited for."""
        if loop not in LOOPS:
            raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
        stop = _StopAt(stop_ids(eos_id), np.zeros(self.batch_size, bool))
        if loop == "sync":
            for i in range(n):
                if i:
                    self.advance()
                tok = self.token()
                yield tok
                if stop.seen(tok):
                    return
            return
        if loop == "pipelined":
            fetched = [self._snapshot()]
            for _ in range(n - 1):
                self.advance()
                fetched.append(self._snapshot())
            for f in fetched:
                tok = _host(f)[: self.batch_size]
                yield tok
                if stop.seen(tok):
                    return
            return
        if loop == "stream":
            def dispatch():
                self.advance()
                return self._snapshot()
            per_dispatch = 1
        else:
            def dispatch():
                return self.advance_on_device(chunk, early_exit)
            per_dispatch = chunk
        pending = collections.deque([self._snapshot()])  # device arrays: [B] or [B, chunk]
        issued, left = 1, n
        while pending:
            while issued < n and len(pending) <= in_flight:
                pending.append(dispatch())
                issued += per_dispatch
            block = _host(pending.popleft()).reshape(self.rows, -1)[: self.batch_size]
            for tok in block.T[:left]:
                left -= 1
                yield tok
                if stop.seen(tok):
                    if early_exit:
                        self._pos = int(_host(self.state["pos"]))
                    return

    def stream(self, prompt, max_new_tokens: int, eos_id=None, *,
               temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
               loop: str = "stream", in_flight: int = 2, chunk: int = ON_DEVICE_CHUNK,
               early_exit: bool = False) -> Iterator[np.ndarray]:
        """Prefill `prompt`, then yield up to max_new_tokens new tokens ([B] each) as they are
        ready, while the next steps already run (see decode)."""
        self.start(prompt, eos_id, temperature=temperature, top_p=top_p, seed=seed,
                   reserve=cache_reserve(max_new_tokens, loop, chunk))
        yield from self.decode(max_new_tokens, loop=loop, eos_id=eos_id, in_flight=in_flight,
                               chunk=chunk, early_exit=early_exit)

    def generate(self, prompt, max_new_tokens: int, eos_id=None, **kw) -> np.ndarray:
        """The new tokens [B, n] (n <= max_new_tokens: up to and including the step at which
        every sequence has produced eos_id). Keywords as stream(); loop="stream" by default."""
        toks = list(self.stream(prompt, max_new_tokens, eos_id, **kw))
        return np.stack(toks, axis=1) if toks else np.zeros((self.batch_size, 0), np.int32)

    def teacher_forced_logits(self, tokens) -> np.ndarray:
        """From a fresh sequence, feed tokens [B, T] one decode step at a time; the logits of
        every step, [B, T, vocab] (float32, on the host)."""
        tokens = np.asarray(tokens, np.int32).reshape(self.batch_size, -1)
        self.reset(tokens.shape[1])
        steps = [self.step(tokens[:, t]) for t in range(tokens.shape[1])]
        return np.stack(jax.device_get(steps), axis=1)
