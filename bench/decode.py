"""End-to-end decode: time per output token (TPOT) of the decoder (Llama, or any family's --preset)
with lax.psum, the paper's baseline inside our decoder (the better of sifar:oneshot and
sifar:twoshot), sifar (unfused and fused with the residual add and RMSNorm) and identity (no
all-reduce: the upper bound), in every decode loop, then over batch sizes and KV lengths.

    python -m bench.decode                    # GPU: Llama-3.1-8B shapes, bf16, TP=2 (4, 8) then 1
    python -m bench.decode --quick            # CPU demo (tiny model): about a minute on 2 cores
    python -m bench.decode --shapes tp2_rank  # one GPU: TP=2's per-rank shapes, no all-reduce

The method, every option and the record fields: docs/reference.md (bench.decode); the results:
docs/performance.md. Writes decode-<host>.{json,md} after every variant: to bench/results/
on GPUs, to the git-ignored bench/results/local/ on a CPU.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

from bench import breakdown, calltrace, common, ttft

common.use_host_devices(8)  # before jax is imported; only XLA:CPU reads it

import jax  # noqa: E402
import numpy as np  # noqa: E402

from models import (LOOPS, SIFAR_KINDS, DecodeOptions, Decoder, make_mesh,  # noqa: E402
                    registry as families, to_rows)
from models.core.attention import ATTN_IMPLS  # noqa: E402
from models.core.sharding import KV_LAYOUTS  # noqa: E402
from models.core.tp import ALLREDUCE_KINDS, fused_add_norm_available  # noqa: E402
from models.decoder import compile_cache, hlo  # noqa: E402
from models.qwen3_moe import MOE_IMPLS  # noqa: E402
from models.weights.types import is_projection  # noqa: E402


def _start_processes() -> bool:
    """jax.distributed under `python -m sifar_jax.launch` (before any computation); False
    otherwise, and where the extension is missing (the benchmark runs without sifar)."""
    try:
        import sifar_jax
    except ImportError:
        return False
    return sifar_jax.distributed.initialize()


LAUNCHED = _start_processes()
PIPELINE_STEPS = (4, 20)  # back-to-back runs whose difference gives one pipelined TPOT sample
TAIL = (50, 90, 99, 99.9)  # percentiles of per-step times (sync, stream)
HBM_BYTES_PER_S = 4.3e12  # assumed H200 HBM3e bandwidth actually reached when streaming weights
BASELINE_ALGORITHMS = ("oneshot", "twoshot")  # the paper's baseline, run inside our decoder
BREAKDOWN_STEPS = 8  # profiled back-to-back steps per variant with --breakdown
TRACE_STEPS = 48  # traced pipelined steps: 48 x 64 all-reduces (8B) stay within one trace ring
PRESETS = {name: family.presets[name] for name, family in families.presets().items()}
# The model's shapes: as the preset says, or one rank's share at TP=2 run on one device
SHAPES = ("full", "tp2_rank")
# The SiFAR paper's end-to-end decode (8x H200, Llama-3.1-8B FP8, batch 1): tokens/s gain over
# NCCL with SiFAR, and with no all-reduce at all. None: not reported.
PAPER_SIFAR_GAIN = {2: 9.1, 4: 14.9, 8: 18.6}
PAPER_NO_ALLREDUCE_GAIN = {2: 18.0, 4: None, 8: 43.0}
CPU_NOTE = ("No GPUs here: XLA:CPU host devices (threads as ranks, one shared memory) run a tiny "
            "model. This shows the protocol running and its tokens against lax.psum's; the timings "
            "mean nothing for GPUs. Speed figures: docs/performance.md.")


# ------------------------------------------------------------------ settings --
def _ints(text: str) -> list[int]:
    return [int(v) for v in str(text).replace(",", " ").split()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.decode",
                                description="Time per output token of the decoder with psum / "
                                            "sifar / identity, every loop, batch x KV length "
                                            "(docs/reference.md).")
    add = p.add_argument
    add("--preset", choices=sorted(PRESETS), default=None,
        help="model shapes, any family's (default: llama3_8b on GPU, tiny on CPU)")
    add("--shapes", choices=SHAPES, default="full",
        help="tp2_rank: one rank's share of TP=2 (half the heads, MLP and vocabulary) as a model "
             "on one device, TP=1, no all-reduce")
    add("--moe-impl", choices=MOE_IMPLS, default=None, help="an MoE preset's expert computation")
    add("--dtype", default=None, help="default: bfloat16 on GPU, the preset's on CPU")
    add("--weights", choices=("bf16", "rows", "fp8"), default="bf16",
        help="fp8: the projections quantized to e4m3 per channel; rows: dense, held as [N, K] "
             "rows (models.to_rows), the layout the persistent step streams, which the XLA "
             "rows read too (bf16: dense, in --dtype, the einsum layout)")
    add("--allreduce", default="psum,sifar,identity",
        help="comma list of psum, sifar, identity, sifar:<algorithm>, sifar_buffers[:<algorithm>]")
    add("--baselines", default=",".join(BASELINE_ALGORITHMS),
        help="sifar algorithms whose rows 'sifar:<alg>' make the baseline ('none': no rows)")
    add("--fused", choices=("auto", "on", "off"), default="auto",
        help="the sifar+fused row (auto: where the library has it; on: also at TP=1)")
    add("--sweep-all-variants", dest="sweep_all", action="store_true",
        help="the fused and baseline rows at every sweep point too")
    add("--breakdown", action="store_true",
        help=f"GPUs: {BREAKDOWN_STEPS} steps traced per variant, us by kernel kind")
    add("--tp", nargs="+", default=None,
        help="TP sizes in order (default: powers of two up to the devices, then 1; CPU: 2 1)")
    add("--loops", default=",".join(LOOPS), help="loops at batch 1 and the first context")
    add("--batch", nargs="+", default=None, help="sweep batch sizes (default 1 2 4 8; quick 1 2)")
    add("--context", nargs="+", default=None,
        help="sweep KV lengths, powers of two >= 64 (default 1024 4096 16384; quick 256 512)")
    add("--sweep-loops", default="pipelined", help="loops timed in the sweep")
    add("--no-sweep", action="store_true", help="time the loops only")
    add("--tokens", type=int, default=None, help="timed steps (default 128; quick 16)")
    add("--samples", type=int, default=None, help="pipelined samples (default 6; quick 2)")
    add("--chunk", type=int, default=16, help="on_device tokens per dispatch")
    add("--in-flight", type=int, default=2, help="stream: steps dispatched ahead")
    add("--seed", type=int, default=0)
    add("--kv-layout", choices=("auto", *sorted(KV_LAYOUTS)), default="auto")
    add("--gemm-rows", type=int, default=None, help="DecodeOptions(gemm_rows=)")
    add("--attn-impl", choices=ATTN_IMPLS, default=None, help="DecodeOptions(attn_impl=)")
    add("--step", choices=("xla", "persistent", "both"), default="xla",
        help="TP=1, batch 1: DecodeOptions(step=) of the rows (both: a 'persistent' row beside "
             "psum's XLA step; records say which step ran)")
    add("--no-trace", action="store_true", help="skip the per-call all-reduce trace")
    add("--quick", action="store_true", help="tiny model, few steps (CPU, CI)")
    add("--out", default=None, help="results directory")
    add("--ttft", nargs="?", const="default", default=None, metavar="LENGTHS",
        help="also time to first token per variant (default 128,1024,4096; CPU 16,64)")
    add("--ttft-only", action="store_true", help="only the time to first token")
    add("--no-compile-cache", action="store_true", help="no persistent compilation cache")
    return p.parse_args(argv)


def _baseline_algorithms(args) -> list[str]:
    return [a.strip() for a in args.baselines.split(",") if a.strip() and a.strip() != "none"]


def baseline_labels(args) -> list[str]:
    """'sifar:<alg>' per --baselines; none without the extension (psum and identity alone)."""
    algs = _baseline_algorithms(args)
    if not algs:
        return []
    try:
        import sifar_jax  # noqa: F401
    except ImportError:
        print("NOTE: no sifar_jax extension: no baseline rows", flush=True)
        return []
    return [f"sifar:{a}" for a in algs]


def parse_variants(args) -> list[tuple]:
    """[(label, kind, algorithm, fused)]: ("psum", "psum", "auto", False), ("sifar:oneshot",
    "sifar", "oneshot", False), ("sifar+fused", "sifar", "auto", True); the baseline rows right
    after psum."""
    items = [a.strip() for a in args.allreduce.split(",") if a.strip()]
    at = items.index("psum") + 1 if "psum" in items else 0
    items[at:at] = [b for b in baseline_labels(args) if b not in items]
    out, seen = [], set()
    for item in items:
        kind, _, alg = item.partition(":")
        alg = alg or "auto"
        if kind not in ALLREDUCE_KINDS:
            raise SystemExit(f"unknown all-reduce {kind!r}; choose from {ALLREDUCE_KINDS}")
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
            out.append((label, kind, alg, False))
    missing = fused_add_norm_available()
    if args.fused == "on" and missing:
        raise SystemExit(f"--fused on: {missing}")
    if args.fused != "off" and not missing and any(v[0] == "sifar" for v in out):
        at = next(i for i, v in enumerate(out) if v[0] == "sifar")
        out.insert(at + 1, ("sifar+fused", "sifar", "auto", True))
    return out


def tp2_rank_config(config):
    """One rank's share of `config` at TP=2 as a model of its own: half the query and KV heads,
    the MLP (or each expert's) width and the vocabulary; the same hidden size and head size."""
    fields = ("num_heads", "num_kv_heads", "intermediate_size", "moe_intermediate_size",
              "vocab_size")
    half = {f: getattr(config, f) for f in fields if hasattr(config, f)}
    odd = [f for f, v in half.items() if v % 2]
    if odd:
        raise SystemExit(f"--shapes tp2_rank: {', '.join(odd)} of this preset is odd")
    return config.replace(**{f: v // 2 for f, v in half.items()})


def settings(args, platform: str, n_devices: int) -> dict:
    gpu = platform == "gpu"
    preset = args.preset or ("llama3_8b" if gpu and not args.quick else "tiny")
    config = PRESETS[preset]()
    dtype = args.dtype or ("bfloat16" if gpu else config.dtype)
    quick = args.quick or not gpu
    s = {
        "preset": preset,
        "shapes": args.shapes,
        "dtype": dtype,
        "weights": "fp8" if args.weights == "fp8" else dtype,  # each record's "weights"
        "to_rows": args.weights == "rows",  # dense weights held as rows (models.to_rows)
        "batch": _ints(" ".join(args.batch)) if args.batch else ([1, 2] if quick else [1, 2, 4, 8]),
        "context": (_ints(" ".join(args.context)) if args.context
                    else ([256, 512] if quick else [1024, 4096, 16384])),
        "tokens": args.tokens or (16 if quick else 128),
        "samples": args.samples or (2 if quick else 6),
        "chunk": args.chunk,
        "in_flight": args.in_flight,
        "warmup": 2,
        "seed": args.seed,
        "kv_layout": None if args.kv_layout == "auto" else args.kv_layout,
        "gemm_rows": args.gemm_rows,
        "attn_impl": args.attn_impl,
        "step": args.step,
        "fused_tp1": args.fused == "on",
        "sweep_all": args.sweep_all,
        "breakdown": args.breakdown and gpu,
        "trace": not args.no_trace,
        "loops": _loops(args.loops),
        "sweep_loops": [] if args.no_sweep else _loops(args.sweep_loops),
        "variants": parse_variants(args),
    }
    wanted = {f"sifar:{a}" for a in _baseline_algorithms(args)}
    s["baselines"] = [v[0] for v in s["variants"] if v[0] in wanted]
    if args.weights != "bf16" and (args.ttft or args.ttft_only):
        raise SystemExit(f"--ttft runs dense weights only (bench/ttft.py): not with --weights "
                         f"{args.weights}")
    if args.shapes == "tp2_rank":
        config = tp2_rank_config(config)
    s["config"] = config.replace(dtype=dtype, max_seq_len=max(s["context"]))
    if args.moe_impl:
        if not hasattr(config, "moe_impl"):
            raise SystemExit(f"--moe-impl: {preset} is not an MoE")
        s["config"] = s["config"].replace(moe_impl=args.moe_impl)
    for c in s["context"]:
        if c < 64 or c & (c - 1):
            raise SystemExit(f"--context {c}: must be a power of two >= 64 (one attention bucket)")
        need = max(steps_needed(loop, s) for loop in set(s["loops"]) | set(s["sweep_loops"]))
        if need >= c // 2:
            raise SystemExit(f"--context {c}: the loops need {need} steps, which must stay in the "
                             f"top half of the context; raise --context or lower --tokens/--samples")
    s["tp"] = tp_sizes(args, config, platform, n_devices)
    return s


def tp_sizes(args, config, platform: str, n_devices: int) -> list[int]:
    if args.tp:
        tps = _ints(" ".join(args.tp))
    elif args.shapes == "tp2_rank":
        tps = [1]
    elif jax.process_count() > 1:
        tps = [n_devices]  # every process's GPUs in one mesh
    else:
        gpu = platform == "gpu"
        tps = sorted(common.powers_of_two_up_to(n_devices) if gpu else [2], reverse=True) + [1]
    if args.shapes == "tp2_rank" and tps != [1]:
        raise SystemExit("--shapes tp2_rank is one rank of TP=2 on one device: --tp 1 only")
    if jax.process_count() > 1:
        local = len(jax.local_devices())
        skipped = [t for t in tps if t % local or t < local * jax.process_count()]
        if skipped:
            print(f"NOTE: {jax.process_count()} processes: TP {skipped} skipped (a mesh must "
                  f"hold every process's {local} device(s))", flush=True)
        tps = [t for t in tps if t not in skipped]
        if not tps:
            raise SystemExit("no TP size spans every process")
    for t in tps:
        if not 1 <= t <= n_devices:
            raise SystemExit(f"--tp {t}: have {n_devices} {platform} devices")
        try:
            families.family_of(config).check_tp(config, t)
        except ValueError as e:
            raise SystemExit(f"--tp {t}: {e}") from None
    return list(dict.fromkeys(tps))


def _loops(text: str) -> list[str]:
    loops = [v.strip() for v in text.split(",") if v.strip()]
    for loop in loops:
        if loop not in LOOPS:
            raise SystemExit(f"unknown loop {loop!r}; choose from {LOOPS}")
    return loops


def steps_needed(loop: str, s) -> int:
    """Decode steps one timed loop runs (its start position is context - this - 1)."""
    return {"sync": s["warmup"] + s["tokens"],
            "stream": s["warmup"] + s["tokens"],
            "pipelined": s["warmup"] + s["samples"] * sum(PIPELINE_STEPS),
            "on_device": s["chunk"] * _chunks(s)}[loop]


def _chunks(s) -> int:
    """on_device dispatches: the first (it compiles) and the gap after it are not timed."""
    return max(4, s["tokens"] // s["chunk"]) + 2


# The persistent step's row (DecodeOptions(step="persistent"), TP=1, batch 1; its 6th field).
PERSISTENT = ("persistent", "psum", "auto", False, None, "persistent")


def cases(s) -> list[tuple[int, int, int, tuple, list[str]]]:
    """[(tp, batch, context, variant, loops)]: the loops at batch 1 and the first context, the
    sweep elsewhere. TP=1 runs lax.psum (and the fused rows with --fused on); the fused and
    baseline rows run at the loops' point only unless --sweep-all-variants."""
    base = (1, s["context"][0])
    points = [base] + [(b, c) for c in s["context"] for b in s["batch"] if (b, c) != base]
    out = []
    for tp in s["tp"]:
        variants = s["variants"] if tp > 1 else [("psum", "psum", "auto", False)] + (
            [v for v in s["variants"] if v[3]] if s.get("fused_tp1") else [])
        if tp == 1 and s.get("step", "xla") != "xla":
            keep = variants if s["step"] == "both" else []
            variants = keep + [PERSISTENT]
        for b, c in points:
            loops = s["loops"] + [x for x in s["sweep_loops"] if x not in s["loops"]] \
                if (b, c) == base else s["sweep_loops"]
            here = [v for v in variants if ((b, c) == base or s["sweep_all"]
                    or not (v[3] or v[0] in s["baselines"])) and (b == 1 or v != PERSISTENT)]
            if loops:
                out += [(tp, b, c, v, loops) for v in here]
    return out


# -------------------------------------------------------------- weights, KV --
def floor_ms(weights_bytes: int, kv_bytes: int) -> float:
    """A step's memory floor: its weights and KV cache read once at HBM_BYTES_PER_S."""
    return (weights_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e3


def kv_cache_bytes_per_rank(config, context: int, tp: int, batch: int = 1) -> int:
    """K and V of every layer over `context` positions: what attention reads per step."""
    itemsize = np.dtype(jax.numpy.dtype(config.dtype)).itemsize
    heads = families.family_of(config).layout(config, tp).shapes.num_kv_heads // tp
    return 2 * config.num_layers * batch * context * heads * config.head_dim * itemsize


# ------------------------------------------------------------------- set-up --
def make_decoder(config, mesh, params, variant, batch: int, context: int, seed: int,
                 kv_layout: str | None = None,
                 gemm_rows: int | None = None, attn_impl: str | None = None,
                 pack_params: bool | None = None):
    """A Decoder with a random cache of `context` positions; sifar's slot widened to a step's
    payload (batch x hidden) where the default is smaller."""
    _, kind, alg, fused = variant[:4]
    slot = None
    if kind in SIFAR_KINDS:
        import sifar_jax

        payload = batch * config.hidden_size * np.dtype(jax.numpy.dtype(config.dtype)).itemsize
        slot = payload if payload > sifar_jax.DEFAULT_SLOT_BYTES else None
    options = DecodeOptions(allreduce=kind, algorithm=alg, fused=fused, slot_bytes=slot,
                            kv_layout=kv_layout, gemm_rows=gemm_rows, attn_impl=attn_impl,
                            prefetch_bytes=variant[4] if len(variant) > 4 else None,
                            pack_params=True if pack_params is None else pack_params,
                            step=variant[5] if len(variant) > 5 else "xla")
    dec = Decoder(config, mesh, params, options, batch_size=batch, max_seq_len=context)
    dec.reset(context)
    dec.randomize_cache(seed)
    return dec


def step_ran(dec) -> str:
    """Which step the decoder's one-token calls run: "persistent" where it asked for it and
    the step can run it, else "xla" (Decoder.step_kind; Decoder.step_reason says why)."""
    return dec.step_kind


def start_tokens(config, batch: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, config.vocab_size, batch, dtype=np.int32)


# ------------------------------------------------------------------- timing --
def _seek(dec, loop: str, s, context: int, first) -> None:
    dec.seek(context - steps_needed(loop, s) - 1, first)


def time_sync(dec, s) -> tuple[list[float], list[np.ndarray]]:
    """Per-step seconds of `advance(); token()`, and the tokens."""
    out, times = [], []
    for i in range(s["warmup"] + s["tokens"]):
        t0 = time.perf_counter()
        dec.advance()
        out.append(dec.token())
        if i >= s["warmup"]:
            times.append(time.perf_counter() - t0)
    return times, out


def time_stream(dec, s) -> tuple[list[float], list[np.ndarray]]:
    """Gaps between consecutive tokens of Decoder.decode(loop="stream") after the warm-up."""
    stamps, out = [], []
    for tok in dec.decode(s["warmup"] + s["tokens"] + 1, loop="stream", in_flight=s["in_flight"]):
        stamps.append(time.perf_counter())
        out.append(tok)
    return np.diff(stamps[s["warmup"]:]).tolist(), out[1:]


def time_pipelined(dec, s) -> tuple[list[float], list[np.ndarray]]:
    """Back-to-back steps, one wait per run: (t(20 steps) - t(4 steps)) / 16 per sample."""
    dec.advance(s["warmup"])
    dec.token()
    short, long_ = PIPELINE_STEPS
    samples = []
    for _ in range(s["samples"]):
        run = []
        for k in (short, long_):
            t0 = time.perf_counter()
            dec.advance(k)
            dec.token()
            run.append(time.perf_counter() - t0)
        samples.append((run[1] - run[0]) / (long_ - short))
    return samples, [dec.token()]


def time_on_device(dec, s) -> tuple[list[float], list[np.ndarray]]:
    """Gaps between chunk arrivals / chunk (the first chunk, which compiles, untimed)."""
    k = s["chunk"]
    stamps, out = [], []
    for i, tok in enumerate(dec.decode(k * _chunks(s) + 1, loop="on_device", chunk=k,
                                       in_flight=s["in_flight"])):
        if i % k == 1:  # the first token of each chunk (token 0 is the start token)
            stamps.append(time.perf_counter())
        out.append(tok)
    return (np.diff(stamps[1:]) / k).tolist(), out[1:]


TIMERS = {"sync": time_sync, "stream": time_stream, "pipelined": time_pipelined,
          "on_device": time_on_device}


# ------------------------------------------------------------------ records --
def _prefetch_bytes(variant) -> int | None:
    """What the fused call prefetches into L2 (the library's default), None unfused."""
    if not variant[3]:
        return None
    import sifar_jax.fused

    return sifar_jax.fused.DEFAULT_PREFETCH_BYTES


def make_record(variant, loop: str, tp: int, batch: int, context: int, s, seconds,
                tokens, extra: dict) -> dict:
    label, kind, alg, fused = variant[:4]
    ms = [t * 1e3 for t in seconds]
    med = statistics.median(ms)
    rec = {"allreduce": label, "tp": tp, "loop": loop, "fused": bool(fused),
           "prefetch_bytes": _prefetch_bytes(variant), "batch": batch, "context": context,
           "tpot_ms_median": round(med, 4), "tpot_ms_p99": round(common.percentile(ms, 99), 4),
           "tokens_per_s": round(batch * 1e3 / med, 2), "tpot_samples": len(ms), "kind": kind,
           "algorithm": alg, "preset": s["preset"], "dtype": s["dtype"], "weights": s["weights"],
           "moe_impl": getattr(s["config"], "moe_impl", None),
           "start_position": context - steps_needed(loop, s) - 1, "steps": steps_needed(loop, s),
           "generated": [int(t[0]) for t in tokens]}  # sequence 0
    if loop in ("sync", "stream"):
        rec.update({f"tpot_ms_p{q:g}".replace(".", "_"): round(common.percentile(ms, q), 4)
                    for q in TAIL})
    rec.update(extra)
    if rec.get("floor_ms"):
        rec["floor_ratio"] = round(med / rec["floor_ms"], 3)  # TPOT over the memory floor
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


def weight_layout(params) -> str:
    """How the params the decoder holds store their projections: "rows" (output-major:
    Fp8Weight or RowWeight leaves) or "einsum"."""
    return "rows" if any(is_projection(x) for x in jax.tree.leaves(
        params, is_leaf=is_projection)) else "einsum"


def run_variant(config, mesh, params, case, s, bar) -> list[dict]:
    """Set up one variant at one (batch, context), time each of its loops, one record each."""
    tp, batch, context, variant, loops = case
    label, kind = variant[0], variant[1]
    where = f"TP={tp} b={batch} ctx={context} {label}"
    before = None
    if kind in SIFAR_KINDS:
        import sifar_jax

        before = sifar_jax.stats()
    t0 = time.perf_counter()
    bar.set_postfix_str(f"{where}: set-up")
    dec = make_decoder(config, mesh, params, variant, batch, context, s["seed"], s["kv_layout"],
                       gemm_rows=s.get("gemm_rows"), attn_impl=s.get("attn_impl"))
    first = start_tokens(config, batch, s["seed"])
    setup_s = time.perf_counter() - t0
    timed = []
    for loop in loops:
        bar.set_postfix_str(f"{where}: {loop}")
        _seek(dec, loop, s, context, first)
        copies = cache_copies(dec, loop, s)
        t1 = time.perf_counter()
        seconds, tokens = TIMERS[loop](dec, s)
        timed.append((loop, seconds, tokens, time.perf_counter() - t1, copies))
    trace = trace_allreduces(dec, s, context, first) if kind in SIFAR_KINDS and s["trace"] else None
    split = None
    if s["breakdown"] and (batch, context) == (1, s["context"][0]):
        bar.set_postfix_str(f"{where}: breakdown")
        split = step_breakdown(dec, context, first)
    # the bytes a step reads of these params (FP8: e4m3 + scales; an MoE: top-k experts)
    weights = dec.family.step_weight_bytes(dec.layout, dec.params)
    kv = kv_cache_bytes_per_rank(config, context, tp, batch)
    common_fields = {"setup_s": round(setup_s, 2), "shapes": s["shapes"], "kv_layout": dec.kv_layout,
                     "step": step_ran(dec), "weight_layout": weight_layout(dec.params),
                     "rows": dec.rows,
                     "gemm_rows": dec.gemm_rows, "attn_impl": dec.attn_impl,
                     "pack_params": dec.pack_params, "arrays_per_call": len(dec.weights.leaves),
                     "weights_bytes_per_rank": weights, "kv_bytes_per_rank": kv,
                     "floor_ms": float(f"{floor_ms(weights, kv):.4g}")}
    if kind in SIFAR_KINDS:
        common_fields.update(sifar_fields(before))
    if trace is not None:
        common_fields["allreduce_trace"] = trace
    if split is not None:
        common_fields["breakdown"] = split
    del dec
    return [make_record(variant, loop, tp, batch, context, s, seconds, tokens,
                        dict(common_fields, loop_s=round(loop_s, 2), cache_copies=copies))
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


def trace_allreduces(dec, s, context: int, first) -> dict:
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
        rec = t.records()
        return {"steps": TRACE_STEPS, **calltrace.summarize(rec)}
    except Exception as e:  # noqa: BLE001 - recorded; the benchmark goes on
        return {"error": f"{type(e).__name__}: {e}"}


def cache_copies(dec, loop: str, s) -> dict:
    """{"entry": n, "loop": n}: KV-cache copies in the optimised HLO this loop runs from here."""
    exe = dec.compiled_chunk(s["chunk"]) if loop == "on_device" else dec.compiled_step()
    text, counts = exe.as_text(), {}
    for shape in hlo.cache_shapes(dec.state["cache"]):  # the array, a layer, a layer's keys
        for place, lines in hlo.cache_copies(text, shape).items():
            counts[place] = counts.get(place, 0) + len(lines)
    return counts


def run(s, devices, on_record) -> list[dict]:
    config = s["config"]
    todo = cases(s)
    records: list[dict] = []
    bar = common.progress(len(todo), "decode")
    for tp in s["tp"]:
        mine = [c for c in todo if c[0] == tp]
        if not mine:
            continue
        mesh = make_mesh(tp, devices=devices)
        bar.set_postfix_str(f"TP={tp}: random weights")
        try:
            params = common.block(families.family_of(config).random_params(
                config, mesh, seed=s["seed"], quantize="fp8" if s["weights"] == "fp8" else None))
            if s["to_rows"]:
                params = to_rows(params, config, donate=True)
        except ValueError as e:  # a model this TP size cannot split or quantize: say so, no trace
            raise SystemExit(f"bench.decode: TP={tp}: {e}") from None
        used_sifar = any(case[3][1] in SIFAR_KINDS for case in mine)
        for case in mine:
            recs = run_variant(config, mesh, params, case, s, bar)
            records += recs
            for r in (r for r in recs if r["cache_copies"]):
                bar.write(f"KV CACHE COPIED: TP={tp} {r['allreduce']} {r['loop']}: "
                          f"{r['cache_copies']} (copies per call / per loop iteration)")
            if recs[0].get("sifar_check", "ok") != "ok":
                bar.write(f"SIFAR CHECK FAILED: TP={tp} {case[3][0]}: {recs[0]['sifar_check']}")
            bar.write(f"TP={tp} batch {case[1]} context {case[2]} {case[3][0]:>12}: " + ", ".join(
                f"{r['loop']} {r['tpot_ms_median']:.3f} ms" for r in recs)
                + f" (set-up {recs[0]['setup_s']:.1f} s)")
            bar.update(1)
            on_record(records)
        del params  # free this TP size's weights before the next one allocates its own
        if used_sifar:
            import sifar_jax

            sifar_jax.shutdown()
        jax.clear_caches()
        gc.collect()
    bar.close()
    return records


# ----------------------------------------------------------------- analysis --
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


def table_rows(records, order, gpu: bool = True) -> tuple[list[str], list[list]]:
    """Every record (annotated by with_baseline); on a CPU without the ratios to lax.psum, the
    baseline and the floor (they mean nothing there)."""
    idx = _index(records)
    headers = ["TP", "loop", "batch", "context", "all-reduce", "TPOT median ms", "TPOT p99 ms",
               "tokens/s", "retries/call", "same tokens as psum"]
    if gpu:
        headers[8:8] = ["vs psum", "vs baseline", "x floor", "gap recovered"]
    rows = []
    for r in _sorted(records, order):
        ps, ident = idx.get((*_key(r), "psum")), idx.get((*_key(r), "identity"))
        rpc = r.get("retries_per_call")
        row = [r["tp"], r["loop"], r["batch"], r["context"], _named(r), f"{r['tpot_ms_median']:.3f}",
               f"{r['tpot_ms_p99']:.3f}", f"{r['tokens_per_s']:.1f}",
               "-" if rpc is None else f"{rpc:.4f}", _same_tokens(r, ps)]
        if gpu:
            gap = "-"
            if r["kind"] in SIFAR_KINDS and ps and ident:
                gap = _gap(ps["tpot_ms_median"], ident["tpot_ms_median"], r["tpot_ms_median"])
            row[8:8] = [f"{ps['tpot_ms_median'] / r['tpot_ms_median']:.3f}x" if ps else "-",
                        _ratio(r.get("vs_baseline")), _ratio(r.get("floor_ratio")), gap]
        rows.append(row)
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
        if point in seen or r["kind"] == "psum":
            continue
        seen.add(point)
        mine = [x for x in records if (x["tp"], x["batch"], x["context"], x["allreduce"]) == point]
        same = ", ".join(f"{x['loop']} {_same_tokens(x, idx.get((*_key(x), 'psum')))}"
                         for x in mine)
        stats = r.get("sifar_stats") or {}
        total = {f: sum(v.get(f, 0) for v in stats.values()) for f in ("calls", "retries",
                                                                       "timeouts")}
        sifar = r["kind"] in SIFAR_KINDS
        rows.append([r["tp"], r["batch"], r["context"], r["allreduce"],
                     r.get("algorithm_used") or "none (no all-reduce)",
                     *(total[f] if sifar else "-" for f in ("calls", "retries", "timeouts")),
                     r.get("sifar_check", "-"), same])
    return headers, rows


# ----------------------------------------------------- baseline and floor --
def baselines(records, s) -> dict:
    """{(tp, loop, batch, context): the fastest record of the baseline rows (s["baselines"])}."""
    best: dict = {}
    for r in records:
        if r["allreduce"] in s["baselines"]:
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
    ctx = s["context"][0]
    headers = ["TP", "loop", "all-reduce", "TPOT ms", "floor ms", "x floor", "vs psum",
               "vs baseline"]
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
    ctx = s["context"][0]
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
    for b in s["batch"]:
        row = [b]
        for c in s["context"]:
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
    return ["batch \\ KV length"] + [str(c) for c in s["context"]], rows


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


# ------------------------------------------------------------------- output --
def label_order(s) -> list[str]:
    """Rows and bars: psum, the sifar variants, identity, in the order asked."""
    labels = [v[0] for v in s["variants"]]
    return (["psum"] + [x for x in labels if x.startswith("sifar")] + ["identity"]
            + [x for x in labels if x not in ("psum", "identity") and not x.startswith("sifar")])


def describe_run(s) -> str:
    c = s["config"]
    moe = (f", {c.num_experts} experts top-{c.num_experts_per_tok} ({c.moe_impl})"
           if hasattr(c, "moe_impl") else "")
    fp8 = (", FP8 weights (e4m3, per-channel scales)" if s["weights"] == "fp8" else
           ", the projections held as [N, K] rows" if s["to_rows"] else "")
    return (f"{s['preset']} ({c.num_layers} layers, hidden {c.hidden_size}{moe}, {s['dtype']}"
            f"{fp8}), random weights and KV cache; loops {','.join(s['loops'])} at batch 1, KV length "
            f"{s['context'][0]}; sweep ({','.join(s['sweep_loops']) or 'none'}) batch "
            f"{s['batch']} x KV length {s['context']}; {s['tokens']} timed steps (sync, stream, "
            f"on_device), {s['samples']} pipelined samples, on_device {s['chunk']} tokens per "
            f"dispatch, stream {s['in_flight']} steps in flight"
            + ("; TP=2's per-rank shapes on one device (--shapes tp2_rank)"
               if s["shapes"] == "tp2_rank" else ""))


def out_dir(args, platform: str) -> Path:
    """GPU results go where they are committed; a CPU demo into a git-ignored directory."""
    return Path(args.out) if args.out else common.default_out(platform)


BREAKDOWN_SKIPPED = "--breakdown: skipped, a CPU run has no device trace of GPU kernels"


def floor_note(s) -> str:
    floor = (f"Floor: a step's weights and KV cache (per rank) read once at "
             f"{HBM_BYTES_PER_S / 1e12:g} TB/s (floor_ms; x floor = TPOT / floor_ms). ")
    if not s["baselines"]:
        return floor + "Baseline: none (no in-decoder one-shot or two-shot row ran)."
    return floor + (f"Baseline: the fastest of the in-decoder rows {' or '.join(s['baselines'])} "
                    "at the same TP, loop, batch and KV length (the paper's baseline, given every "
                    "decoder improvement ours gets); vs baseline: tokens/s over the baseline's.")


METHOD_NOTE = (
    "TPOT per loop (tokens/s = batch / TPOT): sync, one step then its token read; stream, the gap "
    "between tokens of Decoder.decode(loop='stream'); pipelined, steps back to back, "
    f"(t({PIPELINE_STEPS[1]} steps) - t({PIPELINE_STEPS[0]})) / {PIPELINE_STEPS[1] - PIPELINE_STEPS[0]}"
    "; on_device, the gap between chunks of one lax.fori_loop dispatch / its length. Gap "
    "recovered: (t_psum - t_x) / (t_psum - t_identity). Same tokens as psum: generated tokens "
    "(sequence 0) equal to lax.psum's before the first difference (identity differs at once). "
    "Method: docs/reference.md, bench.decode.")


def _section(title: str, table) -> list[tuple[str, str]]:
    return [(title, common.markdown_table(*table))] if table[1] else []


def gpu_sections(records, s) -> list[tuple[str, str]]:
    ctx = s["context"][0]
    out = _section(f"Against the paper: batch 1, KV length {ctx} (paper: 8x H200, Llama-3.1-8B "
                   "FP8, SiFAR vs NCCL)", paper_rows(records, s))
    out += _section(f"Memory floor, lax.psum and the baseline: batch 1, KV length {ctx}",
                    floor_rows(records, s))
    for tp in sorted({r["tp"] for r in records if r["tp"] > 1}):
        for loop in s["sweep_loops"]:
            grid = sweep_grid(records, s, tp, loop)
            out += _section(f"Sweep, TP={tp}, {loop}: tokens/s gain over lax.psum", grid or ([], []))
    out += _section("Tail of the per-step time (batch 1)", tail_rows(records))
    out += _section("sifar all-reduces inside the decode step: per-call latency from device "
                    f"timestamps ({TRACE_STEPS} back-to-back steps, every rank, block 0's view)",
                    allreduce_tail_rows(records))
    out += _section(f"Where a step's device time goes: {BREAKDOWN_STEPS} back-to-back steps traced "
                    "(batch 1, the loops' KV length; microseconds per step)",
                    breakdown_rows(records))
    return out


def write_outputs(args, s, env, records, platform, final: bool):
    gpu, host, order = platform == "gpu", env["host"], label_order(s)
    d = out_dir(args, platform)
    records = with_baseline(records, s)
    stem = {"fp8": "decode-fp8", "rows": "decode-rows"}.get(args.weights, "decode")  # side by side
    json_path = common.write_json(common.results_path(d, stem, host, ".json"), records)
    notes = ([] if gpu else [CPU_NOTE]) + [describe_run(s) + ".", METHOD_NOTE]
    notes += [floor_note(s)] if gpu else []
    if args.breakdown and not s["breakdown"]:
        notes.append(BREAKDOWN_SKIPPED)
    if not final:
        notes.append("**Partial: the run had not finished when this was written.**")
    notes += [f"**sifar_jax.check() failed after TP={r['tp']} {r['allreduce']}: {r['sifar_check']}**"
              for r in records if r.get("sifar_check", "ok") != "ok" and r["loop"] == s["loops"][0]]
    copied = [f"TP={r['tp']} {r['allreduce']} {r['loop']} batch {r['batch']} KV {r['context']}: "
              f"{r['cache_copies']}" for r in records if r.get("cache_copies")]
    notes.append("**The optimised HLO copies the KV cache** (per call: entry, per iteration: loop): "
                 + "; ".join(copied) if copied else
                 "The optimised HLO of every timed executable updates the KV cache in place "
                 "(models.hlo.cache_copies).")
    sections = gpu_sections(records, s) if gpu else []
    sections += _section("What ran: sifar_jax.stats() per variant (all its loops; calls once per "
                         "rank, retries per warp on GPUs) and its tokens against lax.psum's",
                         protocol_rows(records, order))
    sections += _section("Every record" if gpu else "Every record (XLA:CPU timings: not a "
                         "performance result)", table_rows(records, order, gpu))
    md_path = common.write_markdown(common.results_path(d, stem, host, ".md"),
                                    f"Decode TPOT on {host}", env, sections, notes)
    return json_path, md_path


def print_gpu_summary(records, s) -> None:
    headers, rows = paper_rows(records, s)
    if rows:
        print(common.plain_table(headers, rows) + "\n")
    headers, rows = floor_rows(records, s)
    if rows:
        print(f"Batch 1 against the memory floor (weights and KV cache per rank read once at "
              f"{HBM_BYTES_PER_S / 1e12:g} TB/s), lax.psum and the baseline "
              f"(the fastest of {', '.join(s['baselines']) or 'none'}):")
        print(common.plain_table(headers, rows) + "\n")
    headers, rows = breakdown_rows(records)
    if rows:
        print(f"Where a step's device time goes ({BREAKDOWN_STEPS} steps traced, us per step):")
        print(common.plain_table(headers, rows) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    cache_dir = compile_cache.enable(off=args.no_compile_cache)
    print(f"compilation cache: {cache_dir or 'off'}", flush=True)
    platform, devices = common.bench_devices(min_gpus=1)
    s = settings(args, platform, len(devices))
    if platform == "cpu":
        print(f"NOTE: {CPU_NOTE}", flush=True)
    if args.breakdown and not s["breakdown"]:
        print(f"NOTE: {BREAKDOWN_SKIPPED}", flush=True)
    print(f"decode benchmark: {describe_run(s)}; TP {s['tp']}; variants "
          f"{[v[0] for v in s['variants']]}", flush=True)
    env = common.describe_environment(devices[: max(s["tp"])])
    lead = jax.process_index() == 0  # with one process per GPU, process 0 reports
    if jax.process_count() > 1:
        env["host"] += f"-{jax.process_count()}proc"
    if args.ttft_only and args.ttft is None:
        args.ttft = "default"
    ttft_records, ttft_paths = [], ()
    if args.ttft is not None:
        ttft_records = ttft.run(s["config"], devices, s["tp"], s["variants"],
                                ttft.parse_lengths(args.ttft, platform), s["samples"], s["seed"],
                                s["kv_layout"], HBM_BYTES_PER_S)
        for r in ttft_records:
            r["shapes"] = s["shapes"]
        if lead:
            ttft_paths = ttft.write(ttft_records, out_dir(args, platform), env,
                                    [CPU_NOTE] if platform == "cpu" else [])
            print(common.plain_table(*ttft.table(ttft_records)), flush=True)
    if args.ttft_only:
        for p in ttft_paths:
            print(f"wrote {p}")
        return 0 if all("error" not in r for r in ttft_records) else 1
    records = run(s, devices, lambda recs: lead and write_outputs(args, s, env, recs, platform,
                                                                  final=False))
    if not lead:
        return 1 if any(r.get("sifar_check", "ok") != "ok" for r in records) else 0
    paths = write_outputs(args, s, env, records, platform, final=True) + tuple(ttft_paths)
    print(f"\n[{env['host']}] {describe_run(s)}")
    records = with_baseline(records, s)
    if platform == "gpu":
        print_gpu_summary(records, s)
    else:
        print("What ran (XLA:CPU: the protocol and its tokens; speed figures are GPU results, "
              "docs/performance.md):")
        print(common.plain_table(*protocol_rows(records, label_order(s))))
    print()
    for p in paths:
        if p is not None:
            print(f"wrote {p}")
    failed = {(r["tp"], r["allreduce"], r["sifar_check"]) for r in records
              if r.get("sifar_check", "ok") != "ok"}
    for tp, label, why in sorted(failed):
        print(f"sifar_jax.check() failed after TP={tp} {label}: {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
