"""bench.decode's run: per TP size one set of random weights, per case a Decoder, its loops timed
(bench.decode.timers), one record per loop. A record says what the Decoder reports (the step
it runs and why, the layout of the params it holds, the bytes a step reads of them) and the
step's memory floor: those bytes and the KV cache at the device's copy rate measured in this
process (bench.common.copy_rate)."""

from __future__ import annotations

import gc
import statistics
import time

import jax
import numpy as np

import models
from bench import breakdown, calltrace, common, report
from bench.decode import model_api as api
from bench.decode.settings import Settings, cases
from bench.decode.timers import TIMERS

TAIL = (50, 90, 99, 99.9)  # percentiles of per-step times (sync, stream)
BREAKDOWN_STEPS = 8  # profiled back-to-back steps per variant with --breakdown
TRACE_STEPS = 48  # traced pipelined steps: 48 x 64 all-reduces (8B) stay within one trace ring


# ------------------------------------------------------------- bytes, floor --
def floor_ms(weights_bytes: int, kv_bytes: int, copy_bytes_per_s: float) -> float:
    """A step's memory floor: its weights and KV cache read once at the copy rate."""
    return (weights_bytes + kv_bytes) / copy_bytes_per_s * 1e3


def floor_fields(weights_bytes: int, kv_bytes: int, copy_bytes_per_s: float,
                 tpot_ms: float) -> dict:
    floor = floor_ms(weights_bytes, kv_bytes, copy_bytes_per_s)
    def sig(x: float, digits: int = 4) -> float:
        return float(f"{x:.{digits}g}")

    return {"copy_tb_s": sig(copy_bytes_per_s / 1e12, 6), "floor_ms": sig(floor),
            "floor_ratio": sig(tpot_ms / floor), "overhead_ms": round(tpot_ms - floor, 4)}


def kv_cache_bytes_per_rank(config, context: int, tp: int, batch: int = 1) -> int:
    """K and V of every layer over `context` positions: what attention reads per step."""
    itemsize = np.dtype(jax.numpy.dtype(config.dtype)).itemsize
    heads = models.family_of(config).layout(config, tp).shapes.num_kv_heads // tp
    return 2 * config.num_layers * batch * context * heads * config.head_dim * itemsize


def weight_layout(params) -> str:
    """How params store their projections: "rows" (output-major: Fp8Weight or RowWeight
    leaves) or "einsum"."""
    leaves = jax.tree.leaves(params, is_leaf=api.is_projection)
    return "rows" if any(api.is_projection(x) for x in leaves) else "einsum"


# ------------------------------------------------------------------- set-up --
class NotServed(ValueError):
    """A persistent row's Decoder refused: the step cannot serve this model (the reason)."""


def uses_sifar(options: models.DecodeOptions, tp: int) -> bool:
    """Whether a variant runs sifar_jax's all-reduces: a sifar kind, or the persistent step at
    TP >= 2 (its all-reduce phase, counted in sifar_jax.stats())."""
    return options.allreduce in api.SIFAR_KINDS or (options.step == "persistent" and tp > 1)


def make_decoder(config, mesh, params, options: models.DecodeOptions, batch: int, context: int,
                 seed: int) -> models.Decoder:
    """A Decoder running `options` with a random cache of `context` positions; sifar's slot
    widened to a step's payload (batch x hidden) where the default is smaller."""
    slot = None
    if options.allreduce in api.SIFAR_KINDS:
        import sifar_jax

        payload = batch * config.hidden_size * np.dtype(jax.numpy.dtype(config.dtype)).itemsize
        slot = payload if payload > sifar_jax.DEFAULT_SLOT_BYTES else None
    dec = models.Decoder(config, mesh, params, options.replace(
        slot_bytes=slot, batch_size=batch, max_seq_len=context))
    dec.reset(context)
    dec.randomize_cache(seed)
    return dec


def start_tokens(config, batch: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, config.vocab_size, batch, dtype=np.int32)


def decoder_fields(dec: models.Decoder, context: int) -> dict:
    """What the Decoder reports it runs: its options, the step it chose and why, the params it
    holds (their layout, the bytes a step reads of them: FP8 e4m3 + scales, an MoE's top-k
    experts) and the KV cache a step reads."""
    o = dec.options
    prefetch = None
    if o.fused:  # what the fused call prefetches into L2 (None: the library's default)
        import sifar_jax.fused

        prefetch = (sifar_jax.fused.DEFAULT_PREFETCH_BYTES if o.prefetch_bytes is None
                    else o.prefetch_bytes)
    return {"kind": o.allreduce, "algorithm": o.algorithm, "fused": bool(o.fused),
            "prefetch_bytes": prefetch, "kv_layout": dec.kv_layout, "step": dec.step_kind,
            "step_reason": dec.step_reason, "weight_layout": weight_layout(dec.params),
            "step_allreduce": o.step_allreduce if dec.step_kind == "persistent" and dec.tp > 1
            else None,
            "rows": dec.rows, "gemm_rows": dec.gemm_rows, "attn_impl": dec.attn_impl,
            "pack_params": dec.pack_params, "arrays_per_call": len(dec.weights.leaves),
            "weights_bytes_per_rank": dec.family.step_weight_bytes(dec.layout, dec.params),
            "kv_bytes_per_rank": kv_cache_bytes_per_rank(dec.config, context, dec.tp, dec.rows)}


# ------------------------------------------------------------------ records --
def make_record(label: str, loop: str, tp: int, batch: int, context: int, s: Settings, seconds,
                tokens, fields: dict, copy_bytes_per_s: float) -> dict:
    ms = [t * 1e3 for t in seconds]
    med = statistics.median(ms)
    rec = {"allreduce": label, "tp": tp, "loop": loop, "batch": batch, "context": context,
           "tpot_ms_median": round(med, 4), "tpot_ms_p99": round(common.percentile(ms, 99), 4),
           "tokens_per_s": round(batch * 1e3 / med, 2), "tpot_samples": len(ms),
           "preset": s.preset, "dtype": s.dtype, "weights": s.weights, "shapes": s.shapes,
           "moe_impl": getattr(s.config, "moe_impl", None),
           "start_position": context - s.steps_needed(loop) - 1, "steps": s.steps_needed(loop),
           "generated": [int(t[0]) for t in tokens]}  # sequence 0
    if loop in ("sync", "stream"):
        rec.update({f"tpot_ms_p{q:g}".replace(".", "_"): round(common.percentile(ms, q), 4)
                    for q in TAIL})
    rec.update(fields)
    rec.update(floor_fields(rec["weights_bytes_per_rank"], rec["kv_bytes_per_rank"],
                            copy_bytes_per_s, med))
    return rec


def sifar_fields(before) -> dict:
    """sifar_jax.stats() since `before` and check() over one variant (all its loops)."""
    import sifar_jax

    delta = {}
    for alg, counts in sifar_jax.stats().items():
        d = {f: int(v) - int(before.get(alg, {}).get(f, 0)) for f, v in counts.items()}
        if any(d.values()):
            delta[alg] = d
    calls = sum(d.get("calls", 0) for d in delta.values())
    retries = sum(d.get("retries", 0) for d in delta.values())
    out = {"sifar_stats": delta, "algorithm_used": ",".join(sorted(delta)) or None,
           "retries": retries, "retries_per_call": round(retries / calls, 5) if calls else None}
    try:
        sifar_jax.check()
        out["sifar_check"] = "ok"
    except Exception as e:  # noqa: BLE001 - recorded and reported, the run goes on
        out["sifar_check"] = f"{type(e).__name__}: {e}"
    return out


def run_variant(config, mesh, params, case, s: Settings, bar, copy_bytes_per_s) -> list[dict]:
    """Set up one variant at one (batch, context), time each of its loops, one record each."""
    tp, batch, context, variant, loops = case
    sifar = uses_sifar(variant.options, tp)
    where = f"TP={tp} b={batch} ctx={context} {variant.label}"
    before = None
    if sifar:
        import sifar_jax

        before = sifar_jax.stats()
    t0 = time.perf_counter()
    bar.set_postfix_str(f"{where}: set-up")
    try:
        dec = make_decoder(config, mesh, params, variant.options, batch, context, s.seed)
    except ValueError as e:
        if variant.options.step == "persistent":
            raise NotServed(str(e)) from None
        raise
    first = start_tokens(config, batch, s.seed)
    fields = dict(decoder_fields(dec, context), setup_s=round(time.perf_counter() - t0, 2))
    timed = []
    for loop in loops:
        bar.set_postfix_str(f"{where}: {loop}")
        dec.seek(context - s.steps_needed(loop) - 1, first)
        copies = cache_copies(dec, loop, s)
        t1 = time.perf_counter()
        seconds, tokens = TIMERS[loop](dec, s)
        timed.append((loop, seconds, tokens, time.perf_counter() - t1, copies))
    if sifar and s.trace and variant.options.step != "persistent":  # sifar_psum's calls
        fields["allreduce_trace"] = trace_allreduces(dec, context, first)
    if s.breakdown and (batch, context) == (1, s.context[0]):
        bar.set_postfix_str(f"{where}: breakdown")
        fields["breakdown"] = step_breakdown(dec, context, first)
    if sifar:
        fields.update(sifar_fields(before))
    del dec
    return [make_record(variant.label, loop, tp, batch, context, s, seconds, tokens,
                        dict(fields, loop_s=round(loop_s, 2), cache_copies=copies),
                        copy_bytes_per_s)
            for loop, seconds, tokens, loop_s, copies in timed]


def step_breakdown(dec, context: int, first) -> dict:
    """BREAKDOWN_STEPS back-to-back steps traced on the device, their time split by kernel kind
    (bench.breakdown), or {"error": why}."""
    try:
        dec.seek(context - BREAKDOWN_STEPS - 8, first)
        dec.advance(3)  # compiled and warm before the trace starts
        dec.token()
        return breakdown.step_breakdown(dec, BREAKDOWN_STEPS)
    except Exception as e:  # noqa: BLE001 - recorded; the benchmark goes on
        return {"error": f"{type(e).__name__}: {e}"}


def trace_allreduces(dec, context: int, first) -> dict:
    """Per-call latency of the all-reduces in TRACE_STEPS back-to-back steps from the device's
    timestamps (bench.calltrace.summarize), or {"error": why}."""
    import sifar_jax

    try:
        dec.seek(context - TRACE_STEPS - 2, first)
        dec.advance()  # compiled and warm before the trace starts
        dec.token()
        with sifar_jax.call_trace(dec.axis_name) as t:
            dec.advance(TRACE_STEPS)
            dec.token()
        return {"steps": TRACE_STEPS, **calltrace.summarize(t.records())}
    except Exception as e:  # noqa: BLE001 - recorded; the benchmark goes on
        return {"error": f"{type(e).__name__}: {e}"}


def cache_copies(dec, loop: str, s: Settings) -> dict:
    """{"entry": n, "loop": n}: KV-cache copies in the optimised HLO this loop runs from here."""
    exe = dec.compiled_chunk(s.chunk) if loop == "on_device" else dec.compiled_step()
    text, counts = exe.as_text(), {}
    for shape in api.hlo.cache_shapes(dec.state["cache"]):  # the array, a layer, a layer's keys
        for place, lines in api.hlo.cache_copies(text, shape).items():
            counts[place] = counts.get(place, 0) + len(lines)
    return counts


# ---------------------------------------------------------------------- run --
def model_params(s: Settings, mesh, tp: int):
    """The run's random weights on `mesh`: FP8 (--quantize fp8), as rows (--to-rows) or dense."""
    try:
        params = common.block(models.random_params(s.config, mesh, seed=s.seed,
                                                   quantize=s.quantize))
        return models.to_rows(params, s.config, donate=True) if s.to_rows else params
    except ValueError as e:  # a model this TP size cannot split or quantize: say so, no trace
        raise SystemExit(f"bench.decode: TP={tp}: {e}") from None


def said(recs: list[dict], s: Settings) -> str:
    """One line per variant for the log: its loops' TPOT on a GPU, none on a CPU."""
    r = recs[0]
    head = f"TP={r['tp']} batch {r['batch']} context {r['context']} {r['allreduce']:>12}: "
    if not s.gpu:
        return head + ", ".join(x["loop"] for x in recs) + f" ran ({r['step']} step)"
    return head + ", ".join(f"{x['loop']} {x['tpot_ms_median']:.3f} ms" for x in recs) \
        + f" (set-up {r['setup_s']:.1f} s)"


def run(s: Settings, devices, copy_bytes_per_s: float, on_record) -> list[dict]:
    """Every case (settings.cases), TP size by TP size; on_record(records) after each."""
    todo = cases(s)
    records: list[dict] = []
    bar = common.progress(len(todo), "decode", timings=s.gpu)
    for tp in s.tp:
        mine = [c for c in todo if c[0] == tp]
        if not mine:
            continue
        mesh = models.make_mesh(tp, devices=devices)
        bar.set_postfix_str(f"TP={tp}: random weights")
        params = model_params(s, mesh, tp)
        for case in mine:
            try:
                recs = report.cpu_flagged(run_variant(s.config, mesh, params, case, s, bar,
                                                      copy_bytes_per_s), not s.gpu)
            except NotServed as e:
                bar.write(f"TP={tp} batch {case[1]} context {case[2]} {case[3].label}: not run: "
                          f"{e}")
                bar.update(1)
                continue
            records += recs
            for r in (r for r in recs if r["cache_copies"]):
                bar.write(f"KV CACHE COPIED: TP={tp} {r['allreduce']} {r['loop']}: "
                          f"{r['cache_copies']} (copies per call / per loop iteration)")
            if recs[0].get("sifar_check", "ok") != "ok":
                bar.write(f"SIFAR CHECK FAILED: TP={tp} {case[3].label}: {recs[0]['sifar_check']}")
            bar.write(said(recs, s))
            bar.update(1)
            on_record(records)
        del params  # free this TP size's weights before the next one allocates its own
        if any(uses_sifar(c[3].options, tp) for c in mine):
            import sifar_jax

            sifar_jax.shutdown()
        jax.clear_caches()
        gc.collect()
    bar.close()
    return records
