"""bench.allreduce's tables: sifar against every peer (peer / sifar), the levels' latencies, the
per-call trace and what ran (sifar_jax.stats(), the checks against lax.psum)."""

from __future__ import annotations

from bench import common, report
from bench.allreduce.settings import BASELINE, LEVELS, PORTABLE

# ---------------------------------------------------------------- comparison --
def comparison(records) -> list[dict]:
    """sifar (jit level) against every algorithm not ours, per TP and size: ratio = peer / sifar
    (> 1: sifar is faster); None where either median is not resolved above its noise."""
    ours = {(r["tp"], r["bytes"]): r["us_median"] for r in records
            if r["algorithm"] == "sifar" and r["level"] == "jit"}
    out = []
    for r in (r for r in records if r["algorithm"] not in PORTABLE):
        s, peer = ours.get((r["tp"], r["bytes"])), r["us_median"]
        out.append({"tp": r["tp"], "bytes": r["bytes"], "peer": r["algorithm"],
                    "peer_level": r["level"], "peer_us": peer, "sifar_us": s,
                    "ratio": round(peer / s, 3) if s and peer is not None else None})
    return out


# -------------------------------------------------------------------- output --
def _speedup_row(level, rs, sizes):
    """sifar relative to lax.psum (jit) or to the best barrier algorithm (kernel)."""
    by = {(r["algorithm"], r["bytes"]): r["us_median"] for r in rs}
    if "sifar" not in {r["algorithm"] for r in rs}:
        return None
    bases, name = ((BASELINE,), "lax.psum") if level == "jit" else (
        ("oneshot", "twoshot"), "best of oneshot/twoshot")
    cells = []
    for b in sizes:
        s = by.get(("sifar", b))
        base = min((by[(a, b)] for a in bases if by.get((a, b)) is not None), default=None)
        cells.append(f"{(1 - s / base) * 100:+.0f}%" if s and base and base > 0 else "-")
    return [f"sifar: latency saved vs {name}"] + cells


def _cell(r, with_spread: bool) -> str:
    if r is None:
        return "-"
    if r["us_median"] is None:
        return common.fmt_latency(r)
    if with_spread:
        return (f"{common.fmt_us(r['us_median'])} "
                f"({common.fmt_us(r['us_p10'])}-{common.fmt_us(r['us_p90'])})")
    return common.fmt_us(r["us_median"])


def tables(records, sizes, with_spread: bool, speedup: bool = True):
    out = []
    groups = sorted({(r["level"], r["tp"]) for r in records if r["level"] in LEVELS},
                    key=lambda k: (LEVELS.index(k[0]), k[1]))
    for level, tp in groups:
        rs = [r for r in records if (r["level"], r["tp"]) == (level, tp)]
        algs = [a for a in PORTABLE + (BASELINE,) if any(r["algorithm"] == a for r in rs)]
        by = {(r["algorithm"], r["bytes"]): r for r in rs}
        headers = ["algorithm"] + [f"{b / 1024:g} KB" for b in sizes]
        rows = [[a] + [_cell(by.get((a, b)), with_spread) for b in sizes] for a in algs]
        extra = _speedup_row(level, rs, sizes) if speedup else None
        if extra:
            rows.append(extra)
        out.append((level, tp, headers, rows))
    return out


def peer_tables(records, comp, sizes):
    """Per TP: sifar (jit, and kernel for reference), then every peer as
    'median (ratio)', then whether sifar is ahead of all of them."""
    out = []
    for tp in sorted({c["tp"] for c in comp}):
        by = {(r["algorithm"], r["level"], r["bytes"]): r for r in records if r["tp"] == tp}
        headers = ["algorithm", "level"] + [f"{b / 1024:g} KB" for b in sizes]
        rows = []
        for level in ("jit", "kernel"):
            if any(("sifar", level, b) in by for b in sizes):
                rows.append(["sifar", level] + [_cell(by.get(("sifar", level, b)), False)
                                                for b in sizes])
        cs = [c for c in comp if c["tp"] == tp]
        at_size = {(c["peer"], c["peer_level"], c["bytes"]): c for c in reversed(cs)}
        for peer, level in dict.fromkeys((c["peer"], c["peer_level"]) for c in cs):
            row = [peer, level]
            for b in sizes:
                c = at_size.get((peer, level, b))
                if c is None:
                    row.append("-")
                else:
                    ratio = f" ({c['ratio']:.2f}x)" if c["ratio"] is not None else ""
                    row.append(f"{common.fmt_latency({'us_median': c['peer_us']})}{ratio}")
            rows.append(row)
        verdict = ["sifar ahead of every peer", ""]
        for b in sizes:
            here = [c for c in cs if c["bytes"] == b]
            at = [c for c in here if c["ratio"] is not None]
            # A peer (or sifar) whose median is not resolved above its noise decides nothing.
            unresolved = sorted({c["peer"] for c in here if c["ratio"] is None})
            if not at:
                verdict.append("not resolved" if unresolved else "-")
                continue
            worst = min(at, key=lambda c: c["ratio"])
            if worst["ratio"] <= 1.0:
                verdict.append(f"**no**, {worst['ratio']:.2f}x vs {worst['peer']}")
            elif unresolved:
                verdict.append(f"yes vs the resolved peers ({worst['ratio']:.2f}x vs "
                               f"{worst['peer']}); not resolved vs {', '.join(unresolved)}")
            else:
                verdict.append(f"yes, {worst['ratio']:.2f}x vs {worst['peer']}")
        rows.append(verdict)
        out.append((tp, headers, rows))
    return out


def _share(v) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def trace_tables(trace_records, gpu: bool = True):
    """(mis-speculation table, tail table) of the per-call trace; not gpu (XLA:CPU): the calls
    and their retries only, no latency, and no tail table."""
    mis, tails = [], []
    for t in trace_records:
        head = [t["tp"], t["algorithm"], f"{t['bytes'] / 1024:g} KB", f"{t['skew_us']:g}"]
        if "error" in t:
            mis.append(head + ["error: " + t["error"]] + [""] * (6 if gpu else 2))
            continue
        retries = t.get("retries_per_call")
        row = head + [t["calls"], _share(t.get("retried_share")),
                      "-" if retries is None else retries]
        if gpu:
            row += [common.fmt_us(t[k]) for k in ("us_median_clean", "us_median_retried",
                                                   "us_mean")] + [_share(t.get("cost_share"))]
            tails.append(head + [t["calls"]] + [common.fmt_us(t[k]) for k in common.TAILS])
        mis.append(row)
    mis_h = ["TP", "algorithm", "size", "skew us" if gpu else "skew setting", "calls", "retried",
             "retries/call (counters)"]
    mis_h += ["median clean us", "median retried us", "mean us", "cost"] if gpu else []
    tail_h = ["TP", "algorithm", "size", "skew us", "calls",
              "p50 us", "p90 us", "p99 us", "p99.9 us"]
    return (mis_h, mis), (tail_h, tails)


def print_tables(records, comp, sizes, host):
    print()
    for level, tp, headers, rows in tables(records, sizes, with_spread=False):
        print(f"[{host}] level={level} TP={tp}: microseconds per all-reduce (median)")
        print(report.plain_table(headers, rows) + "\n")
    for tp, headers, rows in peer_tables(records, comp, sizes):
        print(f"[{host}] TP={tp}: sifar (jit) against every peer, median us (peer / sifar)")
        plain = [[str(c).replace("**", "") for c in r] for r in rows]
        print(report.plain_table(headers, plain) + "\n")


def protocol_rows(meta) -> tuple[list[str], list[list]]:
    """Per TP and algorithm: its all-reduces (sifar_jax.stats() over the run), retries, timeouts,
    and its results against lax.psum's (one call per level and size)."""
    headers = ["TP", "algorithm", "calls", "retries", "timeouts", "against lax.psum"]
    rows = []
    for tp, stats in meta["stats"].items():
        for alg, c in stats.items():
            mine = [x for x in meta["checks"] if (x["tp"], x["algorithm"]) == (tp, alg)]
            if not mine and not c.get("calls"):
                continue
            same = sum(x["identical"] for x in mine)
            wrong = sum(not x["within_rounding"] for x in mine)
            verdict = (f"WRONG in {wrong} of {len(mine)} checks" if wrong else
                       f"bit-identical in all {len(mine)} checks" if same == len(mine) else
                       f"within bf16 rounding ({same} of {len(mine)} bit-identical)")
            rows.append([tp, alg, c.get("calls", 0), c.get("retries", 0), c.get("timeouts", 0),
                         verdict if mine else "-"])
    return headers, rows


