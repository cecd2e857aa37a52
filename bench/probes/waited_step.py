"""Probe: where a waited (sync) decode step's time goes beyond the device's step.

A sync step is `advance()` (the host dispatches the compiled step: the decoder's parameter
leaves and its state, 204 arrays at 8B shapes; 267 before the KV cache became one array), the
device's step, then `token()` (the token's copy to the host). Issue 22 asks sync <= 1.25x
pipelined; at TP=1 it measured 1.31x, 1.18-1.21x since. This splits each waited step into

    dispatch  advance() returning (host: argument handling, launch)
    wait      the state's token ready after that (device: the step, and whatever the launch
              left to do)
    read      token() once the token is ready (the copy to the host)

and times executables that take the same arguments and do nearly nothing (pos + 1, the state
donated as the step's is), which is the per-call cost of the arguments alone:

    null_all    the parameter leaves and the state
    null_state  the state only

The device's own step is the pipelined time (back-to-back steps). Run it once per XLA setting to
compare (e.g. XLA_FLAGS=--xla_gpu_enable_command_buffer= for command buffers off).

    python -m bench.probes.waited_step                    # GPU host: llama3_8b, TP=1
    python -m bench.probes.waited_step --pack both        # norm scales packed or not, paired
    python -m bench.probes.waited_step --quick            # CPU: the tiny model
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import jax

from bench import common


PIPELINED = {"warmup": 0, "samples": 5}  # bench.decode.time_pipelined's settings here


def _median_us(xs) -> float:
    return round(statistics.median(xs) * 1e6, 1)


def time_waited(dec, steps: int, early_copy: bool = False) -> dict:
    """Median dispatch / wait / read microseconds of `steps` waited steps (early_copy: the
    token's copy to the host issued right after the dispatch)."""
    parts = {"dispatch": [], "wait": [], "read": [], "total": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        dec.advance()
        t1 = time.perf_counter()
        tok = dec.seq.last_tok if dec.seq.last_tok is not None else dec.state["tok"]  # token()'s
        if early_copy:
            tok.copy_to_host_async()
        tok.block_until_ready()
        t2 = time.perf_counter()
        dec.token()
        t3 = time.perf_counter()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            parts[k].append(v)
    return {k: _median_us(v) for k, v in parts.items()}


def time_null(dec, with_leaves: bool, calls: int) -> dict:
    """Median dispatch and dispatch-to-ready microseconds of an executable with the decoder's
    arguments (or its state only) that adds 1 to pos."""
    def bump_all(leaves, st):
        return dict(st, pos=st["pos"] + 1)

    def bump_state(st):
        return dict(st, pos=st["pos"] + 1)

    if with_leaves:
        exe = dec.exes.finish(dec.exes.lower(bump_all))
        call = lambda: exe(dec.weights.leaves, dec.state)  # noqa: E731
    else:
        shardings = jax.tree.map(lambda a: a.sharding, dec.state)
        exe = jax.jit(bump_state, donate_argnums=0, in_shardings=(shardings,),
                      out_shardings=shardings).lower(dec.state).compile()
        call = lambda: exe(dec.state)  # noqa: E731
    dispatch, total = [], []
    for i in range(calls + 3):
        t0 = time.perf_counter()
        dec.state = call()
        t1 = time.perf_counter()
        dec.state["pos"].block_until_ready()
        t2 = time.perf_counter()
        if i >= 3:
            dispatch.append(t1 - t0)
            total.append(t2 - t0)
    dec.state = dict(dec.state, pos=dec.state["pos"] - (calls + 3))  # back where it was
    return {"dispatch": _median_us(dispatch), "total": _median_us(total)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.waited_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--variant", default="psum", help="a bench.probes.step_kernels variant")
    p.add_argument("--steps", type=int, default=40, help="waited steps timed")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--preset", default=None, help="default: llama3_8b (tiny with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny model (CPU)")
    p.add_argument("--pack", choices=("default", "on", "off", "both"), default="default",
                   help="Decoder(pack_params=...): the norm scales as one array (models/"
                        "param_pack.py); both: the two alternate, --repeat rounds")
    p.add_argument("--repeat", type=int, default=2, help="rounds with --pack both")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = p.parse_args(argv)
    from bench import decode as bd
    from bench.probes.step_kernels import VARIANTS
    from models import families, make_mesh

    platform, devices = common.bench_devices(min_gpus=1)
    gpu = platform == "gpu"
    preset = args.preset or ("tiny" if args.quick or not gpu else "llama3_8b")
    config = bd.PRESETS[preset]().replace(dtype="bfloat16" if gpu else "float32",
                                          max_seq_len=args.context)
    mesh = make_mesh(args.tp, devices=devices[:args.tp])
    params = families.family_of(config).random_params(config, mesh, seed=0)
    settings = {"default": (None,), "on": (True,), "off": (False,), "both": (True, False)}[args.pack]
    decs = [bd.make_decoder(config, mesh, params, VARIANTS[args.variant], 1, args.context, 0,
                            pack_params=s) for s in settings]
    need = 3 + 2 * args.steps + 5 * 24 + 8  # warm-up, waited steps, pipelined samples

    def measure(dec) -> dict:
        dec.seek(args.context - need, bd.start_tokens(config, 1, 0))
        dec.advance(3)  # compiled and warm
        dec.token()
        m = {"pack_params": dec.pack_params,
             "arrays_per_step": len(dec.weights.leaves) + len(jax.tree.leaves(dec.state)),
             "waited_us": time_waited(dec, args.steps),
             "waited_early_copy_us": time_waited(dec, args.steps, early_copy=True),
             "pipelined_us": _median_us(bd.time_pipelined(dec, PIPELINED)[0]),
             "null_all_us": time_null(dec, True, args.steps),
             "null_state_us": time_null(dec, False, args.steps)}
        m["waited_over_pipelined"] = round(m["waited_us"]["total"] / m["pipelined_us"], 3)
        return m

    r = {"host": common.host_tag(devices), "tp": args.tp, "preset": preset,
         "variant": args.variant, "context": args.context,
         "xla_flags": os.environ.get("XLA_FLAGS", ""),
         "token_memory": decs[0].exes.tok_sharding.memory_kind}
    if len(decs) == 1:
        r.update(measure(decs[0]))
    else:  # the settings alternate, `repeat` rounds: paired in one process
        r["runs"] = [measure(dec) for _ in range(args.repeat) for dec in decs]
    for k, v in r.items():
        print(f"{k}: {v}", flush=True)
    if args.out:
        print(f"wrote {common.write_json(Path(args.out), r)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
