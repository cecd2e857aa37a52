"""Fault injection for tests: skew (forces mis-speculation), dropped ranks, timeouts.

The controls live in the extension's testing submodule (`_sifar.testing`), not
among the production bindings."""

from __future__ import annotations

import contextlib

from . import _ext, comm


class inject_skew(contextlib.AbstractContextManager):
    """Before each all-reduce every rank waits a random 0..max_us microseconds.

    Takes effect at once; used as a context manager it is undone on exit.
    The waits are drawn from (seed, rank, epoch), on the device on GPUs.
    """

    def __init__(self, max_us: float, seed: int = 0):
        if max_us < 0:
            raise ValueError("inject_skew: max_us must be >= 0")
        self._prev = comm.skew()
        comm.set_skew(int(max_us * 1000), seed)

    def __exit__(self, *exc):
        comm.set_skew(*self._prev)
        return False


@contextlib.contextmanager
def drop_rank(axis_name: str, rank: int, from_block: int = 0):
    """Within the block, `rank` of every group on `axis_name` never arrives:
    it skips its all-reduces (returning its own partial), so its peers time out.
    from_block > 0 (GPUs): only its thread blocks from that one on skip, so the
    peers' first blocks succeed and the others time out (a partial failure)."""
    comms = comm.communicators(axis_name)
    if not comms:
        raise ValueError(f"drop_rank: no communicator for axis {axis_name!r}")
    for c in comms:
        _ext.lib.testing.set_drop(c.comm_id, rank, True, from_block)
    try:
        yield
    finally:
        for c in comms:
            _ext.lib.testing.set_drop(c.comm_id, rank, False)


@contextlib.contextmanager
def timeout(seconds: float):
    """Temporarily bounds every wait for a peer by `seconds`."""
    prev = comm.timeout_s()
    comm.set_timeout(seconds)
    try:
        yield
    finally:
        comm.set_timeout(prev)


def set_epochs(axis_name: str, epoch: int) -> None:
    """Sets every block's epoch, in every lane of every rank on `axis_name`, to
    `epoch` (the next call uses the epoch after it). Only while no all-reduce
    runs. For tests that start just below the tag wrap."""
    for c in comm.communicators(axis_name):
        _ext.lib.testing.set_epochs(c.comm_id, int(epoch) & 0xFFFFFFFF)


@contextlib.contextmanager
def epoch_bits(axis_name: str, bits: int):
    """Within the block, tags carry only `bits` epoch bits (2..24), so the tag
    wraps every ~2**bits calls: the wrap's clearing is reached in a test."""
    if not 2 <= bits <= 24:
        raise ValueError("epoch_bits: bits must be 2..24")
    comms = comm.communicators(axis_name)
    for c in comms:
        _ext.lib.testing.set_epoch_mask(c.comm_id, (1 << bits) - 1)
    try:
        yield
    finally:
        for c in comms:
            _ext.lib.testing.set_epoch_mask(c.comm_id, 0)
