"""XLA's own one-shot all-reduce kernel, a peer of bench.allreduce (bench.peers runs this):
lax.psum chains timed as bench.allreduce's jit level, in a process of its own because XLA reads
XLA_FLAGS once; each size checked against the float64 sum first. On XLA:CPU the flag does
nothing: a test of the code path, not a result.
"""

from __future__ import annotations

import argparse
import os
import sys
import zlib

from bench import peers

if peers.XLA_ONE_SHOT_FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    # Run by hand without the flag: add it (before jax is imported, by bench.allreduce).
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {peers.XLA_ONE_SHOT_FLAG}".strip()

from bench import common  # noqa: E402
from bench.allreduce import measure as ours  # noqa: E402  (imports jax)

NAME = peers.XLA_ONE_SHOT


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.peers.xla_one_shot",
                                description="lax.psum chains with XLA's one-shot kernel.")
    p.add_argument("--tp", required=True, help="comma list of TP sizes")
    args = peers.child_args(p, argv)
    args.tp = [int(v) for v in args.tp.split(",")]
    return args


def measure(mesh, tp: int, nbytes: int, args) -> dict:
    import numpy as np

    x_np = common.random_payload(zlib.crc32(repr((tp, NAME, nbytes)).encode()), tp, nbytes // 2)
    x = ours.as_bf16(x_np)
    got = np.asarray(ours.chain_fn(mesh, ours.BASELINE, 1)(x), np.float32)
    wrong = common.allreduce_mismatch(got, x_np)
    if wrong:
        return {"error": f"WRONG RESULT, not timed: {wrong}"}
    cfg = {"chain": args.chain, "warmup": args.warmup, "runs": args.runs, "inner_jit": 1}
    rec = ours.timed_case(mesh, {}, cfg, tp, peers.LEVEL_JIT, ours.BASELINE, nbytes, x)
    return dict(rec, algorithm=NAME, runs=args.runs, chain=list(args.chain))


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np
    from jax.sharding import Mesh

    out = {"records": [], "errors": [], "info": {}}
    kind, devices = common.bench_devices()
    out["info"]["xla_one_shot_platform"] = kind
    for tp in args.tp:
        if tp > len(devices):
            out["errors"].append({"algorithm": NAME, "tp": tp,
                                  "error": f"needs {tp} devices, have {len(devices)} ({kind})"})
            continue
        mesh = Mesh(np.array(devices[:tp]), ("tp",))
        for nbytes in args.sizes:
            try:
                res = measure(mesh, tp, nbytes, args)
            except Exception as e:  # noqa: BLE001 - recorded; the next size goes on
                res = {"error": f"{type(e).__name__}: {e}".strip()}
            if kind == "cpu" and "error" not in res:
                res["note"] = "XLA:CPU: the flag has no effect here"
            peers.add_result(out, args.json, NAME, tp, nbytes, res, cpu=kind == "cpu")
    peers.write_partial(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
