"""bench.decode's timers: per loop, the seconds per step of a Decoder that sits where the loop
starts (its samples) and the tokens it generated; back_to_back times any step function the
same way as the pipelined loop (the virtual-ranks rows use it)."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from bench.decode.settings import PIPELINE_STEPS, Settings


def time_sync(dec, s: Settings) -> tuple[list[float], list[np.ndarray]]:
    """Per-step seconds of `advance(); token()`, and the tokens."""
    out, times = [], []
    for i in range(s.warmup + s.tokens):
        t0 = time.perf_counter()
        dec.advance()
        out.append(dec.token())
        if i >= s.warmup:
            times.append(time.perf_counter() - t0)
    return times, out


def time_stream(dec, s: Settings) -> tuple[list[float], list[np.ndarray]]:
    """Gaps between consecutive tokens of Decoder.decode(loop="stream") after the warm-up."""
    stamps, out = [], []
    for tok in dec.decode(s.warmup + s.tokens + 1, loop="stream", in_flight=s.in_flight):
        stamps.append(time.perf_counter())
        out.append(tok)
    return np.diff(stamps[s.warmup:]).tolist(), out[1:]


def back_to_back(run: Callable[[int], None], samples: int) -> list[float]:
    """Seconds per step: per sample, (t(run(20)) - t(run(4))) / 16, where run(k) runs k steps
    back to back and waits for the last (PIPELINE_STEPS)."""
    short, long_ = PIPELINE_STEPS
    out = []
    for _ in range(samples):
        took = []
        for k in (short, long_):
            t0 = time.perf_counter()
            run(k)
            took.append(time.perf_counter() - t0)
        out.append((took[1] - took[0]) / (long_ - short))
    return out


def time_pipelined(dec, s: Settings) -> tuple[list[float], list[np.ndarray]]:
    """Back-to-back steps, one wait per run (back_to_back)."""
    dec.advance(s.warmup)
    dec.token()
    samples = back_to_back(lambda k: (dec.advance(k), dec.token()), s.samples)
    return samples, [dec.token()]


def time_on_device(dec, s: Settings) -> tuple[list[float], list[np.ndarray]]:
    """Gaps between chunk arrivals / chunk (the first chunk, which compiles, untimed)."""
    k = s.chunk
    stamps, out = [], []
    for i, tok in enumerate(dec.decode(k * s.chunks() + 1, loop="on_device", chunk=k,
                                       in_flight=s.in_flight)):
        if i % k == 1:  # the first token of each chunk (token 0 is the start token)
            stamps.append(time.perf_counter())
        out.append(tok)
    return (np.diff(stamps[1:]) / k).tolist(), out[1:]


TIMERS = {"sync": time_sync, "stream": time_stream, "pipelined": time_pipelined,
          "on_device": time_on_device}
