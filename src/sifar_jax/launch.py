"""Starts one program in several processes on this host, with jax.distributed.

    python -m sifar_jax.launch -n 2 -- python -m bench.allreduce
    python -m sifar_jax.launch -n 4 --platform cpu -- python my_program.py

Each process gets the coordinator (localhost, a free port), its process id
and the process count in its environment; the program calls
`sifar_jax.distributed.initialize()` first thing. On GPUs process i gets GPU
i (`--devices-per-process k`: GPUs i*k .. i*k+k-1; `--share-gpu`: all use
GPU 0, for correctness runs only); on the CPU each process gets its own
XLA:CPU host devices and cross-process CPU collectives (gloo) for lax.psum.

Output lines are forwarded with a "[i] " prefix. The launcher exits with the
first non-zero exit code (128 + signal for a killed process); once a process
fails, the others get `--grace` seconds to report and are then killed. The
whole run is bounded by `--timeout` (exit code 124).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

# The environment each process gets (read by sifar_jax.distributed.initialize).
ENV_COORDINATOR = "SIFAR_COORDINATOR"
ENV_NUM_PROCESSES = "SIFAR_NUM_PROCESSES"
ENV_PROCESS_ID = "SIFAR_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "SIFAR_LOCAL_DEVICE_IDS"

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
EXIT_TIMEOUT = 124


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m sifar_jax.launch",
        description="Run a JAX program in several processes on this host (jax.distributed on "
                    "localhost), one per GPU or each with its own CPU devices.",
        usage="python -m sifar_jax.launch -n N [options] -- command [args...]",
    )
    p.add_argument("-n", "--nproc", type=int, required=True, help="number of processes")
    p.add_argument("--devices-per-process", type=int, default=1,
                   help="GPUs (or XLA:CPU host devices) per process (default 1)")
    p.add_argument("--platform", choices=("auto", "gpu", "cpu"), default="auto",
                   help="gpu when nvidia-smi lists a GPU (auto, default), else cpu")
    p.add_argument("--share-gpu", action="store_true",
                   help="every process uses the same GPU(s) (correctness runs on a 1-GPU host)")
    p.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds before every process is killed (default 1800; 0: none)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds the others get, once a process failed, before they are "
                        "killed (default 10)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- command [args...]")
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        p.error("give the command to run after --")
    if args.nproc < 1 or args.devices_per_process < 1:
        p.error("-n and --devices-per-process must be >= 1")
    return args


def gpu_count() -> int:
    """GPUs nvidia-smi lists (0 without it); the launcher never imports jax."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_envs(args, platform: str, port: int, gpus: int) -> list[dict]:
    """The environment of every process."""
    k = args.devices_per_process
    if platform == "gpu":
        need = k if args.share_gpu else args.nproc * k
        if need > gpus:
            raise SystemExit(f"sifar_jax.launch: {args.nproc} processes x {k} GPUs need {need} "
                             f"GPUs, this host has {gpus} (--share-gpu runs them on GPU 0..)")
    envs = []
    for i in range(args.nproc):
        env = dict(os.environ)
        env.update({
            ENV_COORDINATOR: f"127.0.0.1:{port}",
            ENV_NUM_PROCESSES: str(args.nproc),
            ENV_PROCESS_ID: str(i),
            "PYTHONUNBUFFERED": "1",
        })
        if platform == "gpu":
            first = 0 if args.share_gpu else i * k
            env[ENV_LOCAL_DEVICE_IDS] = ",".join(str(first + j) for j in range(k))
            # Several processes share each GPU's memory: allocate on demand.
            env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        else:
            flags = re.sub(rf"{_DEVICE_COUNT_FLAG}=\S+", "", env.get("XLA_FLAGS", ""))
            env["XLA_FLAGS"] = f"{flags} {_DEVICE_COUNT_FLAG}={k}".strip()
            env["JAX_PLATFORMS"] = "cpu"
            env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
        envs.append(env)
    return envs


def _forward(i: int, stream, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            sys.stdout.write(f"[{i}] {line.decode(errors='replace')}")
            sys.stdout.flush()
    stream.close()


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by signal s: 128 + s, as a shell reports it


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


def _kill(procs) -> None:
    """SIGTERM to every live process group, SIGKILL to those still alive 3 s later."""
    live = [p for p in procs if p.poll() is None]
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(p.poll() is None for p in live):
            time.sleep(0.05)
        live = [p for p in live if p.poll() is None]
        if not live:
            return


def run(args) -> int:
    gpus = gpu_count() if args.platform in ("auto", "gpu") else 0
    platform = args.platform if args.platform != "auto" else ("gpu" if gpus else "cpu")
    port = args.port or free_port()
    envs = process_envs(args, platform, port, gpus)
    lock = threading.Lock()
    procs, threads = [], []
    for i, env in enumerate(envs):
        # Own session: killing a process kills whatever it started too.
        p = subprocess.Popen(args.command, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        t = threading.Thread(target=_forward, args=(i, p.stdout, lock), daemon=True)
        t.start()
        threads.append(t)

    def say(msg: str) -> None:
        with lock:
            print(f"[launch] {msg}", file=sys.stderr, flush=True)

    start = time.monotonic()
    first_failure: int | None = None
    kill_at = start + args.timeout if args.timeout > 0 else float("inf")
    timed_out = False
    reported = set()
    try:
        while any(p.poll() is None for p in procs):
            for i, p in enumerate(procs):
                rc = p.poll()
                if rc is None or i in reported:
                    continue
                reported.add(i)
                if rc != 0:
                    say(f"process {i} {_describe(rc)}")
                    if first_failure is None:
                        first_failure = _exit_code(rc)
                        kill_at = min(kill_at, time.monotonic() + args.grace)
            if time.monotonic() >= kill_at:
                live = [i for i, p in enumerate(procs) if p.poll() is None]
                if first_failure is None:
                    timed_out = True
                    say(f"timed out after {args.timeout:g} s; killing processes {live}")
                else:
                    say(f"killing processes {live} ({args.grace:g} s after the first failure)")
                _kill(procs)
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        say("interrupted; killing every process")
        _kill(procs)
        return 130
    for t in threads:
        t.join(timeout=5)
    for i, p in enumerate(procs):
        rc = p.wait()
        if rc != 0 and i not in reported:
            say(f"process {i} {_describe(rc)}")
        if rc != 0 and first_failure is None and not timed_out:
            first_failure = _exit_code(rc)
    if timed_out:
        return EXIT_TIMEOUT
    return first_failure or 0


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
