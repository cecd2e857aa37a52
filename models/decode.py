"""Prefill + greedy decode with a donated, in-place KV cache.

Each step is one jitted call whose decode state (a pytree dict) is donated, so XLA updates the
KV cache in place. The loop over steps stays in Python on purpose: XLA does not preserve buffer
aliasing through while loops, so lax.while/fori over steps would copy the cache every step.
The current position lives in the state on device: a step needs no host input but the token
(which, in greedy decoding, is the previous step's device output).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from . import llama
from .config import LlamaConfig


def make_mesh(tp: int, axis_name: str = "tp", devices: Optional[Sequence] = None) -> Mesh:
    """1-D mesh over the first tp devices (tp=1 gives a 1-device mesh)."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < tp:
        raise ValueError(f"tp={tp} needs {tp} devices, only {len(devices)} available")
    return Mesh(np.array(devices[:tp]), (axis_name,))


def _init_sifar(mesh: Mesh) -> None:
    # sifar_psum requires sifar_jax.init(mesh) first (it is idempotent)
    import sifar_jax

    sifar_jax.init(mesh)


class Decoder:
    """Greedy decoder for one batch of equal-length sequences.

    state = {"cache": [per layer {"k","v"}], "pos": int32 scalar, "ar": {...}} — donated every
    call. With allreduce="sifar_buffers", state["ar"] holds the pair of all-reduce buffers from
    sifar_jax.make_buffers ({"a", "b"}); the forward hands them to every all-reduce (alternating
    by parity) and returns them, so they are donated like the cache and never copied.

    allreduce="sifar" calls sifar_jax.init(mesh). A prefill's all-reduce payload is
    batch x prompt_len x hidden: past sifar's slot size it falls back to lax.psum with
    algorithm="auto" and raises with an explicitly named algorithm.
    """

    def __init__(self, config: LlamaConfig, mesh: Mesh, params, *, allreduce: str = "psum",
                 algorithm: str = "auto", axis_name: str = "tp", batch_size: int = 1,
                 max_seq_len: Optional[int] = None):
        self.config = config
        self.mesh = mesh
        self.params = params
        self.axis_name = axis_name
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len or config.max_seq_len
        self.tp = mesh.shape[axis_name]
        llama.check_tp(config, self.tp)
        self._buffers = None
        if allreduce in ("sifar", "sifar_buffers"):
            _init_sifar(mesh)
        ar_specs = None
        if allreduce == "sifar_buffers":
            import sifar_jax

            self._buffers = sifar_jax.make_buffers(mesh, axis_name)
            spec = sifar_jax.buffer_spec(mesh)
            ar_specs = {"a": spec, "b": spec}
        kw = dict(allreduce=allreduce, algorithm=algorithm, axis_name=axis_name, ar_specs=ar_specs)
        fwd_all = llama.make_forward(config, mesh, **kw)
        fwd_last = llama.make_forward(config, mesh, last_only=True, **kw)
        self._replicated = NamedSharding(mesh, P())

        def run(fwd, params, state, tokens):
            positions = state["pos"] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
            logits, cache, ar = fwd(params, state["cache"], tokens, positions, state["ar"])
            return logits, {"cache": cache, "pos": state["pos"] + tokens.shape[1], "ar": ar}

        def greedy(params, state, tokens):
            logits, state = run(fwd_last, params, state, tokens)
            return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], state

        # state (argument 1) is donated: the KV cache is updated in place
        self._logits_fn = jax.jit(lambda p, s, t: run(fwd_all, p, s, t), donate_argnums=(1,))
        self._greedy_fn = jax.jit(greedy, donate_argnums=(1,),
                                  out_shardings=(self._replicated, None))
        self.state = None
        self._pos = 0  # host mirror of state["pos"], only for bounds checks
        self.reset()

    # ---- state -----------------------------------------------------------------------------

    def reset(self) -> None:
        """Start a new sequence. The cache is allocated once; stale entries beyond the new
        position are masked out and overwritten before they become visible."""
        if self.state is None:
            cache = llama.init_cache(self.config, self.mesh, self.batch_size, self.max_seq_len,
                                     self.axis_name)
            ar = {} if self._buffers is None else dict(self._buffers._asdict())
            self._buffers = None  # owned by the state from now on (donated every step)
            self.state = {"cache": cache, "pos": None, "ar": ar}
        self.state["pos"] = jax.device_put(jnp.int32(0), self._replicated)
        self._pos = 0

    def _tokens(self, tokens) -> jax.Array:
        tokens = jnp.asarray(tokens, jnp.int32)
        if tokens.ndim == 1:
            tokens = tokens[None, :] if self.batch_size == 1 else tokens[:, None]
        if tokens.shape[0] != self.batch_size:
            raise ValueError(f"batch {tokens.shape[0]} != Decoder batch_size {self.batch_size}")
        if self._pos + tokens.shape[1] > self.max_seq_len:
            raise ValueError(f"sequence would exceed max_seq_len={self.max_seq_len}")
        self._pos += tokens.shape[1]
        return jax.device_put(tokens, self._replicated)

    # ---- API ---------------------------------------------------------------------------------

    def prefill(self, tokens) -> jax.Array:
        """Append tokens [B, T] (or [T] for batch 1) to the sequence; logits [B, T, vocab]."""
        logits, self.state = self._logits_fn(self.params, self.state, self._tokens(tokens))
        return logits

    def step(self, token) -> jax.Array:
        """Append one token per sequence ([B] or [B, 1]); logits [B, vocab]."""
        token = jnp.asarray(token, jnp.int32).reshape(self.batch_size, 1)
        return self.prefill(token)[:, 0]

    def greedy(self, tokens) -> jax.Array:
        """Append tokens [B, T]; return the argmax next token [B, 1] as a replicated device
        array, ready to be fed straight back (no host round trip). The benchmark's step."""
        if isinstance(tokens, jax.Array) and tokens.sharding == self._replicated and tokens.ndim == 2:
            if self._pos + tokens.shape[1] > self.max_seq_len:  # fast path: no re-placement
                raise ValueError(f"sequence would exceed max_seq_len={self.max_seq_len}")
            self._pos += tokens.shape[1]
        else:
            tokens = self._tokens(tokens)
        nxt, self.state = self._greedy_fn(self.params, self.state, tokens)
        return nxt

    def generate(self, prompt_tokens, n: int) -> np.ndarray:
        """Greedy-decode n tokens after the prompt, from a fresh sequence; returns [B, n]."""
        self.reset()
        tok = self.greedy(prompt_tokens)
        out = [tok]
        for _ in range(n - 1):
            tok = self.greedy(tok)
            out.append(tok)
        return np.concatenate(jax.device_get(out), axis=1)

    def teacher_forced_logits(self, tokens) -> np.ndarray:
        """From a fresh sequence, feed tokens [B, T] one decode step at a time; the logits of
        every step, [B, T, vocab] (float32, on the host)."""
        self.reset()
        tokens = np.asarray(tokens, np.int32).reshape(self.batch_size, -1)
        steps = [self.step(tokens[:, t]) for t in range(tokens.shape[1])]
        return np.stack(jax.device_get(steps), axis=1)
