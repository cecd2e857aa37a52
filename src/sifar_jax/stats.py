"""Run-time counters and failure reports."""

from __future__ import annotations

import contextlib

import numpy as np

from . import _ext, algorithms, comm
from .errors import SifarError

FIELDS = ("calls", "retries", "timeouts")


def stats(per_rank: bool = False) -> dict:
    """Counters per algorithm, summed over every rank of every communicator.

    calls: all-reduces completed, counted once per rank (a TP=2 all-reduce counts 2).
    retries: mis-speculations detected and re-read (once per rank and call on the
      CPU, once per warp and call on GPUs).
    timeouts: waits that hit the deadline.
    With per_rank=True: {axis: [[per-rank dict], ...]} instead (live
    communicators only).

    Totals span re-inits: the counts of communicators an init replaced are
    kept (per_rank=False). shutdown() starts every count from zero.
    """
    if per_rank:
        out: dict = {}
        for c in comm.communicators():
            ranks = _ext.lib.comm_stats(c.comm_id)
            out.setdefault(c.axis_name, []).append(
                [
                    {name: dict(zip(FIELDS, ranks[r][i])) for name, i in algorithms.IDS.items()}
                    for r in range(len(ranks))
                ]
            )
        return out
    total = {name: dict.fromkeys(FIELDS, 0) for name in algorithms.ALL}
    for name, row in comm.retired_counts().items():
        for f, v in zip(FIELDS, row):
            total[name][f] += v
    for c in comm.communicators():
        for rank in _ext.lib.comm_stats(c.comm_id):
            for name, i in algorithms.IDS.items():
                for f, v in zip(FIELDS, rank[i]):
                    total[name][f] += int(v)
    return total


def check() -> None:
    """Raises SifarError if any all-reduce timed out or a communicator failed."""
    for c in comm.communicators():
        msg = _ext.lib.comm_failure(c.comm_id)
        if msg:
            raise SifarError(msg)


TRACE_DTYPE = np.dtype(
    [
        ("group", np.int32),
        ("rank", np.int32),
        ("epoch", np.uint32),
        ("chain", np.uint32),
        ("algorithm", np.int32),
        ("start_ns", np.uint64),
        ("end_ns", np.uint64),
        ("retried", np.bool_),
    ]
)


class CallTrace:
    """Per-call records of one axis, taken while the `call_trace` block runs."""

    def __init__(self, axis_name: str):
        self.axis_name = axis_name
        self._records = None

    def records(self) -> np.ndarray:
        """One record per call and rank (block 0's view): device %globaltimer
        times on GPUs, steady-clock times on the CPU; `retried` when that rank
        re-read a stale word. Only the last 4096 calls of each rank are kept."""
        if self._records is None:
            self._records = _read_trace(self.axis_name)
        return self._records


def _read_trace(axis_name: str) -> np.ndarray:
    rows = [r for c in comm.communicators(axis_name) for r in _ext.lib.comm_trace(c.comm_id)]
    return np.array(rows, dtype=TRACE_DTYPE)


@contextlib.contextmanager
def call_trace(axis_name: str):
    """Records every all-reduce on `axis_name` inside the block (testing and
    benchmarks: one extra store per call). Wait for the computations before
    leaving the block; read the records with `.records()` after it."""
    comms = comm.communicators(axis_name)
    if not comms:
        raise ValueError(f"call_trace: no communicator for axis {axis_name!r}")
    trace = CallTrace(axis_name)
    for c in comms:
        _ext.lib.set_trace(c.comm_id, True)
    try:
        yield trace
    finally:
        trace.records()
        for c in comms:
            _ext.lib.set_trace(c.comm_id, False)
