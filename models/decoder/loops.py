"""The decode loops (Decoder.decode(n, loop=...); all give the same tokens):

    sync       one step, read its token, repeat: what a user writes first
    stream     steps run up to `in_flight` ahead of the host; each token is fetched with
               copy_to_host_async and yielded as soon as it is ready (Decoder.stream)
    pipelined  every step dispatched back to back, the tokens read at the end
    on_device  K steps per dispatch in a lax.fori_loop (a while_loop that stops once every
               sequence produced eos with early_exit=True), streamed chunk by chunk

A stop token is seen by the host a step or two late; the tokens after it are not yielded.
Each loop drives the decoder through advance, advance_on_device, token and snapshot.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterator

import numpy as np

from .capacity import ON_DEVICE_CHUNK, stop_ids

LOOPS = ("sync", "stream", "pipelined", "on_device")


def host(a) -> np.ndarray:
    """A replicated array's value on the host: every process holds it whole (with one process per
    GPU, np.asarray refuses an array that spans other processes' devices)."""
    return np.asarray(a if a.is_fully_addressable else a.addressable_data(0))


def check_loop(loop: str) -> None:
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")


@dataclasses.dataclass
class StopAt:
    """Host side of the stop ids: True once every sequence has produced one."""

    eos: tuple
    done: np.ndarray

    def seen(self, tok: np.ndarray) -> bool:
        if not self.eos:
            return False
        self.done |= np.isin(tok, self.eos)
        return bool(self.done.all())


def sync(dec, n: int, stop: StopAt) -> Iterator[np.ndarray]:
    for i in range(n):
        if i:
            dec.advance()
        tok = dec.token()
        yield tok
        if stop.seen(tok):
            return


def pipelined(dec, n: int, stop: StopAt) -> Iterator[np.ndarray]:
    fetched = [dec.snapshot()]
    for _ in range(n - 1):
        dec.advance()
        fetched.append(dec.snapshot())
    for f in fetched:
        tok = host(f)
        yield tok
        if stop.seen(tok):
            return


def ahead(dec, n: int, stop: StopAt, on_device: bool, in_flight: int, chunk: int,
          early_exit: bool) -> Iterator[np.ndarray]:
    """The stream loop (one step per dispatch) or the on_device one (`chunk` steps per
    dispatch): up to in_flight dispatches ahead of the token yielded."""
    if on_device:
        def dispatch():
            return dec.advance_on_device(chunk, early_exit)
        per_dispatch = chunk
    else:
        def dispatch():
            dec.advance()
            return dec.snapshot()
        per_dispatch = 1
    pending = collections.deque([dec.snapshot()])  # device arrays: [B] or [B, chunk]
    issued, left = 1, n
    while pending:
        while issued < n and len(pending) <= in_flight:
            pending.append(dispatch())
            issued += per_dispatch
        block = host(pending.popleft()).reshape(dec.batch_size, -1)
        for tok in block.T[:left]:
            left -= 1
            yield tok
            if stop.seen(tok):
                if early_exit:
                    dec.seq.pos = int(host(dec.state["pos"]))
                return


def decode(dec, n: int, loop: str = "stream", eos_id=None, in_flight: int = 2,
           chunk: int = ON_DEVICE_CHUNK, early_exit: bool = False) -> Iterator[np.ndarray]:
    """Decoder.decode's loops (see Decoder.decode)."""
    check_loop(loop)
    stop = StopAt(stop_ids(eos_id), np.zeros(dec.batch_size, bool))
    if loop == "sync":
        return sync(dec, n, stop)
    if loop == "pipelined":
        return pipelined(dec, n, stop)
    return ahead(dec, n, stop, loop == "on_device", in_flight, chunk, early_exit)
