"""Per-call device trace of sifar all-reduces: mis-speculation and tail latency.

`sifar_jax.call_trace(axis_name)` records one entry per call and rank (group, rank, epoch, chain,
algorithm, start_ns, end_ns on %globaltimer or the host's steady clock, retried: block 0 re-read a
stale word). Each rank keeps its last RING_CALLS calls, so `collect` traces in blocks that never
wrap. `summarize` gives the retried share (block 0's view: a lower bound), clean and retried
latencies, cost = 1 - mean(clean) / mean(all) (an upper bound) and p50-p99.9 tails.
"""

from __future__ import annotations

import contextlib

import numpy as np

from bench import common

FIELDS = ("group", "rank", "epoch", "algorithm", "start_ns", "end_ns", "retried")
RING_CALLS = 4096  # calls each rank's trace ring keeps (ffi/core/protocol.h kTraceCapacity)


def collect(call_trace, axis_name: str, fn, args: tuple, runs: int, calls_per_run: int,
            skew_us: float = 0.0, ring_calls: int = RING_CALLS) -> np.ndarray:
    """Every record of `runs` waited runs of fn(*args) (`calls_per_run` all-reduces per rank
    each), traced in blocks of at most `ring_calls` calls, with a random 0..skew_us wait per
    rank before each all-reduce when skew_us > 0."""
    from sifar_jax import testing

    per_block = max(1, ring_calls // max(1, calls_per_run))
    parts = []
    with testing.inject_skew(skew_us) if skew_us > 0 else contextlib.nullcontext():
        for done in range(0, runs, per_block):
            with call_trace(axis_name) as t:
                for _ in range(min(per_block, runs - done)):
                    common.block(fn(*args))
            parts.append(np.asarray(t.records()))
    rec = np.concatenate(parts)
    missing = [f for f in FIELDS if rec.dtype.names is None or f not in rec.dtype.names]
    if missing:
        raise ValueError(f"call_trace records lack the fields {missing} (have {rec.dtype.names})")
    return rec


def chain_seconds_per_call(rec: np.ndarray, calls_per_run: int) -> list[float]:
    """Per rank and run of a chain of `calls_per_run` all-reduces: (end of the last call - end of
    the first) / (calls_per_run - 1) on the device's clock, so the host's dispatch and the ranks'
    start skew fall outside it."""
    out = []
    for rank in np.unique(rec["rank"]):
        mine = rec[(rec["rank"] == rank) & (rec["start_ns"] > 0)]
        ends = np.sort(mine["end_ns"].astype(np.int64))
        for i in range(0, ends.size - calls_per_run + 1, calls_per_run):
            run = ends[i:i + calls_per_run]
            out.append(float(run[-1] - run[0]) / (calls_per_run - 1) * 1e-9)
    return out


def latencies_us(rec: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(latency in us of each valid record, the mask: written, start > 0, and end > start)."""
    start = rec["start_ns"].astype(np.int64)
    end = rec["end_ns"].astype(np.int64)
    ok = (start > 0) & (end > start)
    return (end - start)[ok] / 1e3, ok


def summarize(rec: np.ndarray) -> dict:
    """Mis-speculation and tails of one trace (see the module docstring)."""
    lat, ok = latencies_us(rec)
    retried = np.asarray(rec["retried"])[ok]
    hit = retried > 0
    clean, missed = lat[~hit], lat[hit]

    def r(v):
        return None if v is None or not np.isfinite(v) else round(float(v), 4)

    mean_all = lat.mean() if lat.size else None
    mean_clean = clean.mean() if clean.size else None
    out = {
        "calls": int(lat.size),
        "invalid_records": int((~ok).sum()),
        "ranks": int(np.unique(rec["rank"]).size),
        "retried_share": r(hit.mean()) if lat.size else None,
        "us_mean": r(mean_all),
        "us_median_clean": r(np.median(clean)) if clean.size else None,
        "us_median_retried": r(np.median(missed)) if missed.size else None,
        "us_mean_clean": r(mean_clean),
        "us_mean_retried": r(missed.mean()) if missed.size else None,
        "cost_share": r(1 - mean_clean / mean_all) if mean_clean and mean_all else None,
        **common.tails_us(lat),
    }
    if retried.dtype.kind in "iu":  # a count, not a flag: retries per call as the trace saw them
        out["retries_per_call_trace"] = r(retried.mean()) if retried.size else None
    return out

