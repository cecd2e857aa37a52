"""A decoder's executables: each compiled ahead of time (exact in/out shardings, so no call
re-places or re-checks anything) per cache capacity, attention bucket and sampling mode
(greedy, temperature, top_p: the values are in the state), and kept in one table.

A step is `state, token = step(param_leaves, state)`: no host input, no Python scalar; `token`
[B] is the chosen token again, written by the step to pinned host memory where the backend has
it (the host reads it there without a device-to-host copy of its own, the waited loop's
largest cost after the device's step). After a warmup (warmup.py) an executable compiled
for a request outside the warmed limits is logged and counted (compiles_after_warmup).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from .sampling import next_token
from .step_choice import XLA

log = logging.getLogger(__name__)


def host_memory_kind(mesh) -> str:
    """"pinned_host" where this backend's devices have it (a result XLA writes to host memory
    the host reads without a device-to-host copy of its own), else "device"."""
    kinds = {m.kind for m in mesh.local_devices[0].addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else "device"


def _with_token(state: dict):
    """A step's outputs: its state and its token [B] again, as a result of its own (written to
    tok_sharding: pinned host memory where the backend has it)."""
    return state, state["tok"][:, 0]


class Programs:
    """What a decoder's executables run, as traceable functions of (param leaves, state, ...):
    the forwards (one per attention length) and the step, prefill, logits and chunk programs,
    each as a spec (key, fn, args, outputs) for Executables.compile. `weights` is the decoder's
    param_pack.PackedParams, `seq` its state.DecodeState (whose arrays' shardings every
    program takes and returns), `step` its step_choice.StepChoice."""

    def __init__(self, family, layout, mesh, options, weights, seq, ar_specs=None, step=XLA):
        self.family, self.layout, self.mesh, self.options = family, layout, mesh, options
        self.weights, self.seq, self.ar_specs = weights, seq, ar_specs
        self.step_forward = step.forward()
        self.tok_sharding = NamedSharding(mesh, P(), memory_kind=host_memory_kind(mesh))
        self.logits_sharding = NamedSharding(mesh, P(None, None, options.axis_name))
        self.forwards: dict = {}

    def forward(self, attend_len: int, last_only: bool):
        key = (attend_len, last_only)
        if key not in self.forwards:
            self.forwards[key] = self.family.make_forward(
                self.layout, self.mesh, self.options, last_only=last_only,
                attend_len=attend_len, ar_specs=self.ar_specs, params=self.weights.params,
                step=self.step_forward)
        return self.forwards[key]

    def run_forward(self, leaves, state, tokens, attend_len: int, last_only: bool):
        """The forward of tokens [B, T] at state["pos"]: (logits, the state after them)."""
        t = tokens.shape[1]
        positions = state["pos"] + jnp.arange(t, dtype=jnp.int32)
        logits, cache, ar = self.forward(attend_len, last_only)(
            self.weights.unflatten(leaves), state["cache"], tokens, positions, state["ar"],
            state["start"])
        return logits, dict(state, cache=cache, ar=ar, pos=state["pos"] + t)

    def append(self, leaves, state, tokens, attend_len: int, mode: str) -> dict:
        """Run tokens [B, T] at state["pos"]; choose the next token from the last logits
        (sampling mode `mode`, its values from the state)."""
        logits, new = self.run_forward(leaves, state, tokens, attend_len, True)
        nxt, key = next_token(logits[:, -1], state["key"], mode, state["temp"], state["top_p"])
        nxt = jnp.where(state["done"], state["tok"][:, 0], nxt)  # a finished row repeats its stop
        return dict(new, tok=nxt[:, None], key=key,
                    done=state["done"] | jnp.any(nxt[:, None] == state["eos"][None, :], axis=1))

    def step_spec(self, n: int, mode: str):
        return (("step", self.seq.capacity, n, mode),
                lambda p, st: _with_token(self.append(p, st, st["tok"], n, mode)), (),
                (self.tok_sharding,))

    def prefill_spec(self, n: int, width: int, mode: str):
        tokens = jax.ShapeDtypeStruct((self.seq.rows, width), jnp.int32, sharding=self.seq.rep)
        return (("prefill", self.seq.capacity, n, width, mode),
                lambda p, st, toks: _with_token(self.append(p, st, toks, n, mode)), (tokens,),
                (self.tok_sharding,))

    def logits_spec(self, n: int, tokens: jax.Array):
        """A call of tokens [B, T] that returns the state and every position's logits."""
        def logits_fn(leaves, state, toks):
            logits, new = self.run_forward(leaves, state, toks, n, False)
            return new, logits

        return (("logits", self.seq.capacity, n, tokens.shape[1]), logits_fn, (tokens,),
                (self.logits_sharding,))

    def chunk_spec(self, n: int, mode: str, k: int, early_exit: bool):
        b = self.seq.rows

        def chunk(leaves, state):
            def body(i, carry):
                st, toks = carry
                st = self.append(leaves, st, st["tok"], n, mode)
                return st, jax.lax.dynamic_update_slice(toks, st["tok"], (0, i))

            toks = jnp.full((b, k), state["eos"][0], jnp.int32)
            if not early_exit:
                return jax.lax.fori_loop(0, k, body, (state, toks))
            _, state, toks = jax.lax.while_loop(
                lambda c: (c[0] < k) & ~jnp.all(c[1]["done"]),
                lambda c: (c[0] + 1, *body(c[0], (c[1], c[2]))), (jnp.int32(0), state, toks))
            return state, toks

        return ("chunk", self.seq.capacity, n, mode, k, early_exit), chunk, (), (self.tok_sharding,)


class Executables(Programs):
    """The compiled executables of a decoder's programs, in one table (key -> executable),
    each compiled ahead of time on first use or by compile_all (warmup)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.table: dict = {}
        self.warmed: Optional[dict] = None  # the limits of the last warmup()
        self.compiles_after_warmup = 0  # executables compiled since, each logged

    # ---- lowering and compiling ----------------------------------------------------------------

    def lower(self, fn, *args, outputs=()) -> "jax.stages.Lowered":
        """fn(leaves, state, *args) lowered with the state donated and its shardings fixed on
        the way in and out; `outputs`: shardings of further outputs; args: arrays or
        ShapeDtypeStructs with shardings."""
        shardings = lambda tree: jax.tree.map(lambda a: a.sharding, tree)  # noqa: E731
        state_sh = shardings(self.seq.arrays)
        out_sh = (state_sh, *outputs) if outputs else state_sh
        leaves = self.weights.leaves
        jitted = jax.jit(fn, donate_argnums=(1,), out_shardings=out_sh,
                         in_shardings=(shardings(leaves), state_sh,
                                       *(shardings(a) for a in args)))
        return jitted.lower(leaves, self.seq.arrays, *args)

    def finish(self, lowered: "jax.stages.Lowered") -> "jax.stages.Compiled":
        """A lowered executable compiled with the options' compiler_options."""
        return lowered.compile(compiler_options=self.options.xla_options())

    def compile(self, spec) -> "jax.stages.Compiled":
        """The executable of `spec` (key, fn, args, outputs), compiled ahead of time (see lower)
        on first use. After a warmup() a compile is logged and counted."""
        key, fn, args, outputs = spec
        exe = self.table.get(key)
        if exe is None:
            if self.warmed is not None:
                self.compiles_after_warmup += 1
                log.warning("compiling %s %s: outside the limits of warmup(%s)", key[0], key[2:],
                            ", ".join(f"{k}={v}" for k, v in self.warmed.items()))
            exe = self.table[key] = self.finish(self.lower(fn, *args, outputs=outputs))
        return exe

    def compile_all(self, specs, threads: Optional[int] = None) -> int:
        """Compile every spec not compiled yet: traced one by one, then compiled on `threads`
        threads (XLA compiles without the GIL; default: one per CPU). Returns how many."""
        todo = {}
        for key, fn, args, outputs in specs:
            if key not in self.table and key not in todo:
                todo[key] = self.lower(fn, *args, outputs=outputs)
        workers = max(1, min(len(todo), threads or os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for key, exe in zip(todo, pool.map(self.finish, todo.values())):
                self.table[key] = exe
        return len(todo)

    def current_step(self) -> "jax.stages.Compiled":
        """The executable the next step runs."""
        seq = self.seq
        limit, exe = seq.step
        if seq.pos + 1 > limit:
            n = seq.bucket(seq.pos + 1)
            exe = self.compile(self.step_spec(n, seq.sampling.mode))
            seq.step = (n, exe)
        return exe

    def chunk(self, k: int, early_exit: bool = False) -> "jax.stages.Compiled":
        """The executable of k steps in one dispatch from the current position."""
        n = self.seq.bucket(self.seq.pos + k)
        return self.compile(self.chunk_spec(n, self.seq.sampling.mode, k, early_exit))
