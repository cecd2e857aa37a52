"""bench.decode's tables from its records: every record (timings on GPUs only), what ran (the
protocol: sifar_jax.stats(), check(), tokens against lax.psum's), the baseline and the floor,
the paper's comparison, the sweep, the tails and the device-time breakdown."""

from __future__ import annotations

import models
from bench import breakdown
from bench.decode import model_api as api
from bench.decode.records import TAIL

LOOPS = models.LOOPS
# The SiFAR paper's end-to-end decode (8x H200, Llama-3.1-8B FP8, batch 1): tokens/s gain over
# NCCL with SiFAR, and with no all-reduce at all. None: not reported.
PAPER_SIFAR_GAIN = {2: 9.1, 4: 14.9, 8: 18.6}
PAPER_NO_ALLREDUCE_GAIN = {2: 18.0, 4: None, 8: 43.0}


def label_order(s) -> list[str]:
    """Rows and bars: psum, the sifar variants, identity, in the order asked."""
    labels = [v.label for v in s.variants]
    return (["psum"] + [x for x in labels if x.startswith("sifar")] + ["identity"]
            + [x for x in labels if x not in ("psum", "identity") and not x.startswith("sifar")])


def _key(r) -> tuple:
    return r["tp"], r["loop"], r["batch"], r["context"]


def _index(records) -> dict:
    return {(*_key(r), r["allreduce"]): r for r in records}


def _prefix_match(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _gain(t_ref: float, t_x: float) -> str:
    return f"{(t_ref / t_x - 1) * 100:+.1f}%"


def _gap(t_psum: float, t_identity: float, t_x: float) -> str:
    d = t_psum - t_identity
    return "n/a (psum <= identity)" if d <= 0 else f"{(t_psum - t_x) / d * 100:.0f}%"


def _order(order, label) -> int:
    return order.index(label) if label in order else len(order)


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}x"


def _named(r) -> str:
    """The record's variant, '(baseline)' after it where it is the baseline at its point."""
    return r["allreduce"] + (" (baseline)" if r.get("baseline") == r["allreduce"] else "")


def _same_tokens(r, ps) -> str:
    """How many of lax.psum's generated tokens (sequence 0) r repeats before the first change."""
    return "-" if not ps or r is ps else \
        f"{_prefix_match(r['generated'], ps['generated'])}/{len(ps['generated'])}"


def _sorted(records, order):
    return sorted(records, key=lambda r: (r["tp"], LOOPS.index(r["loop"]), r["batch"],
                                          r["context"], _order(order, r["allreduce"])))


def _timing_cells(r, ps, ident) -> list[str]:
    gap = "-"
    if r["kind"] in api.SIFAR_KINDS and ps and ident:
        gap = _gap(ps["tpot_ms_median"], ident["tpot_ms_median"], r["tpot_ms_median"])
    return [f"{r['tpot_ms_median']:.3f}", f"{r['tpot_ms_p99']:.3f}", f"{r['tokens_per_s']:.1f}",
            f"{ps['tpot_ms_median'] / r['tpot_ms_median']:.3f}x" if ps else "-",
            _ratio(r.get("vs_baseline")), _ratio(r.get("floor_ratio")),
            f"{r['overhead_ms']:.3f}" if r.get("overhead_ms") is not None else "-", gap]


def table_rows(records, order, gpu: bool = True) -> tuple[list[str], list[list]]:
    """Every record (annotated by with_baseline); on a CPU without a timing figure (TPOT,
    tokens/s, the ratios to lax.psum, the baseline and the floor: they mean nothing there)."""
    idx = _index(records)
    headers = ["TP", "loop", "batch", "context", "all-reduce", "step", "retries/call",
               "same tokens as psum"]
    if gpu:
        headers[5:5] = ["TPOT median ms", "TPOT p99 ms", "tokens/s", "vs psum", "vs baseline",
                        "x floor", "overhead ms", "gap recovered"]
    rows = []
    for r in _sorted(records, order):
        ps, ident = idx.get((*_key(r), "psum")), idx.get((*_key(r), "identity"))
        rpc = r.get("retries_per_call")
        row = [r["tp"], r["loop"], r["batch"], r["context"], _named(r), r.get("step", "xla"),
               "-" if rpc is None else f"{rpc:.4f}", _same_tokens(r, ps)]
        rows.append(row[:5] + _timing_cells(r, ps, ident) + row[5:] if gpu else row)
    return headers, rows


def protocol_rows(records, order) -> tuple[list[str], list[list]]:
    """Per variant but lax.psum (the reference) and point: which all-reduce ran, sifar_jax.stats()
    over its loops, check(), and whether its tokens are lax.psum's at that point, per loop."""
    idx = _index(records)
    headers = ["TP", "batch", "KV length", "all-reduce", "algorithm used", "calls", "retries",
               "timeouts", "check", "same tokens as psum (per loop)"]
    rows, seen = [], set()
    for r in _sorted(records, order):
        point = (r["tp"], r["batch"], r["context"], r["allreduce"])
        if point in seen or r["allreduce"] == "psum":
            continue
        seen.add(point)
        mine = [x for x in records if (x["tp"], x["batch"], x["context"], x["allreduce"]) == point]
        same = ", ".join(f"{x['loop']} {_same_tokens(x, idx.get((*_key(x), 'psum')))}"
                         for x in mine)
        stats = r.get("sifar_stats") or {}
        total = {f: sum(v.get(f, 0) for v in stats.values()) for f in ("calls", "retries",
                                                                       "timeouts")}
        sifar = r["kind"] in api.SIFAR_KINDS or "sifar_stats" in r  # the persistent step's too
        rows.append([r["tp"], r["batch"], r["context"], r["allreduce"],
                     r.get("algorithm_used") or "none (no all-reduce)",
                     *(total[f] if sifar else "-" for f in ("calls", "retries", "timeouts")),
                     r.get("sifar_check", "-"), same])
    return headers, rows


# ----------------------------------------------------- baseline and floor --
def baselines(records, s) -> dict:
    """{(tp, loop, batch, context): the fastest record of the baseline rows (s.baselines)}."""
    best: dict = {}
    for r in records:
        if r["allreduce"] in s.baselines:
            k = _key(r)
            if k not in best or r["tpot_ms_median"] < best[k]["tpot_ms_median"]:
                best[k] = r
    return best


def with_baseline(records, s) -> list[dict]:
    """Copies of the records with "baseline" (the fastest baseline row's label at their point, or
    None) and "vs_baseline" (tokens/s over the baseline's, > 1: faster)."""
    best = baselines(records, s)
    out = []
    for r in records:
        b = best.get(_key(r))
        out.append(dict(r, baseline=b["allreduce"] if b else None,
                        vs_baseline=round(b["tpot_ms_median"] / r["tpot_ms_median"], 4)
                        if b else None))
    return out


def floor_rows(records, s) -> tuple[list[str], list[list]]:
    """Batch 1, the loops' context: TPOT against the memory floor, lax.psum and the baseline."""
    ctx = s.context[0]
    headers = ["TP", "loop", "all-reduce", "TPOT ms", "floor ms", "x floor", "overhead ms",
               "vs psum", "vs baseline"]
    idx = _index(records)
    order = label_order(s)
    rows = []
    for r in sorted((r for r in records if r["batch"] == 1 and r["context"] == ctx),
                    key=lambda r: (r["tp"], LOOPS.index(r["loop"]), _order(order, r["allreduce"]))):
        ps = idx.get((*_key(r), "psum"))
        floor = r.get("floor_ms")
        rows.append([r["tp"], r["loop"], _named(r), f"{r['tpot_ms_median']:.3f}",
                     "-" if not floor else f"{floor:.3f}" if floor >= 0.1 else f"{floor:.3g}",
                     _ratio(r.get("floor_ratio")),
                     "-" if r.get("overhead_ms") is None else f"{r['overhead_ms']:.3f}",
                     f"{ps['tpot_ms_median'] / r['tpot_ms_median']:.3f}x" if ps else "-",
                     _ratio(r.get("vs_baseline"))])
    return headers, rows


def breakdown_rows(records) -> tuple[list[str], list[list]]:
    """Per TP and variant with a device-trace breakdown: microseconds per step by kind."""
    if not any(r.get("breakdown") for r in records):
        return [], []
    headers = (["TP", "all-reduce"] + [k.replace("_", "-") + " us" for k in breakdown.BREAKDOWN]
               + ["idle us", "overlap us", "span us", "kernels", "by name only"])
    rows, seen = [], set()
    for r in records:
        b = r.get("breakdown")
        if not b or (r["tp"], r["allreduce"]) in seen:
            continue
        seen.add((r["tp"], r["allreduce"]))
        if "error" in b or "note" in b:
            rows.append([r["tp"], r["allreduce"], b.get("error") or b.get("note")]
                        + [""] * (len(headers) - 3))
            continue
        rows.append([r["tp"], r["allreduce"]]
                    + [f"{b[f'{k}_us']:.1f}" for k in breakdown.BREAKDOWN]
                    + [f"{b['idle_us']:.1f}", f"{b.get('overlap_us', 0.0):.1f}",
                       f"{b['span_us']:.1f}", f"{b['kernels']:g}",
                       f"{b['unmatched']:g}"])
    return headers, rows


def paper_rows(records, s) -> tuple[list[str], list[list]]:
    """Batch 1, the loops' context: our tokens/s gains over lax.psum beside the paper's."""
    idx = _index(records)
    headers = ["TP", "loop", "psum tokens/s", "baseline tokens/s", "sifar tokens/s", "sifar gain",
               "paper: SiFAR gain", "fused sifar gain", "sifar / fused over the baseline",
               "identity gain (no all-reduce)", "paper: no all-reduce gain",
               "gap recovered (sifar / fused)"]
    best = baselines(records, s)
    rows = []
    ctx = s.context[0]
    for tp in sorted({r["tp"] for r in records if r["tp"] > 1}):
        for loop in LOOPS:
            get = lambda label: idx.get((tp, loop, 1, ctx, label))  # noqa: E731
            ps, sf, fu, ident = get("psum"), get("sifar"), get("sifar+fused"), get("identity")
            if not ps:
                continue
            t = lambda r: r["tpot_ms_median"] if r else None  # noqa: E731
            gap = "-"
            if ident:
                gap = " / ".join(_gap(t(ps), t(ident), t(x)) if x else "-" for x in (sf, fu))
            paper_na = PAPER_NO_ALLREDUCE_GAIN.get(tp)
            bl = best.get((tp, loop, 1, ctx))
            over_bl = " / ".join(_gain(t(bl), t(x)) if x else "-" for x in (sf, fu)) if bl else "-"
            rows.append([tp, loop, f"{ps['tokens_per_s']:.1f}",
                         f"{bl['tokens_per_s']:.1f} ({bl['allreduce']})" if bl else "-",
                         f"{sf['tokens_per_s']:.1f}" if sf else "-",
                         _gain(t(ps), t(sf)) if sf else "-",
                         f"+{PAPER_SIFAR_GAIN[tp]}%" if tp in PAPER_SIFAR_GAIN else "-",
                         _gain(t(ps), t(fu)) if fu else "-", over_bl,
                         _gain(t(ps), t(ident)) if ident else "-",
                         f"+{paper_na:g}%" if paper_na else "-", gap])
    return headers, rows


def sweep_grid(records, s, tp: int, loop: str) -> tuple[list[str], list[list]] | None:
    """sifar's tokens/s gain over psum per batch (rows) and KV length (columns)."""
    idx = _index(records)
    rows = []
    for b in s.batch:
        row = [b]
        for c in s.context:
            ps = idx.get((tp, loop, b, c, "psum"))
            cells = []
            for label in ("sifar", "sifar+fused", "identity"):
                r = idx.get((tp, loop, b, c, label))
                cells.append(_gain(ps["tpot_ms_median"], r["tpot_ms_median"]) if ps and r else None)
            if ps is None or not any(cells):
                row.append("-")
                continue
            text = cells[0] or "-"
            if cells[1]:
                text += f" (fused {cells[1]})"
            if cells[2]:
                text += f" [identity {cells[2]}]"
            row.append(f"{text}; psum {ps['tpot_ms_median']:.2f} ms")
        rows.append(row)
    if all(cell == "-" for row in rows for cell in row[1:]):
        return None
    return ["batch \\ KV length"] + [str(c) for c in s.context], rows


def tail_rows(records) -> tuple[list[str], list[list]]:
    headers = ["TP", "loop", "all-reduce", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "steps"]
    rows = [[r["tp"], r["loop"], r["allreduce"], *(f"{r[f'tpot_ms_p{q:g}'.replace('.', '_')]:.3f}"
                                                  for q in TAIL), r["tpot_samples"]]
            for r in sorted(records, key=lambda r: (r["tp"], LOOPS.index(r["loop"]), r["allreduce"]))
            if r["loop"] in ("sync", "stream") and r["batch"] == 1]
    return headers, rows


def allreduce_tail_rows(records) -> tuple[list[str], list[list]]:
    """Per sifar variant and point: the per-call all-reduce latency inside the decode step."""
    headers = ["TP", "all-reduce", "batch", "KV length", "calls", "p50 us", "p90 us", "p99 us",
               "p99.9 us", "mis-speculated"]
    rows, seen = [], set()
    for r in records:
        t = r.get("allreduce_trace")
        key = (r["tp"], r["allreduce"], r["batch"], r["context"])
        if not t or key in seen:
            continue
        seen.add(key)
        if "error" in t:
            rows.append([*key, "-", t["error"], "", "", "", ""])
            continue
        tails = [t.get(f"us_p{q}") for q in ("50", "90", "99", "99_9")]
        rows.append([*key, t["calls"], *("-" if v is None else f"{v:.2f}" for v in tails),
                     f"{100 * (t.get('retried_share') or 0):.0f}%"])
    return headers, rows


