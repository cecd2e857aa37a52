"""Decoder.warmup: compile every executable a request within given limits can need, in parallel,
then run each once (an executable's first run on a GPU also records its command buffer, a CUDA
graph: a cost a request would otherwise pay at its first use of each attention bucket)."""

from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np

from .capacity import ON_DEVICE_CHUNK, attention_buckets, prompt_bucket, prompt_buckets
from .loops import check_loop
from .sampling import MODES, Sampling


def _modes(sampling: Sequence, loops: Sequence[str], max_prompt_len: int,
           max_new_tokens: int) -> list[str]:
    modes = sorted({m.mode if isinstance(m, Sampling) else m for m in sampling})
    for m in modes:
        if m not in MODES:
            raise ValueError(f"sampling mode must be one of {MODES} (or a Sampling), got {m!r}")
    for loop in loops:
        check_loop(loop)
    if max_prompt_len < 1 or max_new_tokens < 1:
        raise ValueError(f"warmup needs max_prompt_len >= 1 and max_new_tokens >= 1, got "
                         f"{max_prompt_len}, {max_new_tokens}")
    return modes


def _specs(dec, modes, loops, max_prompt_len: int, chunk: int, early_exit: bool) -> list:
    exes, specs = dec.exes, []
    for mode in modes:
        specs += [exes.prefill_spec(dec.seq.bucket(w), w, mode)
                  for w in prompt_buckets(max_prompt_len)]
        for n in attention_buckets(dec.capacity):
            if "on_device" in loops:
                specs.append(exes.chunk_spec(n, mode, chunk, early_exit))
            if set(loops) - {"on_device"}:
                specs.append(exes.step_spec(n, mode))
    return specs


def _run_each(dec, modes, loops, max_prompt_len: int, chunk: int, early_exit: bool) -> int:
    """Run every loop and mode briefly (the small helper programs they call), then every
    prefill and step executable once. Returns how many executables ran."""
    executed, b = 0, dec.batch_size
    for mode in modes:
        s = Sampling.of_mode(mode)
        for loop in loops:
            dec.generate(np.zeros((b, 1), np.int32), 2, loop=loop, chunk=chunk,
                         early_exit=early_exit, temperature=s.temperature, top_p=s.top_p)
        for w in prompt_buckets(max_prompt_len):
            dec.generate(np.zeros((b, w), np.int32), 1, temperature=s.temperature,
                         top_p=s.top_p)
            executed += 1
        zeros = np.zeros(b, np.int32)
        for n in attention_buckets(dec.capacity):
            if set(loops) - {"on_device"}:
                dec.seek(n - 1, zeros)  # the step writing slot n - 1 attends over n slots
                dec.advance(1)
                executed += 1
            if "on_device" in loops and n >= chunk:
                dec.seek(n - chunk, zeros)
                dec.advance_on_device(chunk, early_exit)
                executed += 1
        dec.token()
    return executed


def warmup(dec, max_prompt_len: int, max_new_tokens: int, *,
           sampling: Sequence = ("greedy",), loops: Sequence[str] = ("stream",),
           chunk: int = ON_DEVICE_CHUNK, early_exit: bool = False,
           threads: Optional[int] = None) -> dict:
    """See Decoder.warmup."""
    t0 = time.perf_counter()
    modes = _modes(sampling, loops, max_prompt_len, max_new_tokens)
    reserve = max_new_tokens + (chunk if "on_device" in loops else 0)
    widest = prompt_bucket(max_prompt_len)
    limit = dec.seq.limit()
    if widest + reserve > limit:
        raise ValueError(f"warmup: a {widest}-slot prompt bucket + {reserve} new tokens "
                         f"exceed max_seq_len={limit}")
    dec.exes.warmed = None
    dec.reset(widest + reserve)
    compiled = dec.exes.compile_all(_specs(dec, modes, loops, max_prompt_len, chunk, early_exit),
                                    threads)
    executed = _run_each(dec, modes, loops, max_prompt_len, chunk, early_exit)
    dec.exes.warmed = dict(max_prompt_len=max_prompt_len, max_new_tokens=max_new_tokens,
                           sampling=tuple(modes), loops=tuple(loops))
    return {"executables": compiled, "executed": executed, "seconds": time.perf_counter() - t0}
