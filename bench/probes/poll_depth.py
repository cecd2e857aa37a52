"""Probe: sifar's and sifar_push's polling depth at the kernel level.

`sifar_push` waits by polling its own memory: a stale poll costs one L2 round
trip before the next one leaves, so the peer's words are seen on average half
an L2 round trip after they land.  Keeping `depth` polls in flight, `gap` ns
apart (the runtime knob `set_poll`), sees them sooner if the extra loads cost
less than they save.  (The first session swept this for `sifar`, whose polls
are remote loads: no gain.)  Per setting: the kernel level of bench.allreduce,
(t(R2) - t(R1)) / (R2 - R1) for R all-reduces in one launch, median and
p10-p90 of `--runs` paired runs, and the warp re-reads per call (stats()).

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
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="CPU: few runs, short launches")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = p.parse_args(argv)
    r1, r2 = (int(v) for v in args.repeat.split(","))
    runs = args.runs
    if args.quick:
        r1, r2, runs = 2, 20, 3
    from sifar_jax import _ext

    kind, devices = common.bench_devices(2)
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("tp",))
    sifar_jax.init(mesh)
    comm_id = sifar_jax.communicators("tp")[0].comm_id
    records = []
    for kb in (float(v) for v in args.kb.split(",")):
        elems = int(kb * 1024) // 2
        x = ba.as_bf16(common.random_payload(int(kb), 2, elems))
        for alg in args.algorithms.split(","):
            small, large = ba.kernel_fn(mesh, alg, r1), ba.kernel_fn(mesh, alg, r2)
            for setting in args.settings.split(","):
                depth, gap = (int(v) for v in setting.split(":"))
                _ext._sifar.set_poll(comm_id, depth, gap)
                try:
                    common.warm_up(small, (x,))
                    common.warm_up(large, (x,))
                    before = sifar_jax.stats()[alg]
                    samples = common.paired_differences(small, large, (x,), r2 - r1, runs)
                    after = sifar_jax.stats()[alg]
                finally:
                    _ext._sifar.set_poll(comm_id, 1, 0)
                calls = max(1, after["calls"] - before["calls"])
                rec = dict(algorithm=alg, kb=kb, depth=depth, gap_ns=gap, level="kernel",
                           retries_per_call=round((after["retries"] - before["retries"]) / calls, 3),
                           **common.summarize_us(samples))
                records.append(rec)
                print(f"{alg:10s} {kb:5.1f} KB depth {depth} gap {gap:4d} ns: {rec['us_median']:6.3f} us "
                      f"({rec['us_p10']:.3f}-{rec['us_p90']:.3f}), warp re-reads/call {rec['retries_per_call']}",
                      flush=True)
    sifar_jax.check()
    if args.out:
        Path(args.out).write_text(json.dumps(dict(environment=common.describe_environment(devices),
                                                  records=records), indent=1))
        print("wrote", args.out)


if __name__ == "__main__":
    main()
