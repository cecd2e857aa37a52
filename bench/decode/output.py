"""bench.decode's report: decode-<host>.{json,md} (rewritten after every variant) and the
summary it prints. A CPU run writes and prints no timing figure: what ran, and its tokens
against lax.psum's (its JSON keeps the raw numbers, flagged report.CPU_FLAG)."""

from __future__ import annotations

from pathlib import Path

from bench import common, report
from bench.decode.records import BREAKDOWN_STEPS, TRACE_STEPS
from bench.decode.settings import PIPELINE_STEPS, Settings
from bench.decode.tables import (allreduce_tail_rows, breakdown_rows, floor_rows, label_order,
                                 paper_rows, protocol_rows, sweep_grid, table_rows, tail_rows,
                                 with_baseline)

CPU_NOTE = ("No GPUs here: XLA:CPU host devices (threads as ranks, one shared memory) run a tiny "
            "model. This shows the protocol running and its tokens against lax.psum's; no timing "
            "is shown, as none would mean anything for GPUs. Speed figures: docs/performance.md.")
BREAKDOWN_SKIPPED = "--breakdown: skipped, a CPU run has no device trace of GPU kernels"
METHOD_NOTE = (
    "TPOT per loop (tokens/s = batch / TPOT): sync, one step then its token read; stream, the gap "
    "between tokens of Decoder.decode(loop='stream'); pipelined, steps back to back, "
    f"(t({PIPELINE_STEPS[1]} steps) - t({PIPELINE_STEPS[0]})) / {PIPELINE_STEPS[1] - PIPELINE_STEPS[0]}"
    "; on_device, the gap between chunks of one lax.fori_loop dispatch / its length. Gap "
    "recovered: (t_psum - t_x) / (t_psum - t_identity). Same tokens as psum: generated tokens "
    "(sequence 0) equal to lax.psum's before the first difference (identity differs at once). "
    "Method: docs/reference.md, bench.decode.")


def describe_run(s: Settings) -> str:
    c = s.config
    moe = (f", {c.num_experts} experts top-{c.num_experts_per_tok} ({c.moe_impl})"
           if hasattr(c, "moe_impl") else "")
    fp8 = (", FP8 weights (e4m3, per-channel scales)" if s.quantize else
           ", the projections held as [N, K] rows" if s.to_rows else "")
    return (f"{s.preset} ({c.num_layers} layers, hidden {c.hidden_size}{moe}, {s.dtype}"
            f"{fp8}), random weights and KV cache; loops {','.join(s.loops)} at batch 1, KV length "
            f"{s.context[0]}; sweep ({','.join(s.sweep_loops) or 'none'}) batch "
            f"{list(s.batch)} x KV length {list(s.context)}; {s.tokens} timed steps (sync, stream, "
            f"on_device), {s.samples} pipelined samples, on_device {s.chunk} tokens per "
            f"dispatch, stream {s.in_flight} steps in flight"
            + ("; TP=2's per-rank shapes on one device (--shapes tp2_rank)"
               if s.shapes == "tp2_rank" else ""))


def out_dir(s: Settings) -> Path:
    """GPU results go where they are committed; a CPU demo into a git-ignored directory."""
    return Path(s.out) if s.out else report.default_out(s.platform)


def floor_note(baselines, copy_tb_s: float | None) -> str:
    rate = f"{copy_tb_s:.3g} TB/s" if copy_tb_s else "the copy rate"
    floor = (f"Floor: a step's weights and KV cache (per rank) read once at this device's copy "
             f"rate, measured in this run: {rate} (a device-to-device copy of "
             f"{common.COPY_BYTES['gpu'] >> 30} GiB, read + write counted; floor_ms; x floor = "
             "TPOT / floor_ms; overhead = TPOT - floor_ms). ")
    if not baselines:
        return floor + "Baseline: none (no in-decoder one-shot or two-shot row ran)."
    return floor + (f"Baseline: the fastest of the in-decoder rows {' or '.join(baselines)} "
                    "at the same TP, loop, batch and KV length (the paper's baseline, given every "
                    "decoder improvement ours gets); vs baseline: tokens/s over the baseline's.")


def gpu_sections(records, s: Settings) -> list[tuple[str, str]]:
    ctx = s.context[0]
    out = report.section(f"Against the paper: batch 1, KV length {ctx} (paper: 8x H200, "
                         "Llama-3.1-8B FP8, SiFAR vs NCCL)", paper_rows(records, s))
    out += report.section(f"Memory floor, lax.psum and the baseline: batch 1, KV length {ctx}",
                          floor_rows(records, s))
    for tp in sorted({r["tp"] for r in records if r["tp"] > 1}):
        for loop in s.sweep_loops:
            grid = sweep_grid(records, s, tp, loop)
            out += report.section(f"Sweep, TP={tp}, {loop}: tokens/s gain over lax.psum",
                                  grid or ([], []))
    out += report.section("Tail of the per-step time (batch 1)", tail_rows(records))
    out += report.section("sifar all-reduces inside the decode step: per-call latency from "
                          f"device timestamps ({TRACE_STEPS} back-to-back steps, every rank, "
                          "block 0's view)", allreduce_tail_rows(records))
    out += report.section(f"Where a step's device time goes: {BREAKDOWN_STEPS} back-to-back steps "
                          "traced (batch 1, the loops' KV length; microseconds per step)",
                          breakdown_rows(records))
    return out


def _notes(records, s: Settings, final: bool) -> list[str]:
    notes = ([] if s.gpu else [CPU_NOTE]) + [describe_run(s) + ".", METHOD_NOTE]
    if s.gpu:
        notes.append(floor_note(s.baselines, records[0].get("copy_tb_s") if records else None))
    if s.breakdown_asked and not s.breakdown:
        notes.append(BREAKDOWN_SKIPPED)
    if not final:
        notes.append("**Partial: the run had not finished when this was written.**")
    notes += [f"**sifar_jax.check() failed after TP={r['tp']} {r['allreduce']}: {r['sifar_check']}**"
              for r in records if r.get("sifar_check", "ok") != "ok" and r["loop"] == s.loops[0]]
    copied = [f"TP={r['tp']} {r['allreduce']} {r['loop']} batch {r['batch']} KV {r['context']}: "
              f"{r['cache_copies']}" for r in records if r.get("cache_copies")]
    notes.append("**The optimised HLO copies the KV cache** (per call: entry, per iteration: loop): "
                 + "; ".join(copied) if copied else
                 "The optimised HLO of every timed executable updates the KV cache in place "
                 "(models.decoder.hlo.cache_copies).")
    return notes


def write_outputs(s: Settings, env: dict, records, final: bool) -> tuple[Path, Path]:
    """decode-<host>.json (every record) and .md (the tables; a CPU run's without timings)."""
    d, host, order = out_dir(s), env["host"], label_order(s)
    records = with_baseline(records, s)
    json_path = report.write_json(report.results_path(d, s.stem, host, ".json"), records)
    sections = gpu_sections(records, s) if s.gpu else []
    sections += report.section("What ran: sifar_jax.stats() per variant (all its loops; calls "
                               "once per rank, retries per warp on GPUs) and its tokens against "
                               "lax.psum's", protocol_rows(records, order))
    sections += report.section("Every record" if s.gpu else "Every record (XLA:CPU: no timings)",
                               table_rows(records, order, s.gpu))
    md_path = report.write_markdown(report.results_path(d, s.stem, host, ".md"),
                                    f"Decode TPOT on {host}" if s.gpu else f"Decode on {host}",
                                    env, sections, _notes(records, s, final))
    return json_path, md_path


def print_summary(records, s: Settings) -> None:
    """GPUs: the paper's comparison, the floor and the breakdown; a CPU: what ran."""
    records = with_baseline(records, s)
    if not s.gpu:
        print("What ran (XLA:CPU: the protocol and its tokens; speed figures are GPU results, "
              "docs/performance.md):")
        print(report.plain_table(*protocol_rows(records, label_order(s))))
        return
    headers, rows = paper_rows(records, s)
    if rows:
        print(report.plain_table(headers, rows) + "\n")
    headers, rows = floor_rows(records, s)
    if rows:
        rate = records[0].get("copy_tb_s")
        print(f"Batch 1 against the memory floor (weights and KV cache per rank read once at the "
              f"copy rate measured here, {rate:.3g} TB/s), lax.psum and the baseline "
              f"(the fastest of {', '.join(s.baselines) or 'none'}):")
        print(report.plain_table(headers, rows) + "\n")
    headers, rows = breakdown_rows(records)
    if rows:
        print(f"Where a step's device time goes ({BREAKDOWN_STEPS} steps traced, us per step):")
        print(report.plain_table(headers, rows) + "\n")
