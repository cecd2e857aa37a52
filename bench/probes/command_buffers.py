"""Probe: does XLA:GPU re-record a decode step's command buffer on every waited step?

XLA:GPU replays a recorded command buffer (a CUDA graph of the step's kernels) only while every
buffer its commands use keeps its address; a result that aliases no donated argument and gets a
fresh device buffer each call makes it update (re-record) the graph on every call. This runs
waited steps of three executables on the same decoder and counts, per executable, the command
buffer initialisations, updates and executions XLA logs (`TF_CPP_VMODULE=command_buffer_thunk=3`,
read from a child process's stderr), beside each one's median waited-step time:

    step          the decoder's step: the state donated, its token also written to pinned host
                  memory (the decoder's exes.tok_sharding)
    device_token  the same step with its token result in device memory
    no_token      the same step returning the state only

Measured on one H200 (Llama-8B, TP=1, lax.psum, KV 1K, 2026-12-01): `step` initialised once
and never updated; `device_token` updated on 23 of 24 steps and took ~0.6 ms more per waited
step (docs/performance.md, Ideas tried).

    python -m bench.probes.command_buffers              # GPU host: llama3_8b, TP=1
    python -m bench.probes.command_buffers --quick      # CPU: the tiny model (no command buffers)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter

MARK = "@@command_buffers"
EVENTS = {"init": "Initialized command buffer", "update": "Updated command buffer",
          "execute": "Execute command buffer"}
VARIANTS = ("step", "device_token", "no_token")


def _mark(text: str) -> None:
    """A line in the child's stderr between XLA's own (flushed first, so the order holds)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(2, f"{MARK} {text}\n".encode())


def child(args) -> None:
    """Builds the decoder, compiles the three executables, runs args.steps waited steps of each
    (twice, interleaved), marking each step in stderr and printing each median time."""
    import statistics

    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from bench import common
    from bench import decode as bd
    from bench.probes.step_kernels import VARIANTS as STEP_VARIANTS
    from models import families, make_mesh

    platform, devices = common.bench_devices(min_gpus=1)
    preset = args.preset or ("tiny" if args.quick or platform != "gpu" else "llama3_8b")
    config = bd.PRESETS[preset]().replace(
        dtype="bfloat16" if platform == "gpu" else "float32", max_seq_len=args.context)
    mesh = make_mesh(1, devices=devices[:1])
    params = families.family_of(config).random_params(config, mesh, seed=0)
    dec = bd.make_decoder(config, mesh, params, STEP_VARIANTS["psum"], 1, args.context, 0)
    dec.seek(args.context - (6 * args.steps + 8), bd.start_tokens(config, 1, 0))
    dec.advance(3)  # compiled and warm
    dec.token()
    bucket, mode = dec.seq.step[0], dec.sampling.mode
    append = lambda p, st: dec.exes.append(p, st, st["tok"], bucket, mode)  # noqa: E731
    device_token = lambda p, st: (lambda s: (s, s["tok"][:, 0]))(append(p, st))  # noqa: E731
    exes = {"step": dec.compiled_step(),  # the others with the decoder's compile options
            "device_token": dec.exes.finish(dec.exes.lower(device_token,
                                                   outputs=(NamedSharding(mesh, P()),))),
            "no_token": dec.exes.finish(dec.exes.lower(append))}
    times = {v: [] for v in VARIANTS}
    for _ in range(2):
        for name, exe in exes.items():
            for i in range(args.steps):
                _mark(f"{name} {i}")
                t0 = time.perf_counter()
                out = exe(dec.weights.leaves, dec.state)
                if name == "no_token":
                    dec.state = out
                    dec.state["pos"].block_until_ready()
                else:
                    dec.state, tok = out
                    np.asarray(tok)
                times[name].append(time.perf_counter() - t0)
    _mark("end")
    for name, ts in times.items():
        print(f"{MARK} time {name} {statistics.median(ts[2:]) * 1e6:.1f}", flush=True)


def count_events(log: str) -> dict[str, Counter]:
    """{variant: Counter(init, update, execute)} from the child's stderr (the lines after a
    variant's step marks, up to the next mark)."""
    counts = {v: Counter() for v in VARIANTS}
    current = None
    for line in log.splitlines():
        if line.startswith(MARK):
            word = line.split()[1]
            current = word if word in counts else None
            continue
        if current is not None:
            for event, text in EVENTS.items():
                if text in line:
                    counts[current][event] += 1
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.command_buffers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="waited steps per executable and round")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--preset", default=None, help="default: llama3_8b (tiny with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny model (CPU)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="command_buffer_thunk=3")
    cmd = [sys.executable, "-m", "bench.probes.command_buffers", "--child",
           "--steps", str(args.steps), "--context", str(args.context)]
    cmd += (["--preset", args.preset] if args.preset else []) + (["--quick"] if args.quick else [])
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if run.returncode:
        sys.stderr.write(run.stderr[-4000:])
        return run.returncode
    counts = count_events(run.stderr)
    times = dict(re.findall(rf"^{MARK} time (\S+) (\S+)$", run.stdout, re.M))
    steps = 2 * args.steps
    print(f"{'executable':>14}  {'steps':>5}  {'init':>4}  {'update':>6}  {'execute':>7}  waited us")
    for v in VARIANTS:
        c = counts[v]
        print(f"{v:>14}  {steps:>5}  {c['init']:>4}  {c['update']:>6}  {c['execute']:>7}  "
              f"{times.get(v, '-')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
