"""The Decoder: prefill and decode of a batch of sequences with the whole per-step state on the
device, in loops that never idle the GPU; a facade over one concern per module of this package
(decoder/__init__.py lists them). make_mesh: the 1-D mesh it runs on.

Prompts are left-padded to a bucket (capacity.prompt_bucket), so a prefill compiles once per
bucket and prompts of different lengths share a batch; each row's tokens keep the positions
(rotary angles) of its prompt run alone (core/attention.Step), so a row's tokens are those of
its prompt alone.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from ..core.transformer import fused_norm_scale
from ..family import ModelConfig
from ..registry import family_of
from . import loops, warmup as warmups
from .allreduce_choice import prefill_allreduce
from .capacity import ON_DEVICE_CHUNK, cache_reserve, stop_ids
from .executables import Executables
from .loops import host
from .options import SIFAR_KINDS, DecodeOptions
from .param_pack import PackedParams
from .sampling import Sampling
from .state import DecodeState
from .step_choice import StepChoice, choose_step


def make_mesh(tp: int, axis_name: str = "tp", devices: Optional[Sequence] = None) -> Mesh:
    """1-D mesh over the first tp devices (tp=1 gives a 1-device mesh)."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < tp:
        raise ValueError(f"tp={tp} needs {tp} devices, only {len(devices)} available")
    return Mesh(np.array(devices[:tp]), (axis_name,))


def _sifar_buffers(options: DecodeOptions, mesh: Mesh):
    """sifar_jax.init for the sifar kinds; (buffers, their specs) for sifar_buffers."""
    if options.allreduce not in SIFAR_KINDS:
        return None, None
    import sifar_jax  # lazily: the models work without the extension built

    sifar_jax.init(mesh, slot_bytes=options.slot_bytes)
    if options.allreduce != "sifar_buffers":
        return None, None
    spec = sifar_jax.buffer_spec(mesh)
    return sifar_jax.make_buffers(mesh, options.axis_name), {"a": spec, "b": spec}


class Decoder:
    """Prefill and decode for one batch of sequences of a model (its family:
    models.registry.family_of(config)), run as `options` say (options.DecodeOptions; the
    allreduce, batch_size and max_seq_len keywords replace the options' fields). The model's
    layout (family.layout(config, tp)) and the step its one-token calls run (`step_choice`,
    step_choice.choose_step: ValueError where options.step="persistent" cannot serve it) are
    computed here, once, and handed to all that needs them.
    Components: `seq` (state.DecodeState), `exes` (executables.Executables), `weights`
    (param_pack.PackedParams)."""

    def __init__(self, config: ModelConfig, mesh: Mesh, params,
                 options: Optional[DecodeOptions] = None, *, allreduce: Optional[str] = None,
                 batch_size: Optional[int] = None, max_seq_len: Optional[int] = None):
        given = dict(allreduce=allreduce, batch_size=batch_size, max_seq_len=max_seq_len)
        options = (options or DecodeOptions()).replace(
            **{k: v for k, v in given.items() if v is not None})
        self.options = options = options.resolve(mesh)
        self.config, self.mesh, self.family = config, mesh, family_of(config)
        self.tp = mesh.shape[options.axis_name]
        self.layout = self.family.layout(config, self.tp)  # raises if tp does not split it
        buffers, ar_specs = _sifar_buffers(options, mesh)
        self.params = self.family.place_params(params, self.layout, mesh, options.axis_name)
        # fused, the norm scales the fused call takes stay arrays of their own (a custom call's
        # operand: XLA would copy a slice of the pack)
        paths = jax.tree_util.tree_flatten_with_path(self.params)[0]
        keep = [options.fused and fused_norm_scale(path) for path, _ in paths]
        self.weights = PackedParams(self.params, mesh, options.pack_params, keep)
        self.seq = DecodeState(config, mesh, options, self.family, self.layout, buffers)
        self.step_choice: StepChoice = choose_step(self.family, self.layout, mesh, options,
                                                   self.params)
        self.exes = Executables(self.family, self.layout, mesh, options, self.weights, self.seq,
                                ar_specs, self.step_choice)

    # ---- what it runs with ----------------------------------------------------------------------

    batch_size = property(lambda self: self.options.batch_size)
    rows = batch_size  # sequences on the device
    max_seq_len = property(lambda self: self.options.max_seq_len)
    axis_name = property(lambda self: self.options.axis_name)
    kv_layout = property(lambda self: self.options.kv_layout)
    gemm_rows = property(lambda self: self.options.gemm_rows)
    attn_impl = property(lambda self: self.options.attn_impl)
    pack_params = property(lambda self: self.options.pack_params)
    compiler_options = property(lambda self: dict(self.options.compiler_options))
    capacity = property(lambda self: self.seq.capacity, doc="Positions the KV cache holds now.")
    sampling = property(lambda self: self.seq.sampling)
    warmed = property(lambda self: self.exes.warmed, doc="The limits of the last warmup().")
    compiles_after_warmup = property(lambda self: self.exes.compiles_after_warmup)

    @property
    def step_reason(self) -> Optional[str]:
        """Why the step that runs a one-token call runs, where options.step did not name it:
        with step="auto", why the persistent step does or does not serve this decoder; None
        where the step named ("xla" or "persistent") runs (step_choice)."""
        return self.step_choice.reason

    @property
    def step_kind(self) -> str:
        """Which step runs a one-token call: "persistent" or "xla" (step_reason says why;
        step_choice)."""
        return self.step_choice.kind

    @property
    def state(self) -> Optional[dict]:
        """The decode state (state.py), donated to every call."""
        return self.seq.arrays

    @state.setter
    def state(self, arrays: Optional[dict]) -> None:
        self.seq.arrays = arrays

    # ---- the sequence ---------------------------------------------------------------------------

    def reset(self, capacity: Optional[int] = None) -> None:
        """Start a new sequence at position 0, with a cache of at least `capacity` positions
        (kept if it is large enough: stale entries are masked and overwritten before they
        become visible)."""
        self.seq.reset(capacity)

    def seek(self, position: int, token) -> None:
        """Continue from `position` of the current cache (taken as the context, as it is) with
        `token` ([B] ints) as the last token. For benchmarks: a context without a prefill."""
        self.seq.seek(position, token)

    def randomize_cache(self, seed: int = 0) -> None:
        """Fill the whole KV cache with random values in (-1, 1) (for benchmarks, with seek)."""
        self.seq.randomize_cache(seed)

    def warmup(self, max_prompt_len: int, max_new_tokens: int, *,
               sampling: Sequence = ("greedy",), loops: Sequence[str] = ("stream",),
               chunk: int = ON_DEVICE_CHUNK, early_exit: bool = False,
               threads: Optional[int] = None) -> dict:
        """Compile every executable a request of up to max_prompt_len prompt tokens and
        max_new_tokens new ones can need, with the sampling modes (MODES, or Samplings) and
        loops given: the prefill of each prompt bucket, the step (or the on_device loop's chunk
        of `chunk` steps) of each attention bucket, on `threads` threads (default: one per CPU),
        then run each once. Sizes the KV cache for the largest request and keeps it. After it,
        an executable compiled for a request outside these limits is logged and counted
        (compiles_after_warmup). Returns {"executables": compiled now, "executed", "seconds"}."""
        return warmups.warmup(self, max_prompt_len, max_new_tokens, sampling=sampling,
                              loops=loops, chunk=chunk, early_exit=early_exit, threads=threads)

    # ---- steps ----------------------------------------------------------------------------------

    def prefill(self, tokens) -> jax.Array:
        """Append tokens [B, T] (or [T] for batch 1) to the sequence; logits [B, T, vocab].
        (The logits path: the sampled token in the state is left as it was.)"""
        if self.seq.arrays is None:
            self.reset()
        tokens = self.seq.tokens(tokens)
        t = tokens.shape[1]
        exe = self.exes.compile(self.exes.logits_spec(self.seq.bucket(self.seq.pos + t), tokens))
        self.state, logits = exe(self.weights.leaves, self.state, tokens)
        self.seq.pos += t
        return logits

    def step(self, token) -> jax.Array:
        """Append one token per sequence ([B] or [B, 1]); logits [B, vocab]."""
        return self.prefill(np.asarray(token, np.int32).reshape(self.batch_size, 1))[:, 0]

    def start(self, prompt, eos_id=None, *, temperature: float = 0.0,
              top_p: float = 1.0, seed: int = 0, reserve: int = 1) -> None:
        """New sequences: prefill `prompt` ([B, T], or [T] for batch 1, or a list of B token
        sequences of different lengths), each row left-padded to the bucket of the longest
        (prompt_bucket), and choose the first new tokens (in the state, not yet read). The
        cache holds at least the padded prompt + reserve positions."""
        sampling = Sampling(temperature, top_p)
        tokens, width = self.seq.begin(prompt, stop_ids(eos_id), sampling, seed, reserve)
        spec = self.exes.prefill_spec(self.seq.bucket(width), width, sampling.mode)
        self.state, self.seq.last_tok = self.exes.compile(spec)(self.weights.leaves, self.state,
                                                               tokens)
        self.seq.pos = width

    def prefill_allreduce(self, prompt_len: int) -> str:
        """Which all-reduce a prefill of prompt_len tokens (padded to its bucket) runs: the
        decoder's, or for sifar "psum (fallback: ...)" where its payload (rows x padded prompt
        x hidden) does not fit sifar's slot (allreduce_choice.py)."""
        return prefill_allreduce(self.options, self.config, prompt_len)

    def advance(self, n: int = 1) -> None:
        """Dispatch n steps (nothing is read back; the steps run as the device gets to them)."""
        seq = self.seq
        for _ in range(n):
            limit, exe = seq.step
            if seq.pos + 1 > limit:
                exe = self.exes.current_step()
            self.state, seq.last_tok = exe(self.weights.leaves, self.state)
            seq.pos += 1

    def advance_on_device(self, k: int, early_exit: bool = False) -> jax.Array:
        """Dispatch k steps as one on-device loop; returns their tokens [B, k] (a device array
        whose copy to the host has started)."""
        exe = self.exes.chunk(k, early_exit)
        self.state, toks = exe(self.weights.leaves, self.state)
        self.seq.last_tok = None  # token() reads the state's
        self.seq.pos += k  # with early_exit an upper bound: only ever used to pick larger buckets
        toks.copy_to_host_async()
        return toks

    def token(self) -> np.ndarray:
        """The last chosen token of each sequence, [B] (waits for it)."""
        if self.seq.last_tok is not None:
            return host(self.seq.last_tok)
        return host(self.state["tok"])[:, 0]

    def snapshot(self) -> jax.Array:
        """The last chosen tokens [B] as an array of their own (the state's token is donated
        to the next step), its copy to the host started."""
        tok = self.seq.last_tok if self.seq.last_tok is not None else _peek(self.state["tok"])
        tok.copy_to_host_async()
        return tok

    def compiled_step(self) -> "jax.stages.Compiled":
        """The executable the next step runs (for inspection: .as_text())."""
        return self.exes.current_step()

    def compiled_chunk(self, k: int, early_exit: bool = False) -> "jax.stages.Compiled":
        """The executable of k steps in one dispatch from the current position:
        (leaves, state) -> (state, tokens [B, k]). fori_loop, or with early_exit a while_loop
        that stops once every sequence has produced a stop id (unrun steps' tokens are the
        first stop id)."""
        return self.exes.chunk(k, early_exit)

    # ---- loops ----------------------------------------------------------------------------------

    def decode(self, n: int, *, loop: str = "stream", eos_id=None,
               in_flight: int = 2, chunk: int = ON_DEVICE_CHUNK,
               early_exit: bool = False) -> Iterator[np.ndarray]:
        """Yield the next n tokens ([B] each) from the current state: first the token already
        chosen, then one per step, run by `loop` (loops.LOOPS). Stops after the token with which
        every sequence has produced eos_id (an id or a list of stop ids; a finished sequence
        repeats its stop id meanwhile). in_flight: steps (stream) or chunks of `chunk` steps
        (on_device) dispatched ahead of the token being waited for."""
        yield from loops.decode(self, n, loop, eos_id, in_flight, chunk, early_exit)

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


@jax.jit
def _peek(tok):
    """A fresh copy of the state's token [B, 1] as [B] (the state's own buffer is donated)."""
    return tok[:, 0]
