"""The communicator's life cycle on the CPU backend: what the host writes
while kernels may run, re-initialisation, teardown (issue 9, items 1, 2, 4)."""

from __future__ import annotations

import threading
import time

import pytest

import sifar_jax
from sifar_jax import _testing


# ------------------------------------------------------------ Control races --
def test_host_knobs_never_clear_a_failure(cpu_mesh):
    """A kernel sets Control::failed with one store while the host changes
    other knobs: the host must write only the fields it changes, so the
    failure survives (a whole-struct read-modify-write could write back the
    0 it read just before the kernel's store)."""
    cleared = 0
    trials = 30
    for trial in range(trials):
        mesh = cpu_mesh(2, slot_bytes=4096)  # a fresh communicator: failed == 0
        [c] = sifar_jax.communicators("tp")
        addr = _testing.control_failed_address(c.comm_id, 0, 0)
        assert _testing.load_u32(addr) == 0
        hammer = threading.Thread(target=_testing.hammer_control, args=(c.comm_id, 200_000))
        hammer.start()
        time.sleep(0.002 + 0.0003 * trial)  # somewhere inside the hammering
        _testing.store_u32(addr, 1)  # what a timing-out kernel does
        hammer.join()
        cleared += _testing.load_u32(addr) == 0
        sifar_jax.shutdown()
        del mesh
    assert cleared == 0, f"the host cleared a kernel's failure in {cleared} of {trials} trials"
