"""`bench.decode --virtual-ranks`: the persistent step of the run's model (TP=1, batch 1, the
first --context) at R virtual ranks on one device (sifar_jax.llama_step_virtual_ranks: R sets
of blocks of one launch, the all-reduces after o and down phases of the kernel) with "sifar"
and "oneshot" inside, on the same weights and cache. Per R and all-reduce: the step's time
(bench.decode.timers.back_to_back) and the cost of one all-reduce phase, (t_R - t_1) / phases,
phases = 2 x layers. Where the persistent step cannot run the model, one record says why (the
Decoder's ValueError). Written as ranks-<host>.{json,md}; a CPU run (the op's reference)
prints and writes no timing figure."""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp

import models
from bench import report
from bench.decode import model_api as api
from bench.decode.records import decoder_fields, floor_fields, make_decoder, model_params
from bench.decode.settings import Settings
from bench.decode.timers import back_to_back

ALLREDUCES = ("sifar", "oneshot")


def _stepper(dec, ranks: int, allreduce: str, state: dict):
    """run(k): k back-to-back persistent steps of one token at `ranks` virtual ranks, the
    cache donated from one to the next (state["cache"]), then a wait for the logits."""
    forward = jax.jit(api.step_forward(dec.family, dec.layout, dec.options, ranks, allreduce),
                      donate_argnums=1)
    tokens = jnp.full((1, 1), 1, jnp.int32)
    positions = jnp.full((1,), state["position"], jnp.int32)

    def run(k: int) -> None:
        logits = None
        for _ in range(k):
            logits, state["cache"], _ = forward(dec.params, state["cache"], tokens, positions,
                                                state["ar"])
        jax.block_until_ready(logits)

    return run


def run(s: Settings, devices, copy_bytes_per_s: float) -> list[dict]:
    """One record per (R, all-reduce); R = 1 once (no all-reduce phase), timed first."""
    mesh = models.make_mesh(1, devices=devices)
    context = s.context[0]
    options = s.options.replace(step="persistent", kv_layout="bhsd")  # the cache it reads
    layers = s.config.num_layers
    base = {"kind": "virtual_ranks", "preset": s.preset, "weights": s.weights, "tp": 1,
            "batch": 1, "context": context, "layers": layers}
    try:
        dec = make_decoder(s.config, mesh, model_params(s, mesh, 1), options, 1, context, s.seed)
    except ValueError as e:  # the step cannot serve this model: step="persistent" says why
        return report.cpu_flagged([dict(base, step="xla", step_reason=str(e), skipped=str(e))],
                                  not s.gpu)
    fields = decoder_fields(dec, context)
    base.update({"step": dec.step_kind, "step_reason": dec.step_reason,
                 "weights_bytes_per_rank": fields["weights_bytes_per_rank"],
                 "kv_bytes_per_rank": fields["kv_bytes_per_rank"]})
    state = {"cache": dec.state["cache"], "ar": dec.state["ar"], "position": context - 2}
    out, t1 = [], None
    for ranks in sorted(set(s.virtual_ranks) | {1}):
        for allreduce in ALLREDUCES if ranks > 1 else ("none",):
            step = _stepper(dec, ranks, "sifar" if ranks == 1 else allreduce, state)
            step(2)  # compiled and warm
            ms = [x * 1e3 for x in back_to_back(step, s.samples)]
            med = statistics.median(ms)
            t1 = med if ranks == 1 else t1
            phases = 2 * layers if ranks > 1 else 0
            out.append(dict(base, ranks=ranks, allreduce=allreduce, phases=phases,
                            step_ms_median=round(med, 4), step_ms=[round(x, 4) for x in ms],
                            per_phase_us=round((med - t1) / phases * 1e3, 3) if phases else None,
                            **floor_fields(base["weights_bytes_per_rank"],
                                           base["kv_bytes_per_rank"], copy_bytes_per_s, med)))
    del dec, state
    return report.cpu_flagged(out, not s.gpu)


def table(records, gpu: bool) -> tuple[list[str], list[list]]:
    """Per R and all-reduce; the timings on GPUs only."""
    headers = ["R", "all-reduce", "phases", "step"]
    if gpu:
        headers += ["step ms", "per phase us", "floor ms", "x floor"]
    rows = []
    for r in (r for r in records if "skipped" not in r):
        row = [r["ranks"], r["allreduce"], r["phases"], r["step"]]
        if gpu:
            phase = r["per_phase_us"]
            row += [f"{r['step_ms_median']:.3f}", "-" if phase is None else f"{phase:.2f}",
                    f"{r['floor_ms']:.3f}", f"{r['floor_ratio']:.3f}x"]
        rows.append(row)
    return headers, rows


def write(records, out_dir, env: dict, gpu: bool) -> tuple:
    """ranks-<host>.json and .md in out_dir."""
    host = env["host"]
    json_path = report.write_json(report.results_path(out_dir, "ranks", host, ".json"), records)
    skipped = [r["skipped"] for r in records if "skipped" in r]
    notes = [__doc__.split("\n\n")[0].replace("\n", " ")]
    notes += [f"Not run: {skipped[0]}"] if skipped else []
    sections = report.section("The persistent step at R virtual ranks on one device",
                              table(records, gpu))
    md_path = report.write_markdown(report.results_path(out_dir, "ranks", host, ".md"),
                                    f"Virtual ranks on {host}", env, sections, notes)
    return json_path, md_path
