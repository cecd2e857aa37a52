"""Probe: the host's cost of one compiled call by argument count and donation, and of reading a
small result back, on this host's first device.

The waited decode step (`bench.probes.waited_step`) spends ~1.2 ms dispatching and ~0.5 ms
reading a 4-byte token at 8B shapes on one H200, and an executable that only adds 1 to the
state's position costs ~0.4 ms per call there. This separates what that costs: N small arrays
passed (donated or not) to an executable that changes one of them (the rest returned as they
are, aliased where donated, as the decoder's state is), and the read of a ready 4-byte array
(np.asarray; with copy_to_host_async issued at dispatch).

    python -m bench.probes.dispatch_cost [--out x.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import common

COUNTS = (1, 8, 32, 72, 128, 272)


def _us(xs) -> float:
    return round(statistics.median(xs) * 1e6, 1)


def call_cost(n: int, donate: bool, calls: int) -> dict:
    """Median dispatch and dispatch-to-ready microseconds of f(xs) = [xs[0] + 1, *xs[1:]]."""
    dev = jax.devices()[0]
    xs = [jax.device_put(np.full(4, i, np.int32), dev) for i in range(n)]

    def f(xs):
        return [xs[0] + 1, *xs[1:]] if donate else xs[0] + 1

    exe = jax.jit(f, donate_argnums=(0,) if donate else ()).lower(xs).compile()
    dispatch, total = [], []
    for i in range(calls + 3):
        t0 = time.perf_counter()
        out = exe(xs)
        t1 = time.perf_counter()
        (out[0] if donate else out).block_until_ready()
        t2 = time.perf_counter()
        if donate:
            xs = out
        if i >= 3:
            dispatch.append(t1 - t0)
            total.append(t2 - t0)
    return {"n": n, "donate": donate, "dispatch_us": _us(dispatch), "total_us": _us(total)}


def read_cost(calls: int) -> dict:
    """Median microseconds of reading a ready 4-byte result on the host, by route: np.asarray;
    after copy_to_host_async issued at dispatch; jax.device_get; a result the executable writes
    to pinned host memory (memory kind pinned_host, where the backend has it)."""
    dev = jax.devices()[0]
    bump = jax.jit(lambda x: x + 1)
    routes = {"asarray": (bump, False, np.asarray), "async_copy": (bump, True, np.asarray),
              "device_get": (bump, False, jax.device_get)}
    if "pinned_host" in {m.kind for m in dev.addressable_memories()}:
        host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        routes["pinned_host_result"] = (jax.jit(lambda x: x + 1, out_shardings=host), False,
                                        np.asarray)
    out = {}
    for name, (fn, early, read) in routes.items():
        x = jax.device_put(np.zeros(1, np.int32), dev)
        times = []
        for i in range(calls + 3):
            y = fn(x)
            if early:
                y.copy_to_host_async()
            y.block_until_ready()
            t0 = time.perf_counter()
            read(y)
            t1 = time.perf_counter()
            if i >= 3:
                times.append(t1 - t0)
        out[name + "_us"] = _us(times)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.dispatch_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = p.parse_args(argv)
    r = {"host": common.host_tag(jax.devices()), "backend": jax.default_backend(),
         "calls": [call_cost(n, d, args.calls) for d in (False, True) for n in COUNTS],
         "read": read_cost(args.calls)}
    for c in r["calls"]:
        print(c, flush=True)
    print(r["read"], flush=True)
    if args.out:
        print(f"wrote {common.write_json(Path(args.out), r)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
