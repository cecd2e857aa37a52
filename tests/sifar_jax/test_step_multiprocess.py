"""llama_step across devices with the ranks in different processes (tests/sifar_jax/
step_multiprocess_worker.py through `python -m sifar_jax.launch`): on the CPU 2 processes of
one host device each (the communicator's workspaces in POSIX shared memory); on GPUs one process
per GPU (CUDA IPC) and two processes sharing one GPU as ranks 0 and 1 (--share-gpu), skipped
without a GPU. The step's results bit for bit the virtual ranks' step, exact under skew and
between plain psums of other sizes (the plain all-reduce's protocol blocks lagging behind
block 0); an absent rank and a killed process fail clearly within the timeout.

The shared-GPU variants cap each rank's grid (SIFAR_STEP_MAX_BLOCKS=16): the two ranks'
cooperative grids then fit on the GPU together, which MPS needs (without MPS the two contexts
take turns on the GPU whatever the grid; docs/step_across_devices.md, "One GPU, two
processes").
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from test_multiprocess import _tail, assert_no_leftovers, launch, lines_of

WORKER = Path(__file__).with_name("step_multiprocess_worker.py")


# Blocks per rank's grid where two ranks share one GPU.
SHARED_GPU_MAX_BLOCKS = "16"


def step_launch(n, *args, **kw):
    """launch() of the step's worker; on a shared GPU with SIFAR_STEP_MAX_BLOCKS (unless the
    environment sets it already)."""
    import os

    import test_multiprocess

    cap = kw.get("share_gpu") and "SIFAR_STEP_MAX_BLOCKS" not in os.environ
    old = test_multiprocess.WORKER
    test_multiprocess.WORKER = WORKER
    if cap:
        os.environ["SIFAR_STEP_MAX_BLOCKS"] = SHARED_GPU_MAX_BLOCKS
    try:
        return launch(n, *args, **kw)
    finally:
        test_multiprocess.WORKER = old
        if cap:
            del os.environ["SIFAR_STEP_MAX_BLOCKS"]


def assert_step_ok(text: str, n_processes: int, ranks: int, scenarios) -> None:
    for p in range(n_processes):
        if "seam" in scenarios:
            for allreduce in ("sifar", "oneshot"):
                assert lines_of(text, p, f"OK step seam loop {allreduce} n={ranks}"), _tail(text)
                assert lines_of(text, p, f"OK step seam wrap {allreduce} n={ranks}: exact"), \
                    _tail(text)
        if "bits" in scenarios:
            for allreduce in ("sifar", "oneshot"):
                for w in ("fp8", "bf16"):
                    assert lines_of(text, p, f"OK step bits {allreduce} {w} n={ranks}"), _tail(text)
        if "skew" in scenarios:
            for allreduce in ("sifar", "oneshot"):
                assert lines_of(text, p, f"OK step skew {allreduce} n={ranks}"), _tail(text)
        if "absent" in scenarios:
            for allreduce in ("sifar", "oneshot"):
                assert lines_of(text, p, f"OK step absent {allreduce}: exact after re-init"), \
                    _tail(text)
        assert lines_of(text, p, "DONE"), _tail(text)


def test_two_processes_bits_skew_and_an_absent_rank():
    rc, text, _ = step_launch(2, "bits", "skew", "absent", "--steps", "20", "--timeout", "2")
    assert rc == 0, _tail(text)
    assert_step_ok(text, 2, 2, ("bits", "skew", "absent"))
    ok = lines_of(text, 0, "OK step absent sifar: NaN and the error after")
    assert ok and "phase 1 (layer 0's o)" in ok[0] and "rank 1 (process 1)" in ok[0], _tail(text)
    assert_no_leftovers(text)


def test_two_processes_steps_between_plain_calls():
    rc, text, _ = step_launch(2, "seam", "--steps", "6", "--skew-us", "200", "--timeout", "5")
    assert rc == 0, _tail(text)
    assert_step_ok(text, 2, 2, ("seam",))
    assert_no_leftovers(text)


def test_killed_process_is_named_within_the_timeout():
    timeout = 2.0
    rc, text, elapsed = step_launch(2, "kill", "--timeout", str(timeout), "--victim", "1",
                                    "--after", "3", grace=60)
    assert rc == 128 + 9, f"the launcher must report the SIGKILL (137), got {rc}:\n{_tail(text)}"
    ok = lines_of(text, 0, "OK step kill: step 4 failed after")
    assert ok and "rank 1 (process 1) never arrived" in ok[0], _tail(text)
    assert "phase 1 (layer 0's o)" in ok[0], _tail(text)
    seconds = float(re.search(r"failed after ([\d.]+) s", ok[0]).group(1))
    assert seconds < timeout + 3, ok[0]
    assert_no_leftovers(text)


# ----------------------------------------------------------------- the GPU --
@pytest.fixture
def gpus():
    from conftest import gpu_device_list

    n = len(gpu_device_list())
    if n == 0:
        pytest.skip("needs a CUDA GPU")
    return n


@pytest.mark.parametrize("share_gpu", [False, True], ids=["gpu-per-process", "shared-gpu"])
def test_gpu_two_processes_bits_skew_and_an_absent_rank(gpus, share_gpu):
    """Ranks 0 and 1 in two processes, on two GPUs or sharing one (time-sliced: it checks
    results, not speed): h, the cache and logit shards bit for bit the virtual-rank kernel's
    (slot < 64: one key range whatever the grid); SIFAR_STEP_STRESS_STEPS skewed steps
    (default 200) with 0 mismatches, sifar re-reading stale words; an absent rank: NaN, the
    error naming it and the phase within the timeout, exact after re-init."""
    import os

    if not share_gpu and gpus < 2:
        pytest.skip("needs 2 GPUs (the shared-GPU variant runs on one)")
    steps = os.environ.get("SIFAR_STEP_STRESS_STEPS", "200")
    rc, text, _ = step_launch(2, "bits", "skew", "absent", "--steps", steps, "--skew-us", "20",
                              "--timeout", "2", platform="gpu", share_gpu=share_gpu)
    assert rc == 0, _tail(text)
    assert_step_ok(text, 2, 2, ("bits", "skew", "absent"))


@pytest.mark.parametrize("share_gpu", [False, True], ids=["gpu-per-process", "shared-gpu"])
def test_gpu_killed_process_is_named_within_the_timeout(gpus, share_gpu):
    if not share_gpu and gpus < 2:
        pytest.skip("needs 2 GPUs (the shared-GPU variant runs on one)")
    rc, text, _ = step_launch(2, "kill", "--timeout", "2", "--victim", "1", "--after", "3",
                              platform="gpu", share_gpu=share_gpu, grace=60)
    assert rc == 128 + 9, _tail(text)
    ok = lines_of(text, 0, "OK step kill: step 4 failed after")
    assert ok and "rank 1 (process 1) never arrived" in ok[0], _tail(text)
    assert "phase 1 (layer 0's o)" in ok[0], _tail(text)


@pytest.mark.parametrize("share_gpu", [False, True], ids=["gpu-per-process", "shared-gpu"])
def test_gpu_two_processes_steps_between_plain_calls(gpus, share_gpu):
    """The seam between the plain all-reduce's per-block epochs and the step (review F1, F2):
    SIFAR_STEP_STRESS_STEPS iterations (default 200) of [step, a 32-byte psum, psums of 4-8 KB
    (protocol blocks 0..3), the last one reading the region the step writes] at H = 4096 under
    20 us of skew and 3 epoch bits, sifar and oneshot: no timeout, every step the virtual-rank
    kernel's bits, every psum exact; then the step after block 0 crossed the tag wrap alone in
    a plain call, with block 1's old words of the same tag in place (SEAM_WRAP), exact. On one
    GPU the two processes' turns on the GPU make the lagging block's reads slow: before the fix
    the sifar step timed out and the oneshot step's psums were wrong."""
    import os

    if not share_gpu and gpus < 2:
        pytest.skip("needs 2 GPUs (the shared-GPU variant runs on one)")
    steps = os.environ.get("SIFAR_STEP_STRESS_STEPS", "200")
    rc, text, _ = step_launch(2, "seam", "--steps", steps, "--skew-us", "20", "--timeout", "2",
                              platform="gpu", share_gpu=share_gpu)
    assert rc == 0, _tail(text)
    assert_step_ok(text, 2, 2, ("seam",))
