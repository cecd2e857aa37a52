"""Probe: sifar's and sifar_push's polling depth at the kernel level.

`sifar_push` waits by polling its own memory: a stale poll costs one L2 round
trip before the next one leaves, so the peer's words are seen on average half
an L2 round trip after they land.  Keeping `depth` polls in flight, `gap` ns
apart (the runtime knob `set_poll`), sees them sooner if the extra loads cost
less than they save.  (The first session swept this for `sifar`, whose polls
are remote loads: no gain at the kernel level, 0.13 us at the jit level.)
Per setting, bench.allreduce's levels: kernel ((t(R2) - t(R1)) / (R2 - R1)
for R all-reduces in one launch), jit (the same for chains of C1 and C2
all-reduces in one jit) and jit_device (a chain of C2 timed per call on the
device, sifar_jax.call_trace), each the median and p10-p90 of `--runs` runs,
and the warp re-reads per call (stats()).

    python -m bench.probes.poll_depth                      # GPU host, TP=2
    python -m bench.probes.poll_depth --settings 1:0,2:40 --kb 8,32
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import common

common.use_host_devices(8)  # before jax is imported; only XLA:CPU reads it

import jax  # noqa: E402
import numpy as np  # noqa: E402

import sifar_jax  # noqa: E402
from bench import allreduce as ba  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithms", default="sifar_push,sifar")
    p.add_argument("--settings", default="1:0,2:0,2:40,2:100,3:30,4:0,4:25",
                   help="depth:gap_ns pairs; depth <= 4")
    p.add_argument("--kb", default="8", help="payload sizes in KB")
    p.add_argument("--repeat", default="10,2000", help="R1,R2 all-reduces per launch")
    p.add_argument("--chain", default="20,200", help="C1,C2 all-reduces per jit chain")
    p.add_argument("--levels", default="kernel,jit,jit_device")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="CPU: few runs, short launches")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = p.parse_args(argv)
    r1, r2 = (int(v) for v in args.repeat.split(","))
    c1, c2 = (int(v) for v in args.chain.split(","))
    runs = args.runs
    if args.quick:
        r1, r2, c1, c2, runs = 2, 20, 2, 6, 3
    levels = args.levels.split(",")
    from bench import calltrace
    from sifar_jax import _ext

    kind, devices = common.bench_devices(2)
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("tp",))
    sifar_jax.init(mesh)
    comm_id = sifar_jax.communicators("tp")[0].comm_id
    traced, why_not = calltrace.find()
    if "jit_device" in levels and traced is None:
        print(f"NOTE: no jit_device level: {why_not}", flush=True)
        levels.remove("jit_device")
    records = []
    for kb in (float(v) for v in args.kb.split(",")):
        elems = int(kb * 1024) // 2
        x = ba.on_mesh(mesh, ba.as_bf16(common.random_payload(int(kb), 2, elems)))
        for alg in args.algorithms.split(","):
            fns = {"kernel": (ba.kernel_fn(mesh, alg, r1), ba.kernel_fn(mesh, alg, r2), r2 - r1),
                   "jit": (ba.chain_fn(mesh, alg, c1), ba.chain_fn(mesh, alg, c2), c2 - c1)}
            fns["jit_device"] = (None, fns["jit"][1], c2)
            for setting in args.settings.split(","):
                depth, gap = (int(v) for v in setting.split(":"))
                _ext.lib.set_poll(comm_id, depth, gap)
                try:
                    for level in levels:
                        small, large, extra = fns[level]
                        for f in (small, large):
                            if f is not None:
                                common.warm_up(f, (x,))
                        before = sifar_jax.stats()[alg]
                        if level == "jit_device":
                            rec = calltrace.collect(traced, "tp", large, (x,), runs, extra)
                            samples = calltrace.chain_seconds_per_call(rec, extra)
                        else:
                            samples = common.paired_differences(small, large, (x,), extra, runs)
                        after = sifar_jax.stats()[alg]
                        calls = max(1, after["calls"] - before["calls"])
                        r = dict(algorithm=alg, kb=kb, depth=depth, gap_ns=gap, level=level,
                                 retries_per_call=round((after["retries"] - before["retries"]) / calls, 3),
                                 **common.summarize_us(samples))
                        records.append(r)
                        print(f"{alg:10s} {kb:5.1f} KB depth {depth} gap {gap:4d} ns {level:10s}: "
                              f"{common.fmt_latency(r, ' us'):>9s} ({r['us_p10']:.3f}-{r['us_p90']:.3f}), "
                              f"warp re-reads/call {r['retries_per_call']}", flush=True)
                finally:
                    _ext.lib.set_poll(comm_id, 1, 0)
    sifar_jax.check()
    if args.out:
        Path(args.out).write_text(json.dumps(dict(environment=common.describe_environment(devices),
                                                  records=records), indent=1))
        print("wrote", args.out)


if __name__ == "__main__":
    main()
