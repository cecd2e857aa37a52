"""Communicators spanning processes (one process per GPU, here per CPU device
set): 2 and 4 processes started with `python -m sifar_jax.launch`, with
jax.distributed on localhost and the workspaces in POSIX shared memory, run
tests/multiprocess_worker.py. Each process checks its own rows against the
rank-order float32 reference (and lax.psum over gloo); a killed process must
make the others fail within the timeout with an error naming it; no shared
memory may be left behind. The launcher's own contract (exit codes, killing
the rest, the time bound) is tested with plain Python children.

The GPU variants run the same worker on CUDA (IPC-mapped workspaces); they
skip without GPUs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sifar_jax
from conftest import gpu_device_list
from sifar_jax import distributed
from sifar_jax import launch as launch_module

WORKER = Path(__file__).with_name("multiprocess_worker.py")
PORTABLE = tuple(sifar_jax.algorithms.PORTABLE)
# Bound on every launch: a hang fails the test instead of stalling CI.
LAUNCH_TIMEOUT_S = 150


def launch(n: int, *worker_args: str, devices_per_process: int = 1, platform: str = "cpu",
           grace: float = 10, share_gpu: bool = False):
    """Runs the worker in n launched processes; returns (exit code, output, seconds)."""
    cmd = [sys.executable, "-m", "sifar_jax.launch", "-n", str(n), "--platform", platform,
           "--devices-per-process", str(devices_per_process), "--timeout", str(LAUNCH_TIMEOUT_S),
           "--grace", str(grace)]
    if share_gpu:
        cmd.append("--share-gpu")
    cmd += ["--", sys.executable, str(WORKER), *worker_args]
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the launcher gives each process its own device count
    t0 = time.monotonic()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                         timeout=LAUNCH_TIMEOUT_S + 60)
    elapsed = time.monotonic() - t0
    text = out.stdout + out.stderr
    if out.returncode != 0 and "PID " not in text:
        # Not one worker got past jax.distributed.initialize(). A worker that cannot even be
        # imported is a broken test, not a platform without jax.distributed: fail on it.
        assert not re.search(r"\b(ModuleNotFoundError|ImportError|SyntaxError|NameError)\b",
                             text), _tail(text)
        pytest.skip(f"jax.distributed cannot start here: {_tail(text)}")
    return out.returncode, text, elapsed


def _tail(text: str, lines: int = 40) -> str:
    keep = [ln for ln in text.splitlines() if not re.match(r"\[\d+\] [WI]\d{4} ", ln)]
    return "\n".join(keep[-lines:])


def worker_pids(text: str) -> list[int]:
    return [int(p) for p in re.findall(r"\] PID (\d+) ", text)]


def lines_of(text: str, process: int, prefix: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(f"[{process}] {prefix}")]


def assert_no_leftovers(text: str) -> None:
    pids = worker_pids(text)
    assert pids, _tail(text)
    assert distributed.leftover_shared_memory(pids) == []


def assert_exact(text: str, n_processes: int, ranks: int, algorithms=PORTABLE) -> None:
    for p in range(n_processes):
        for algorithm in algorithms:
            for skew in (0, 200):
                want = f"OK exact {algorithm} n={ranks} skew={skew}us"
                assert any(ln.startswith(f"[{p}] {want}") for ln in text.splitlines()), (
                    f"process {p} did not report '{want}':\n{_tail(text)}")
        assert lines_of(text, p, f"OK exact lax.psum n={ranks}"), _tail(text)
        assert lines_of(text, p, f"OK exact re-init n={ranks}"), _tail(text)
        assert lines_of(text, p, "DONE"), _tail(text)


def assert_fused(rc: int, text: str) -> None:
    """The worker's fused scenario passed in both processes."""
    assert rc == 0, _tail(text)
    for p in range(2):
        assert lines_of(text, p, "OK fused shapes n=2"), _tail(text)
        assert lines_of(text, p, "OK fused interleave n=2"), _tail(text)


@pytest.fixture
def stale_shared_memory():
    """A shared-memory object named as if a dead process of this user made it."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = Path(distributed.SHM_DIR) / f"{distributed.SHM_PREFIX}{os.getuid()}.{dead.pid}.0.g0.r0"
    path.write_bytes(b"\0" * 64)
    yield path
    path.unlink(missing_ok=True)


# ----------------------------------------------------------------- the CPU --
def test_two_processes_every_algorithm_exact(stale_shared_memory):
    """...and the set-up's failure modes: processes on different hosts agree
    to fall back to lax.psum; a process that never calls init is named."""
    rc, text, _ = launch(2, "exact", "hosts", "absent")
    assert rc == 0, _tail(text)
    assert_exact(text, 2, 2)
    for p in range(2):
        assert lines_of(text, p, "OK hosts"), _tail(text)
    assert lines_of(text, 0, "OK absent: sifar_jax: process 1 did not reach"), _tail(text)
    assert_no_leftovers(text)
    assert not stale_shared_memory.exists(), "a stale object of a dead process survived a start"


def test_four_processes_every_algorithm_exact():
    rc, text, _ = launch(4, "exact", "--steps", "40")
    assert rc == 0, _tail(text)
    assert_exact(text, 4, 4)
    assert_no_leftovers(text)


def test_fused_call_over_processes():
    """psum_add_rmsnorm with one process per rank: every row layout, and fused
    and plain calls interleaved across the tag wrap under skew, exact."""
    assert_fused(*launch(2, "fused")[:2])


def assert_rowpar(rc: int, text: str, n: int) -> None:
    assert rc == 0, _tail(text)
    for p in range(n):
        for dt in ("float32", "bfloat16"):
            assert lines_of(text, p, f"OK rowpar {dt} n={n} sifar calls=2"), _tail(text)


@pytest.mark.parametrize("n", [2, 4])
def test_row_parallel_over_processes(n):
    """An auto-sharded program's row-parallel projection (and its fused residual + RMSNorm)
    with one process per rank: the rank-order sum of the partial products, bit for bit."""
    assert_rowpar(*launch(n, "rowpar")[:2], n)


def test_local_and_remote_ranks_in_one_group():
    """2 processes x 2 devices: the 4-rank axis mixes local and mapped
    workspaces; a ("proc", "dev") mesh has one in-process and one
    cross-process axis; a ("host", "gpu") mesh across (pretended) hosts,
    reduced over both axes, runs sifar within the host and lax.psum across."""
    algorithms = ("sifar", "twoshot", "sifar_push")
    rc, text, _ = launch(2, "exact", "mesh2d", "hosts2d", "--algorithms", ",".join(algorithms),
                         "--steps", "30", devices_per_process=2)
    assert rc == 0, _tail(text)
    assert_exact(text, 2, 4, algorithms)
    for p in range(2):
        assert lines_of(text, p, "OK mesh2d (2, 2)"), _tail(text)
        assert lines_of(text, p, "OK hosts2d (2, 2)"), _tail(text)
    assert_no_leftovers(text)


def test_killed_process_is_named_within_the_timeout():
    timeout = 2.0
    rc, text, elapsed = launch(2, "kill", "--algorithms", "sifar", "--timeout", str(timeout),
                               "--victim", "1", "--after", "3", grace=60)
    assert rc == 128 + 9, f"the launcher must report the SIGKILL (137), got {rc}:\n{_tail(text)}"
    assert "[launch] process 1 was killed by SIGKILL" in text, _tail(text)
    ok = lines_of(text, 0, "OK kill: call 4 failed after")
    assert ok and "rank 1 (process 1) never arrived" in ok[0], _tail(text)
    seconds = float(re.search(r"failed after ([\d.]+) s", ok[0]).group(1))
    assert seconds < timeout + 3, ok[0]
    assert elapsed < 60, f"the whole run took {elapsed:.0f} s"
    assert_no_leftovers(text)


@pytest.mark.parametrize("handshake", [False, True], ids=["cpu", "handshake"])
def test_reinit_reuses_pooled_shared_memory(handshake):
    """shutdown() pools the shared workspaces (still mapped), init takes the
    same ones back (same names and addresses) and stays exact;
    release_memory=True in every process unmaps them; when only process 1
    released, init falls back to fresh memory in both, exactly. `handshake`:
    the same with the GPUs' `closed` handshake (process 1's lone release
    keeps its memory until process 0 lets go at the next init), and the
    pooled memory released at exit without waiting. (Without it, also the
    GPU test's scenario, where the CPU has no CUDA graphs to replay.)"""
    rc, text, _ = launch(2, "pool", *(["--handshake"] if handshake else ["oldexec"]))
    assert rc == 0, _tail(text)
    for p in range(2):
        for what in ("reuse", "release", "mismatch"):
            assert lines_of(text, p, f"OK pool {what} n=2 handshake={handshake}"), _tail(text)
        assert handshake or lines_of(text, p, "OK oldexec n=2"), _tail(text)
        assert lines_of(text, p, "DONE"), _tail(text)
    assert "before exit" not in text, _tail(text)
    assert_no_leftovers(text)


def test_stale_objects_of_dead_processes_only_are_removed(stale_shared_memory):
    alive = Path(distributed.SHM_DIR) / f"{distributed.SHM_PREFIX}{os.getuid()}.{os.getppid()}.0.g0.r0"
    alive.write_bytes(b"\0" * 64)
    try:
        removed = distributed.clean_stale_shared_memory()
        assert stale_shared_memory.name in removed
        assert not stale_shared_memory.exists()
        assert alive.exists(), "an object of a live process was removed"
    finally:
        alive.unlink(missing_ok=True)


# ------------------------------------------------------------ the launcher --
def run_launcher(capfd, *argv: str, child: str):
    """The launcher, in this process, over plain Python children running `child`
    (their process id is `i`); returns (exit code, output, seconds)."""
    cmd = [sys.executable, "-c", "import os, sys, time\ni = int(os.environ['SIFAR_PROCESS_ID'])\n"
           + child]
    t0 = time.monotonic()
    rc = launch_module.main([*argv, "--platform", "cpu", "--", *cmd])
    out, err = capfd.readouterr()
    return rc, out + err, time.monotonic() - t0


def test_launcher_forwards_output_and_exit_code_and_kills_the_rest(capfd):
    rc, text, elapsed = run_launcher(
        capfd, "-n", "3", "--grace", "1",
        child="print('hello from', i, flush=True)\nif i == 1: sys.exit(5)\ntime.sleep(60)")
    assert rc == 5, text
    for i in range(3):
        assert f"[{i}] hello from {i}" in text, text
    assert "[launch] process 1 exited with code 5" in text, text
    assert re.search(r"killing processes \[0, 2\]", text), text
    assert elapsed < 20, f"the others were not killed in time ({elapsed:.0f} s)"


def test_launcher_bounds_the_whole_run(capfd):
    rc, text, elapsed = run_launcher(capfd, "-n", "2", "--timeout", "1",
                                     child="time.sleep(60)")
    assert rc == launch_module.EXIT_TIMEOUT == 124, text
    assert "timed out after 1 s" in text, text
    assert elapsed < 20


def test_launcher_gives_each_process_its_environment(capfd, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # replaced
    rc, text, _ = run_launcher(
        capfd, "-n", "2", "--devices-per-process", "3",
        child="print('env', i, os.environ['SIFAR_NUM_PROCESSES'], os.environ['JAX_PLATFORMS'],"
              " os.environ['XLA_FLAGS'], os.environ['SIFAR_COORDINATOR'])")
    assert rc == 0, text
    coordinators = set()
    for i in range(2):
        (line,) = lines_of(text, i, "env")
        _, _, pid, n, platform, flags, coordinator = line.split()
        assert (pid, n, platform) == (str(i), "2", "cpu")
        assert flags == "--xla_force_host_platform_device_count=3"
        coordinators.add(coordinator)
    assert len(coordinators) == 1 and coordinators.pop().startswith("127.0.0.1:")


# ----------------------------------------------------------------- the GPU --
@pytest.fixture
def gpus():
    n = len(gpu_device_list())
    if n == 0:
        pytest.skip("needs a CUDA GPU")
    return n


@pytest.mark.parametrize("share_gpu", [False, True], ids=["gpu-per-process", "shared-gpu"])
def test_gpu_two_processes_every_algorithm_exact(gpus, share_gpu):
    if not share_gpu and gpus < 2:
        pytest.skip("needs 2 GPUs (the shared-GPU variant runs on one)")
    rc, text, _ = launch(2, "exact", *(["--no-psum"] if share_gpu else []), platform="gpu",
                         share_gpu=share_gpu)
    assert rc == 0, _tail(text)
    assert_exact(text, 2, 2)


@pytest.mark.parametrize("share_gpu", [False, True], ids=["gpu-per-process", "shared-gpu"])
def test_gpu_fused_call_over_processes(gpus, share_gpu):
    """test_fused_call_over_processes on GPUs (the shared-GPU variant runs on one: two ranks
    time-slice one GPU, so it checks results, not speed)."""
    if not share_gpu and gpus < 2:
        pytest.skip("needs 2 GPUs (the shared-GPU variant runs on one)")
    assert_fused(*launch(2, "fused", platform="gpu", share_gpu=share_gpu)[:2])


@pytest.mark.parametrize("share_gpu", [False, True], ids=["gpu-per-process", "shared-gpu"])
def test_gpu_row_parallel_over_processes(gpus, share_gpu):
    """test_row_parallel_over_processes on GPUs (shared: two ranks on one GPU, no NCCL)."""
    if not share_gpu and gpus < 2:
        pytest.skip("needs 2 GPUs (the shared-GPU variant runs on one)")
    assert_rowpar(*launch(2, "rowpar", *(["--no-psum"] if share_gpu else []), platform="gpu",
                          share_gpu=share_gpu)[:2], 2)


def test_gpu_old_executable_after_reinit_in_two_processes(gpus):
    """Like test_gpu.py::test_old_executable_after_reinit_with_command_buffers,
    with one process per GPU: a function compiled (recorded into a CUDA graph)
    before shutdown() replays its IPC-mapped workspace pointers after init with
    the same slot (the pooled memory, reused and zeroed) and with another slot
    (the pooled memory kept mapped), beside functions compiled after, exactly."""
    if gpus < 2:
        pytest.skip("needs 2 GPUs")
    rc, text, _ = launch(2, "oldexec", platform="gpu")
    assert rc == 0, _tail(text)
    for p in range(2):
        assert lines_of(text, p, "OK oldexec n=2"), _tail(text)
        assert lines_of(text, p, "DONE"), _tail(text)
    assert "before exit" not in text, _tail(text)


def test_gpu_killed_process_is_named_within_the_timeout(gpus):
    if gpus < 2:
        pytest.skip("needs 2 GPUs")
    rc, text, _ = launch(2, "kill", "--algorithms", "sifar", "--timeout", "2", "--victim", "1",
                         "--after", "3", platform="gpu", grace=60)
    assert rc == 128 + 9, _tail(text)
    ok = lines_of(text, 0, "OK kill: call 4 failed after")
    assert ok and "rank 1 (process 1) never arrived" in ok[0], _tail(text)
