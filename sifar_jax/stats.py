"""Run-time counters and failure reports."""

from __future__ import annotations

from . import _ext, algorithms, comm
from .errors import SifarError

FIELDS = ("calls", "retries", "timeouts")


def stats(per_rank: bool = False) -> dict:
    """Counters per algorithm, summed over every rank of every communicator.

    calls: all-reduces completed, counted once per rank (a TP=2 all-reduce counts 2).
    retries: mis-speculations detected and re-read (once per rank and call on the
      CPU, once per warp and call on GPUs).
    timeouts: waits that hit the deadline.
    With per_rank=True: {axis: [[per-rank dict], ...]} instead.
    """
    if per_rank:
        out: dict = {}
        for c in comm.communicators():
            ranks = _ext._sifar.comm_stats(c.comm_id)
            out.setdefault(c.axis_name, []).append(
                [
                    {name: dict(zip(FIELDS, ranks[r][i])) for name, i in algorithms.IDS.items()}
                    for r in range(len(ranks))
                ]
            )
        return out
    total = {name: dict.fromkeys(FIELDS, 0) for name in algorithms.ALL}
    for c in comm.communicators():
        for rank in _ext._sifar.comm_stats(c.comm_id):
            for name, i in algorithms.IDS.items():
                for f, v in zip(FIELDS, rank[i]):
                    total[name][f] += int(v)
    return total


def check() -> None:
    """Raises SifarError if any all-reduce timed out or a communicator failed."""
    for c in comm.communicators():
        msg = _ext._sifar.comm_failure(c.comm_id)
        if msg:
            raise SifarError(msg)
