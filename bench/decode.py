"""End-to-end decode: time per output token (TPOT) of the Flax Llama decoder with
lax.psum, with sifar_psum, and with the all-reduce replaced by identity.

    python -m bench.decode                    # GPU: Llama-3.1-8B shapes, bf16, TP=2 then TP=1
    python -m bench.decode --quick            # CPU smoke test (tiny model, a few tokens)
    python -m bench.decode --algorithms sifar_push,oneshot_db,oneshot   # more sifar rows

Per variant (TP size x all-reduce): a fresh Decoder over random weights (built once per TP
size and shared by its variants), a random prompt prefilled into the KV cache, a few warm-up
steps (the first one compiles), then `--tokens` greedy steps timed one by one
(`Decoder.greedy` + block_until_ready: the "sync" TPOT, which includes XLA's host-side launch
of the whole step, about 3 ms at 8B), then the TPOT proper: steps dispatched back to back with
the token fed straight back on the device, as a serving loop runs, timed as the difference
between runs of 20 and 4 steps (dispatch cancels, the device-bound step time remains), over
`--tokens // 16` samples: the median and p99 of those samples are the TPOT,
tokens/s = 1 / median.

The KV cache is `--context` positions long and attention always runs over all of it (with a
position mask), so the step cost does not depend on the position; the prompt fills what the
warm-up and the two timed passes leave: prompt = context - warmup - tokens - samples * 24.

Prefill (`--prefill steps`, the default) feeds the prompt one token per greedy step, using the
step the variant compiles anyway: no extra compile per variant (a full-prompt prefill is a
second 8B compile) and the all-reduce payload stays one token wide, so every sifar algorithm
serves it (a full prompt exceeds sifar's slot: "auto" falls back to lax.psum for it, a named
algorithm raises). `--prefill full` prefills in one call where the variant allows it.

Writes bench/results/decode-<host>.{json,md,png}, after every variant (a run cut short keeps
what it measured). TP=1 runs only lax.psum: the reference row (there is nothing to reduce).
"""

from __future__ import annotations

# Back-to-back runs whose difference gives one TPOT sample (steps).
PIPELINE_STEPS = (4, 20)

import argparse
import gc
import statistics
import sys
import time

from bench import common

common.use_host_devices(8)  # before jax is imported; only XLA:CPU reads it

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from models import llama  # noqa: E402
from models.config import LlamaConfig  # noqa: E402
from models.decode import Decoder, make_mesh  # noqa: E402
from models.weights import random_params  # noqa: E402

HBM_BYTES_PER_S = 4.3e12  # assumed H200 HBM3e bandwidth actually reached when streaming weights
PRESETS = {"llama3_8b": LlamaConfig.llama3_8b, "tiny": LlamaConfig.tiny}
CPU_NOTE = (
    "No GPUs here: these numbers come from XLA:CPU host devices (threads as ranks, shared host "
    "memory) and a tiny model. They show that the benchmark runs; they are not a performance result."
)


# ------------------------------------------------------------------ settings --
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m bench.decode",
        description="Time per output token of the Llama decoder with psum / sifar / identity.",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model shapes (default: llama3_8b on GPU, tiny on CPU)")
    p.add_argument("--dtype", default=None,
                   help="parameter/activation dtype (default: bfloat16 on GPU, the preset's on CPU)")
    p.add_argument("--allreduce", default="psum,sifar,identity",
                   help="comma list of psum, sifar (algorithm auto), identity, sifar:<algorithm>, "
                        "sifar_buffers[:<algorithm>] (explicit dual buffers in the decode state) "
                        "(default: psum,sifar,identity)")
    p.add_argument("--algorithms", default="",
                   help="comma list of sifar algorithms, each one more row 'sifar:<alg>' "
                        "(e.g. sifar,sifar_push,oneshot_db,oneshot; default: none)")
    p.add_argument("--tp", default=None,
                   help="comma list of TP sizes, run in that order (default: every power of two "
                        "up to the device count, largest first, then 1; on CPU: 2,1)")
    p.add_argument("--context", type=int, default=None,
                   help="KV cache length = prompt + warm-up + 2 x tokens (default 1024; 64 with --quick)")
    p.add_argument("--tokens", type=int, default=None,
                   help="timed steps per pass (default 128; 16 with --quick)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps after the prefill (default 3; 2 with --quick)")
    p.add_argument("--prefill", choices=("steps", "full"), default="steps",
                   help="prompt one token per step (default) or in one call (an extra compile)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model, few tokens (CPU, CI)")
    p.add_argument("--out", default=str(common.DEFAULT_OUT),
                   help="directory for the results (default: bench/results)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p.parse_args(argv)


SIFAR_KINDS = ("sifar", "sifar_buffers")  # Decoder kinds that run sifar_jax (and call init)


def parse_variants(args) -> list[tuple[str, str, str]]:
    """[(label, kind, algorithm)]: ("psum", "psum", "auto"), ("sifar:oneshot", "sifar", "oneshot")."""
    items = [a.strip() for a in args.allreduce.split(",") if a.strip()]
    items += [f"sifar:{a.strip()}" for a in args.algorithms.split(",") if a.strip()]
    out, seen = [], set()
    for item in items:
        kind, _, alg = item.partition(":")
        alg = alg or "auto"
        if kind not in llama.ALLREDUCE_KINDS:
            raise SystemExit(f"unknown all-reduce {kind!r}; choose from {llama.ALLREDUCE_KINDS}")
        if kind not in SIFAR_KINDS and alg != "auto":
            raise SystemExit(f"{item!r}: only {' and '.join(SIFAR_KINDS)} take an algorithm")
        if kind in SIFAR_KINDS:
            import sifar_jax

            try:
                sifar_jax.algorithms.validate(alg)
            except ValueError as e:
                raise SystemExit(str(e)) from None
        label = kind if alg == "auto" else f"{kind}:{alg}"
        if label not in seen:
            seen.add(label)
            out.append((label, kind, alg))
    return out


def settings(args, kind: str, n_devices: int) -> dict:
    gpu = kind == "gpu"
    preset = args.preset or ("llama3_8b" if gpu and not args.quick else "tiny")
    config = PRESETS[preset]()
    dtype = args.dtype or ("bfloat16" if gpu else config.dtype)
    config = config.replace(dtype=dtype)
    s = {
        "preset": preset,
        "dtype": dtype,
        "config": config,
        "context": args.context or (128 if args.quick else 1024),
        "tokens": args.tokens or (16 if args.quick else 128),
        "warmup": args.warmup if args.warmup is not None else (2 if args.quick else 3),
        "prefill": args.prefill,
        "seed": args.seed,
        "variants": parse_variants(args),
    }
    s["warmup"] = max(1, s["warmup"])  # the first step compiles: never time it
    s["samples"] = max(2, s["tokens"] // 16)
    s["prompt_len"] = s["context"] - s["warmup"] - s["tokens"] - s["samples"] * sum(PIPELINE_STEPS)
    if s["prompt_len"] < 1:
        raise SystemExit(f"--context {s['context']} leaves no room for a prompt: it must exceed "
                         f"warmup + tokens + {s['samples']} samples x {sum(PIPELINE_STEPS)} steps")
    if args.tp:
        tps = [int(v) for v in args.tp.split(",") if v.strip()]
    else:
        big = common.powers_of_two_up_to(n_devices) if gpu else [2]
        tps = sorted(big, reverse=True) + [1]
    for t in tps:
        if not 1 <= t <= n_devices:
            raise SystemExit(f"--tp {t}: have {n_devices} {kind} devices")
        try:
            llama.check_tp(config, t)
        except ValueError as e:
            raise SystemExit(f"--tp {t}: {e}") from None
    s["tp"] = list(dict.fromkeys(tps))
    return s


def cases(s) -> list[tuple[int, tuple[str, str, str]]]:
    """TP=1 gets only lax.psum (the reference row): with one device nothing is reduced."""
    out = []
    for tp in s["tp"]:
        if tp == 1:
            out.append((1, ("psum", "psum", "auto")))
        else:
            out += [(tp, v) for v in s["variants"]]
    return out


# ------------------------------------------------------------------- measuring --
def streamed_bytes_per_rank(config: LlamaConfig, params, tp: int) -> int:
    """Parameter bytes one rank reads per decode step: every leaf's local shard, except the
    embedding table (replicated), of which a step gathers one row (plus, when tied, its
    vocab/tp slice as the lm_head)."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = str(getattr(path[-1], "key", path[-1]))
        nbytes = int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
        if name == "embed":
            nbytes = nbytes // tp if config.tie_word_embeddings else 0
        total += nbytes
    return total


def kv_cache_bytes_per_rank(config: LlamaConfig, context: int, tp: int) -> int:
    """K and V of every layer over the whole cache: what attention reads per step."""
    itemsize = np.dtype(jax.numpy.dtype(config.dtype)).itemsize
    return 2 * config.num_layers * context * (config.num_kv_heads // tp) * config.head_dim * itemsize


def _sifar_counters() -> dict | None:
    try:
        import sifar_jax

        return sifar_jax.stats()
    except Exception:  # noqa: BLE001 - extension missing: no counters
        return None


def _counter_delta(before, after) -> dict:
    out = {}
    if not before or not after:
        return out
    for alg, fields in after.items():
        d = {f: int(v) - int(before.get(alg, {}).get(f, 0)) for f, v in fields.items()}
        if any(d.values()):
            out[alg] = d
    return out


def run_variant(config, mesh, params, variant, s, prompt_tokens, bar) -> dict:
    """Prefill, warm up, then the sync and the back-to-back timed passes of one variant."""
    label, kind, alg = variant
    tp = mesh.shape["tp"]
    before = _sifar_counters() if kind in SIFAR_KINDS else None
    t0 = time.perf_counter()
    dec = Decoder(config, mesh, params, allreduce=kind, algorithm=alg,
                  max_seq_len=s["context"])  # allreduce="sifar" calls sifar_jax.init(mesh)

    # prefill (untimed; the first call compiles)
    prefill = s["prefill"]
    if prefill == "full" and kind in SIFAR_KINDS and (alg != "auto" or kind != "sifar"):
        prefill = "steps"  # a named algorithm raises on a payload past its slot
    bar.set_postfix_str(f"TP={tp} {label}: compile + prefill ({prefill})")
    if prefill == "full":
        tok = common.block(dec.greedy(prompt_tokens["full"]))
        compile_s = time.perf_counter() - t0
    else:
        steps = prompt_tokens["steps"]
        tok = common.block(dec.greedy(steps[0]))
        compile_s = time.perf_counter() - t0
        for t in steps[1:]:
            tok = dec.greedy(t)
    generated = []
    for _ in range(s["warmup"]):
        tok = common.block(dec.greedy(tok))
        generated.append(tok)
    setup_s = time.perf_counter() - t0

    # pass 1: each step waited for (host dispatch included)
    bar.set_postfix_str(f"TP={tp} {label}: timing")
    times = []
    for _ in range(s["tokens"]):
        t1 = time.perf_counter()
        tok = dec.greedy(tok)
        tok.block_until_ready()
        times.append(time.perf_counter() - t1)
        generated.append(tok)
    # pass 2: the TPOT. Steps dispatched back to back (the token stays on the device,
    # as in a serving loop), one wait; a run of k steps takes dispatch + k * step, so
    # the difference of a long and a short run is the device-bound step time.
    k_short, k_long = PIPELINE_STEPS
    samples = []
    for _ in range(s["samples"]):
        run_s = []
        for k in (k_short, k_long):
            t1 = time.perf_counter()
            for _ in range(k):
                tok = dec.greedy(tok)
            tok.block_until_ready()
            run_s.append(time.perf_counter() - t1)
        samples.append((run_s[1] - run_s[0]) / (k_long - k_short))

    ms = [t * 1e3 for t in samples]
    sync_ms = [t * 1e3 for t in times]
    med = statistics.median(ms)
    rec = {
        "allreduce": label,
        "tp": tp,
        "tpot_ms_median": round(med, 4),
        "tpot_ms_p99": round(common.percentile(ms, 99), 4),
        "tokens_per_s": round(1e3 / med, 2),
        "tpot_ms_sync_median": round(statistics.median(sync_ms), 4),
        "tpot_ms_sync_p99": round(common.percentile(sync_ms, 99), 4),
        "tokens_per_s_sync": round(1e3 / statistics.median(sync_ms), 2),
        "tpot_samples": len(ms),
        "kind": kind,
        "algorithm": alg,
        "preset": s["preset"],
        "dtype": s["dtype"],
        "batch": 1,
        "context": s["context"],
        "prompt_len": s["prompt_len"],
        "tokens": s["tokens"],
        "warmup": s["warmup"],
        "prefill": prefill,
        "compile_s": round(compile_s, 2),
        "setup_s": round(setup_s, 2),
        "generated": [int(t[0, 0]) for t in jax.device_get(generated)],
    }
    if kind in SIFAR_KINDS:
        import sifar_jax

        delta = _counter_delta(before, _sifar_counters())
        calls = sum(d.get("calls", 0) for d in delta.values())
        retries = sum(d.get("retries", 0) for d in delta.values())
        rec["sifar_stats"] = delta  # prefill + warm-up + both passes; calls count once per rank
        rec["algorithm_used"] = ",".join(sorted(delta)) or None
        rec["retries"] = retries
        rec["retries_per_call"] = round(retries / calls, 5) if calls else None
        try:
            sifar_jax.check()
            rec["sifar_check"] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded and reported, the run goes on
            rec["sifar_check"] = f"{type(e).__name__}: {e}"
    del dec
    return rec


def run(args, s, devices, on_record) -> list[dict]:
    config = s["config"]
    todo = cases(s)
    records: list[dict] = []
    bar = common.progress(len(todo), "decode")
    rng = np.random.default_rng(s["seed"])
    prompt = rng.integers(0, config.vocab_size, (1, s["prompt_len"]), dtype=np.int32)
    for tp in s["tp"]:
        mine = [v for t, v in todo if t == tp]
        if not mine:
            continue
        mesh = make_mesh(tp, devices=devices)
        bar.set_postfix_str(f"TP={tp}: random weights")
        params = common.block(random_params(config, mesh, seed=s["seed"]))
        rep = NamedSharding(mesh, P())
        prompt_tokens = {
            "steps": [jax.device_put(prompt[:, i:i + 1], rep) for i in range(s["prompt_len"])],
            "full": jax.device_put(prompt, rep),
        }
        weights = streamed_bytes_per_rank(config, params, tp)
        used_sifar = False
        for variant in mine:
            used_sifar |= variant[1] in SIFAR_KINDS
            rec = run_variant(config, mesh, params, variant, s, prompt_tokens, bar)
            rec["weights_bytes_per_rank"] = weights
            rec["kv_bytes_per_rank"] = kv_cache_bytes_per_rank(config, s["context"], tp)
            records.append(rec)
            if rec.get("sifar_check", "ok") != "ok":
                bar.write(f"SIFAR CHECK FAILED: TP={tp} {rec['allreduce']}: {rec['sifar_check']}")
            bar.write(f"TP={tp} {rec['allreduce']:>16}: {rec['tpot_ms_median']:.3f} ms/token "
                      f"(p99 {rec['tpot_ms_p99']:.3f}, sync {rec['tpot_ms_sync_median']:.3f}; "
                      f"compile+first step {rec['compile_s']:.1f} s)")
            bar.update(1)
            on_record(records)
        # free this TP size's weights before the next one allocates its own
        del params, prompt_tokens
        if used_sifar:
            import sifar_jax

            try:
                sifar_jax.check()  # already recorded per variant; the run goes on regardless
            except Exception:  # noqa: BLE001
                pass
            sifar_jax.shutdown()
        jax.clear_caches()
        gc.collect()
    bar.close()
    return records


# -------------------------------------------------------------------- analysis --
def _by(records):
    return {(r["tp"], r["allreduce"]): r for r in records}


def _prefix_match(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def table_rows(records, order) -> tuple[list[str], list[list]]:
    """One row per record, TP ascending, variants in run order, with the ratios."""
    by = _by(records)
    headers = ["all-reduce", "TP", "TPOT median ms", "TPOT p99 ms", "tokens/s", "vs psum",
               "gap recovered", "sync ms", "retries/call",
               "same tokens as psum"]
    rows = []
    for r in sorted(records, key=lambda r: (r["tp"], order.index(r["allreduce"])
                                            if r["allreduce"] in order else 99)):
        tp, label = r["tp"], r["allreduce"]
        ps, ident = by.get((tp, "psum")), by.get((tp, "identity"))
        vs = f"{ps['tpot_ms_median'] / r['tpot_ms_median']:.3f}x" if ps else "-"
        gap = "-"
        if r["kind"] in SIFAR_KINDS and ps and ident:
            gap = _gap(ps["tpot_ms_median"], ident["tpot_ms_median"], r["tpot_ms_median"])
        rpc = r.get("retries_per_call")
        match = "-"
        if ps and r is not ps:
            n = _prefix_match(r["generated"], ps["generated"])
            match = f"{n}/{len(ps['generated'])}"
        rows.append([label, tp, f"{r['tpot_ms_median']:.3f}", f"{r['tpot_ms_p99']:.3f}",
                     f"{r['tokens_per_s']:.1f}", vs, gap, f"{r['tpot_ms_sync_median']:.3f}",
                     "-" if rpc is None else f"{rpc:.4f}", match])
    return headers, rows


def _gap(t_psum: float, t_identity: float, t_x: float) -> str:
    d = t_psum - t_identity
    if d <= 0:
        return "n/a (psum <= identity)"
    return f"{(t_psum - t_x) / d * 100:.0f}%"


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def budget_lines(records) -> list[str]:
    """Per TP: psum TPOT = weights streamed (at the assumed bandwidth) + all-reduce share
    (psum - identity) + the rest."""
    by = _by(records)
    out = []
    ref = by.get((1, "psum"))
    for tp in sorted({r["tp"] for r in records}):
        ps, ident = by.get((tp, "psum")), by.get((tp, "identity"))
        if not ps:
            continue
        w_ms = ps["weights_bytes_per_rank"] / HBM_BYTES_PER_S * 1e3
        kv_ms = ps["kv_bytes_per_rank"] / HBM_BYTES_PER_S * 1e3
        total = ps["tpot_ms_median"]
        line = (f"TP={tp}: psum TPOT {total:.3f} ms = weights streamed {w_ms:.3f} ms "
                f"({_bytes(ps['weights_bytes_per_rank'])}/rank at {HBM_BYTES_PER_S / 1e12:.1f} TB/s)")
        if tp == 1:
            line += f" + rest {total - w_ms:.3f} ms (TP=1: nothing to all-reduce)"
        elif ident:
            ar = total - ident["tpot_ms_median"]
            line += (f" + all-reduce share {ar:.3f} ms (psum - identity, {ar / total * 100:.0f}%)"
                     f" + rest {total - w_ms - ar:.3f} ms")
        else:
            line += f" + rest {total - w_ms:.3f} ms (no identity row: all-reduce share unknown)"
        line += f"; the rest includes the KV cache read, {kv_ms:.3f} ms at that bandwidth"
        if ref and tp != 1:
            line += f"; {ref['tpot_ms_median'] / total:.2f}x TP=1 psum"
        out.append(line)
    return out


# ---------------------------------------------------------------------- output --
def label_order(s) -> list[str]:
    """Rows and bars: psum, the sifar variants, identity, in the order asked."""
    labels = [v[0] for v in s["variants"]]
    return (["psum"] + [x for x in labels if x.startswith("sifar")] + ["identity"]
            + [x for x in labels if x not in ("psum", "identity") and not x.startswith("sifar")])


def describe_run(s) -> str:
    c = s["config"]
    return (f"{s['preset']} ({c.num_layers} layers, hidden {c.hidden_size}, {s['dtype']}), "
            f"random weights, batch 1, KV cache {s['context']} positions, prompt {s['prompt_len']} "
            f"tokens (prefill: {s['prefill']}), {s['warmup']} warm-up steps, "
            f"{s['tokens']} timed steps per pass")


def write_outputs(args, s, env, records, platform, final: bool):
    host = env["host"]
    order = label_order(s)
    json_path = common.write_json(common.results_path(args.out, "decode", host, ".json"), records)
    headers, rows = table_rows(records, order)
    notes = []
    if platform == "cpu":
        notes.append(CPU_NOTE)
    notes.append(describe_run(s) + ".")
    notes.append(
        "TPOT: the device-bound step time, steps dispatched back to back with the token fed "
        "straight back on the device (as a serving loop runs), from the difference of runs of "
        f"{PIPELINE_STEPS[1]} and {PIPELINE_STEPS[0]} steps; median and p99 over the samples; "
        "tokens/s = 1 / median. Sync: one step followed by block_until_ready (median), which "
        "adds XLA's host-side launch of the step. vs psum: tokens/s "
        "relative to lax.psum at the same TP. Gap recovered: (t_psum - t_x) / (t_psum - "
        "t_identity), the share of the all-reduce cost that the variant removes (identity = no "
        "all-reduce at all: wrong numbers, the upper bound). Same tokens as psum: how many "
        "generated tokens (warm-up + timed) agree with lax.psum's before the first difference "
        "(bf16 rounding of a different summation order may flip an argmax; identity is expected "
        "to differ at once).")
    if not final:
        notes.append("**Partial: the run had not finished when this was written.**")
    failed = [r for r in records if r.get("sifar_check", "ok") != "ok"]
    notes += [f"**sifar_jax.check() failed after TP={r['tp']} {r['allreduce']}: {r['sifar_check']}**"
              for r in failed]
    sections = [("Time per output token", common.markdown_table(headers, rows))]
    budget = budget_lines(records)
    if budget:
        sections.append((
            f"Per-token budget (assumed HBM bandwidth {HBM_BYTES_PER_S / 1e12:.1f} TB/s)",
            "\n".join(f"- {b}" for b in budget)))
    sifar_rows = [[r["allreduce"], r["tp"], r.get("algorithm_used") or "-",
                   " ".join(f"{a}: {d.get('calls', 0)} calls, {d.get('retries', 0)} retries, "
                            f"{d.get('timeouts', 0)} timeouts"
                            for a, d in r.get("sifar_stats", {}).items()) or "-",
                   r.get("sifar_check", "-")]
                  for r in records if r["kind"] in SIFAR_KINDS]
    if sifar_rows:
        sections.append((
            "sifar_jax.stats() (prefill + warm-up + both passes; calls once per rank, retries "
            "per warp on GPUs)",
            common.markdown_table(["all-reduce", "TP", "algorithm used", "counters", "check"],
                                  sifar_rows)))
    compile_rows = [[r["allreduce"], r["tp"], f"{r['compile_s']:.1f}", f"{r['setup_s']:.1f}"]
                    for r in records]
    sections.append(("Set-up time per variant (s)",
                     common.markdown_table(["all-reduce", "TP", "compile + first step",
                                            "compile + prefill + warm-up"], compile_rows)))
    md_path = common.write_markdown(common.results_path(args.out, "decode", host, ".md"),
                                    f"Decode TPOT on {host}", env, sections, notes)
    png_path = None
    if final and not args.no_plot and records:
        png_path = plot(records, order, common.results_path(args.out, "decode", host, ".png"),
                        host, platform, s)
    return json_path, md_path, png_path


def plot(records, order, path, host, platform, s):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tps = sorted({r["tp"] for r in records})
    labels = [o for o in dict.fromkeys(order) if any(r["allreduce"] == o for r in records)]
    by = _by(records)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(labels))
    for ax, key, title in ((axes[0], "tokens_per_s", "back-to-back steps (TPOT)"),
                           (axes[1], "tokens_per_s_sync", "each step waited for (sync)")):
        for i, label in enumerate(labels):
            xs, ys = [], []
            for j, tp in enumerate(tps):
                r = by.get((tp, label))
                if r is not None:
                    xs.append(j + (i - (len(labels) - 1) / 2) * width)
                    ys.append(r[key])
            if not xs:
                continue
            bars = ax.bar(xs, ys, width, label=label, hatch="//" if label == "identity" else None)
            many = len(labels) > 4
            ax.bar_label(bars, fmt="%.0f", fontsize=6 if many else 7, rotation=90 if many else 0,
                         padding=2)
        ax.set_xticks(range(len(tps)))
        ax.set_xticklabels([f"TP={t}" for t in tps])
        ax.set_ylabel("tokens/s (batch 1)")
        ax.margins(y=0.12)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    title = f"Decode throughput, {s['preset']} {s['dtype']}, context {s['context']}, {host}"
    if platform == "cpu":
        title += " (XLA:CPU smoke test, not GPU performance)"
    return common.save_figure(fig, title, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    platform, devices = common.bench_devices(min_gpus=1)
    s = settings(args, platform, len(devices))
    if platform == "cpu":
        print(f"NOTE: {CPU_NOTE}", flush=True)
    print(f"decode benchmark: {describe_run(s)}; TP {s['tp']}; variants "
          f"{[v[0] for v in s['variants']]}", flush=True)
    env = common.describe_environment(devices[: max(s["tp"])])
    records = run(args, s, devices,
                  lambda recs: write_outputs(args, s, env, recs, platform, final=False))
    paths = write_outputs(args, s, env, records, platform, final=True)

    order = label_order(s)
    headers, rows = table_rows(records, order)
    print()
    print(f"[{env['host']}] {describe_run(s)}")
    print(common.plain_table(headers, rows))
    print()
    for line in budget_lines(records):
        print(line)
    print()
    for p in paths:
        if p is not None:
            print(f"wrote {p}")
    failed = [r for r in records if r.get("sifar_check", "ok") != "ok"]
    for r in failed:
        print(f"sifar_jax.check() failed after TP={r['tp']} {r['allreduce']}: {r['sifar_check']}",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
