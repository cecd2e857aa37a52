"""End-to-end decode: time per output token (TPOT) of the Flax decoder (Llama, or any model family's
--preset) with lax.psum, with the paper's baseline (the better of a one-shot and a two-shot
all-reduce, run inside our decoder: rows sifar:oneshot and sifar:twoshot), with sifar_psum
(unfused, and fused with the residual add and RMSNorm when sifar_jax has it), and with the
all-reduce replaced by identity, in every decode loop, over batch sizes and KV lengths.

    python -m bench.decode                    # GPU: Llama-3.1-8B shapes, bf16, TP=2 (4, 8) then 1
    python -m bench.decode --quick            # CPU demo (tiny model): about a minute on 2 cores
    python -m bench.decode --preset qwen3_30b_a3b --moe-impl gather   # the MoE (GPU)
    python -m bench.decode --tp 2 --batch 1 --context 1024 --no-sweep   # the loops only

Two parts, per TP size (TP=1 runs only lax.psum, the reference: nothing to reduce):

1. The loops, at batch 1 and the first --context: every loop of models.decode (LOOPS), timed
   from host timestamps:
     sync       one step, then wait for its token: the median of per-step times
     stream     Decoder.decode(loop="stream"): the median gap between consecutive tokens
     pipelined  steps dispatched back to back, the tokens read once at the end: the difference
                of runs of 20 and 4 steps over (20 - 4), the median over the samples (today's TPOT)
     on_device  K = --chunk tokens per dispatch in a lax.fori_loop, streamed: the median gap
                between consecutive chunks / K
   tokens/s = batch / TPOT. sync and stream also give the tail: p50/p90/p99/p99.9 of the
   per-step (per-token) times.
2. The sweep: --batch x --context with the --sweep-loops (default pipelined).

No prompt is prefilled: the KV cache is filled with random values and each loop starts at the
position that lets all its steps attend within `context` positions (context is one attention
bucket), so a step costs what a filled context of that length costs, at every length (a 16K
prefill of an 8B model would take longer than the whole run). Every variant starts from the same
cache and token, so the generated tokens are comparable ("same tokens as psum").

sifar variants also trace their all-reduces inside the decode step (sifar_jax.call_trace: device
%globaltimer stamps per call and rank, bench.calltrace): TRACE_STEPS pipelined steps after the
timed loops, giving "allreduce_trace" (p50/p90/p99/p99.9 of per-call latency, the share of calls
that mis-speculated) on each of the variant's records.

Each record also says whether the optimised HLO of the executable its loop runs copies the KV cache
(per call, or per iteration of the on-device loop: "cache_copies", models.hlo).

Against what a step cannot beat and what a user would otherwise pick, every record carries:
  floor_ms, floor_ratio  the memory floor, the step's weights and KV cache per rank read once at
                         HBM_BYTES_PER_S, and TPOT / floor_ms (the same formula on a CPU)
  baseline, vs_baseline  the fastest of the --baselines rows at the record's TP, loop, batch and
                         KV length (None where none ran), and tokens/s over its
With --breakdown (GPUs), each variant at the loops' point also carries "breakdown": BREAKDOWN_STEPS
steps traced on the device, microseconds per step of matmul / attention / all-reduce / other /
idle (bench.probes.step_kernels).

Started by `python -m sifar_jax.launch -n N` (one process per GPU), the N processes decode
together at TP=N (TP=1, a mesh of one process's GPU, is skipped), each timing its own host loop;
process 0 reports, as decode-<host>-<N>proc.*.

Writes decode-<host>.{json,md,png} after every variant (a run cut short keeps what it measured):
to bench/results/ on GPUs (the committed results), to bench/results/local/ (git-ignored) on a CPU.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

from bench import calltrace, common, ttft

common.use_host_devices(8)  # before jax is imported; only XLA:CPU reads it

import jax  # noqa: E402
import numpy as np  # noqa: E402

from models import compile_cache, families, hlo  # noqa: E402
from models.attention import ATTN_IMPLS  # noqa: E402
from models.sharding import KV_LAYOUTS  # noqa: E402
from models.tp import ALLREDUCE_KINDS, fused_add_norm_available  # noqa: E402
from models.decode import LOOPS, SIFAR_KINDS, Decoder, make_mesh  # noqa: E402
from models.options import DecodeOptions  # noqa: E402
from models.qwen3_moe import MOE_IMPLS  # noqa: E402


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
# The paper's baseline: the better of a one-shot and a two-shot all-reduce, here run inside our
# decoder (sifar:oneshot, sifar:twoshot) so that it gets every decoder improvement ours gets.
BASELINE_ALGORITHMS = ("oneshot", "twoshot")
BREAKDOWN_STEPS = 8  # profiled back-to-back steps per variant with --breakdown
# preset name -> f(**overrides) -> its config, over every model family (tiny, llama3_8b,
# qwen3_moe_tiny, qwen3_30b_a3b, ...)
PRESETS = {name: family.presets[name] for name, family in families.presets().items()}
# The SiFAR paper's end-to-end decode (8x H200, CUDA 12.9, Llama-3.1-8B FP8, batch 1): tokens/s
# gain over NCCL with SiFAR, and with no all-reduce at all. None: not reported.
PAPER_SIFAR_GAIN = {2: 9.1, 4: 14.9, 8: 18.6}
PAPER_NO_ALLREDUCE_GAIN = {2: 18.0, 4: None, 8: 43.0}
CPU_NOTE = (
    "No GPUs here: these numbers come from XLA:CPU host devices (threads as ranks, shared host "
    "memory) and a tiny model. They show that the benchmark runs; they are not a performance result."
)


# ------------------------------------------------------------------ settings --
def _ints(text: str) -> list[int]:
    return [int(v) for v in str(text).replace(",", " ").split()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m bench.decode",
        description="Time per output token of the Llama decoder with psum / sifar / identity, "
                    "in every decode loop, over batch sizes and KV lengths.",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model shapes, any family's (default: llama3_8b on GPU, tiny on CPU)")
    p.add_argument("--moe-impl", choices=MOE_IMPLS, default=None,
                   help="an MoE preset's expert computation (models.qwen3_moe; default: the "
                        "preset's)")
    p.add_argument("--dtype", default=None,
                   help="parameter/activation dtype (default: bfloat16 on GPU, the preset's on CPU)")
    p.add_argument("--allreduce", default="psum,sifar,identity",
                   help="comma list of psum, sifar (algorithm auto), identity, sifar:<algorithm>, "
                        "sifar_buffers[:<algorithm>] (explicit dual buffers in the decode state)")
    p.add_argument("--algorithms", default="",
                   help="comma list of sifar algorithms, each one more row 'sifar:<alg>'")
    p.add_argument("--baselines", default=",".join(BASELINE_ALGORITHMS),
                   help="sifar algorithms whose in-decoder rows 'sifar:<alg>' are the baseline: "
                        "the fastest of them at each point is named 'baseline' beside lax.psum "
                        f"(default: {','.join(BASELINE_ALGORITHMS)}, the paper's baseline; "
                        "'none': no baseline rows)")
    p.add_argument("--fused", choices=("auto", "on", "off"), default="auto",
                   help="one more row: sifar fused with the residual add and RMSNorm (auto: when "
                        "sifar_jax.psum_add_rmsnorm exists; on: required, and at TP=1 too, where "
                        "the fused call is a residual add + RMSNorm kernel of ours in place of "
                        "XLA's add, reduce and multiply fusions)")
    p.add_argument("--prefetch-mib", nargs="+", type=float, default=None,
                   help="one more fused row per size 'sifar+fused:pf<MiB>': the fused call "
                        "prefetching that much of the next matmul's weight into L2 (0: none); "
                        "the plain sifar+fused row uses sifar_jax's default")
    p.add_argument("--sweep-all-variants", "--fused-sweep", dest="sweep_all", action="store_true",
                   help="time the fused and the baseline rows at every sweep point too (default: "
                        "only at the loops' point)")
    p.add_argument("--breakdown", action="store_true",
                   help="GPUs: per variant, at the loops' point, a device trace of "
                        f"{BREAKDOWN_STEPS} steps split into matmul / attention / all-reduce / "
                        "other / idle microseconds (bench.probes.step_kernels), in the records; "
                        "skipped with a note on a CPU")
    p.add_argument("--tp", nargs="+", default=None,
                   help="TP sizes, run in that order (default: every power of two up to the "
                        "device count, largest first, then 1; on CPU: 2 1)")
    p.add_argument("--loops", default=",".join(LOOPS),
                   help=f"loops timed at batch 1 and the first context (default: all: {','.join(LOOPS)})")
    p.add_argument("--batch", nargs="+", default=None,
                   help="sweep batch sizes (default: 1 2 4 8; --quick: 1 2)")
    p.add_argument("--context", nargs="+", default=None,
                   help="sweep KV lengths, each a power of two >= 64 (default: 1024 4096 16384; "
                        "--quick: 256 512); the first is the loops' context")
    p.add_argument("--sweep-loops", default="pipelined", help="loops timed in the sweep")
    p.add_argument("--no-sweep", action="store_true", help="time the loops only")
    p.add_argument("--tokens", type=int, default=None,
                   help="timed steps of sync, stream and on_device (at least 4 chunks) "
                        "(default 128; 16 with --quick)")
    p.add_argument("--samples", type=int, default=None,
                   help="pipelined samples (default 6; 2 with --quick)")
    p.add_argument("--chunk", type=int, default=16, help="on_device tokens per dispatch")
    p.add_argument("--in-flight", type=int, default=2, help="stream: steps dispatched ahead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-layout", choices=("auto", *sorted(KV_LAYOUTS)), default="auto",
                   help="KV cache layout (auto: sharding.default_kv_layout, bhsd on GPUs)")
    p.add_argument("--gemm-rows", type=int, default=None,
                   help="DecodeOptions(gemm_rows=): the rows a batch-1 step's projections run with "
                        "(default: models.options.default_gemm_rows, 2 on GPUs)")
    p.add_argument("--attn-impl", choices=ATTN_IMPLS, default=None,
                   help="DecodeOptions(attn_impl=): how a step of one token attends (default: "
                        "models.options.default_attn_impl, JAX's Pallas decode kernel on GPUs)")
    p.add_argument("--no-trace", action="store_true",
                   help="skip the per-call all-reduce trace of the sifar variants")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (CPU, CI)")
    p.add_argument("--out", default=None,
                   help="results directory (default: bench/results on GPUs, bench/results/local "
                        "on a CPU)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--ttft", nargs="?", const="default", default=None, metavar="LENGTHS",
                   help="also time to first token per variant for prompts of these lengths "
                        "(comma list; alone: 128,1024,4096 on GPUs, 16,64 on a CPU), beside "
                        "the prefill's floor (bench/ttft.py): ttft-<host>.{json,md}")
    p.add_argument("--ttft-only", action="store_true",
                   help="only the time to first token (--ttft), not the decode loops")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not use JAX's persistent compilation cache (models/compile_cache.py: "
                        "on by default; SIFAR_JAX_NO_COMPILE_CACHE=1 also turns it off)")
    return p.parse_args(argv)


def _baseline_algorithms(args) -> list[str]:
    return [a.strip() for a in args.baselines.split(",") if a.strip() and a.strip() != "none"]


def baseline_labels(args) -> list[str]:
    """The rows whose fastest is the baseline: 'sifar:<alg>' per --baselines; none without the
    extension (a run of psum and identity alone)."""
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
    """[(label, kind, algorithm, fused[, prefetch_bytes])]: ("psum", "psum", "auto", False),
    ("sifar:oneshot", "sifar", "oneshot", False), ("sifar+fused", "sifar", "auto", True),
    ("sifar+fused:pf8", "sifar", "auto", True, 8 << 20). No prefetch_bytes: the default. The
    baseline rows (--baselines) come right after psum."""
    items = [a.strip() for a in args.allreduce.split(",") if a.strip()]
    items += [f"sifar:{a.strip()}" for a in args.algorithms.split(",") if a.strip()]
    base = baseline_labels(args)
    at = items.index("psum") + 1 if "psum" in items else 0
    items[at:at] = [b for b in base if b not in items]
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
        for k, mib in enumerate(args.prefetch_mib or []):
            out.insert(at + 2 + k, (f"sifar+fused:pf{mib:g}", "sifar", "auto", True,
                                    int(mib * (1 << 20)) // 16 * 16))
    elif args.prefetch_mib:
        raise SystemExit("--prefetch-mib: needs the fused variant (sifar in --allreduce, "
                         "--fused not off)")
    return out


def prefetch_of(variant) -> int | None:
    """The fused call's prefetch_bytes (None: the library's default), or None unfused."""
    return variant[4] if len(variant) > 4 else None


def settings(args, platform: str, n_devices: int) -> dict:
    gpu = platform == "gpu"
    preset = args.preset or ("llama3_8b" if gpu and not args.quick else "tiny")
    config = PRESETS[preset]()
    dtype = args.dtype or ("bfloat16" if gpu else config.dtype)
    quick = args.quick or not gpu
    s = {
        "preset": preset,
        "dtype": dtype,
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
        "fused_tp1": args.fused == "on",
        "sweep_all": args.sweep_all,
        "baselines": None,  # below, from the variants
        "breakdown": args.breakdown and gpu,
        "trace": not args.no_trace,
        "loops": _loops(args.loops),
        "sweep_loops": [] if args.no_sweep else _loops(args.sweep_loops),
        "variants": parse_variants(args),
    }
    wanted = {f"sifar:{a}" for a in _baseline_algorithms(args)}
    s["baselines"] = [v[0] for v in s["variants"] if v[0] in wanted]
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
    if args.tp:
        tps = _ints(" ".join(args.tp))
    elif jax.process_count() > 1:
        tps = [n_devices]  # every process's GPUs in one mesh
    else:
        tps = sorted(common.powers_of_two_up_to(n_devices) if gpu else [2], reverse=True) + [1]
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
    s["tp"] = list(dict.fromkeys(tps))
    return s


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


def cases(s) -> list[tuple[int, int, int, tuple, list[str]]]:
    """[(tp, batch, context, variant, loops)]: the loops at batch 1 and the first context, the
    sweep elsewhere (and its loops added at that point). TP=1 runs only lax.psum (and the fused
    rows with --fused on: one rank's add + RMSNorm kernel); the fused and
    the baseline rows only at the loops' point unless --sweep-all-variants (the sweep compares
    psum, sifar and identity, and each variant costs a compile per point)."""
    base = (1, s["context"][0])
    points = [base] + [(b, c) for c in s["context"] for b in s["batch"] if (b, c) != base]
    out = []
    for tp in s["tp"]:
        variants = s["variants"] if tp > 1 else [("psum", "psum", "auto", False)] + (
            [v for v in s["variants"] if v[3]] if s.get("fused_tp1") else [])
        for b, c in points:
            loops = s["loops"] + [x for x in s["sweep_loops"] if x not in s["loops"]] \
                if (b, c) == base else s["sweep_loops"]
            here = [v for v in variants if (b, c) == base or s["sweep_all"]
                    or not (v[3] or v[0] in s["baselines"])]
            if loops:
                out += [(tp, b, c, v, loops) for v in here]
    return out


# -------------------------------------------------------------- weights, KV --
def streamed_bytes_per_rank(config, params, tp: int) -> int:
    """Parameter bytes one rank reads per batch-1 decode step (ModelFamily.step_weight_bytes):
    every parameter's local shard, an MoE's experts only the top-k of them, the embedding table
    one row (plus, when tied, its vocab/tp slice as the lm_head). `params` (unused) is the
    tree whose shapes the family's tp layout gives."""
    family = families.family_of(config)
    return family.step_weight_bytes(family.layout(config, tp))


def floor_ms(weights_bytes: int, kv_bytes: int) -> float:
    """A step's memory floor: its weights and KV cache read once at HBM_BYTES_PER_S (the same
    formula on a CPU, where it means nothing)."""
    return (weights_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e3


def kv_cache_bytes_per_rank(config, context: int, tp: int, batch: int = 1) -> int:
    """K and V of every layer over `context` positions: what attention reads per step."""
    itemsize = np.dtype(jax.numpy.dtype(config.dtype)).itemsize
    heads = families.family_of(config).layout(config, tp).shapes.num_kv_heads // tp
    return 2 * config.num_layers * batch * context * heads * config.head_dim * itemsize


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


# ------------------------------------------------------------------- set-up --
def make_decoder(config, mesh, params, variant, batch: int, context: int, seed: int,
                 kv_layout: str | None = None,
                 gemm_rows: int | None = None, attn_impl: str | None = None,
                 pack_params: bool | None = None):
    """A Decoder whose cache of `context` positions is filled with random values. sifar's slot
    is widened where a step's payload (batch x hidden) would not fit the default."""
    _, kind, alg, fused = variant[:4]
    slot = None
    if kind in SIFAR_KINDS:
        import sifar_jax

        payload = batch * config.hidden_size * np.dtype(jax.numpy.dtype(config.dtype)).itemsize
        slot = payload if payload > sifar_jax.DEFAULT_SLOT_BYTES else None
    options = DecodeOptions(allreduce=kind, algorithm=alg, fused=fused, slot_bytes=slot,
                            kv_layout=kv_layout, prefetch_bytes=prefetch_of(variant),
                            gemm_rows=gemm_rows, attn_impl=attn_impl,
                            pack_params=True if pack_params is None else pack_params)
    dec = Decoder(config, mesh, params, options, batch_size=batch, max_seq_len=context)
    dec.reset(context)
    dec.randomize_cache(seed)
    return dec


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
    """chunk tokens per dispatch, streamed: gaps between chunk arrivals / chunk (the first
    chunk, which compiles, untimed)."""
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
    """What the fused call prefetches (resolved default), None for unfused variants."""
    if not variant[3]:
        return None
    if prefetch_of(variant) is not None:
        return prefetch_of(variant)
    import sifar_jax.fused

    return sifar_jax.fused.DEFAULT_PREFETCH_BYTES


def make_record(variant, loop: str, tp: int, batch: int, context: int, s, seconds,
                tokens, extra: dict) -> dict:
    label, kind, alg, fused = variant[:4]
    ms = [t * 1e3 for t in seconds]
    med = statistics.median(ms)
    rec = {
        "allreduce": label,
        "tp": tp,
        "loop": loop,
        "fused": bool(fused),
        "prefetch_bytes": _prefetch_bytes(variant),
        "batch": batch,
        "context": context,
        "tpot_ms_median": round(med, 4),
        "tpot_ms_p99": round(common.percentile(ms, 99), 4),
        "tokens_per_s": round(batch * 1e3 / med, 2),
        "tpot_samples": len(ms),
        "kind": kind,
        "algorithm": alg,
        "preset": s["preset"],
        "moe_impl": getattr(s["config"], "moe_impl", None),
        "dtype": s["dtype"],
        "start_position": context - steps_needed(loop, s) - 1,
        "steps": steps_needed(loop, s),
        "generated": [int(t[0]) for t in tokens],  # sequence 0
    }
    if loop in ("sync", "stream"):
        rec.update({f"tpot_ms_p{q:g}".replace(".", "_"): round(common.percentile(ms, q), 4)
                    for q in TAIL})
    rec.update(extra)
    if rec.get("floor_ms"):
        rec["floor_ratio"] = round(med / rec["floor_ms"], 3)  # TPOT over the memory floor
    return rec


def sifar_fields(before) -> dict:
    """Counters and check() over one variant (all its loops)."""
    import sifar_jax

    delta = _counter_delta(before, _sifar_counters())
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


def run_variant(config, mesh, params, case, s, bar) -> list[dict]:
    """Set up one variant at one (batch, context), time each of its loops, one record each."""
    tp, batch, context, variant, loops = case
    label, kind = variant[0], variant[1]
    where = f"TP={tp} b={batch} ctx={context} {label}"
    before = _sifar_counters() if kind in SIFAR_KINDS else None
    t0 = time.perf_counter()
    bar.set_postfix_str(f"{where}: set-up")
    dec = make_decoder(config, mesh, params, variant, batch, context, s["seed"], s["kv_layout"],
                       s.get("gemm_rows"), s.get("attn_impl"))
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
    breakdown = None
    if s["breakdown"] and (batch, context) == (1, s["context"][0]):
        bar.set_postfix_str(f"{where}: breakdown")
        breakdown = step_breakdown(dec, context, first)
    weights = streamed_bytes_per_rank(config, params, tp)
    kv = kv_cache_bytes_per_rank(config, context, tp, batch)
    common_fields = {"setup_s": round(setup_s, 2), "kv_layout": dec.kv_layout, "rows": dec.rows,
                     "gemm_rows": dec.gemm_rows, "attn_impl": dec.attn_impl,
                     "pack_params": dec.pack_params, "arrays_per_call": len(dec.weights.leaves),
                     "weights_bytes_per_rank": weights, "kv_bytes_per_rank": kv,
                     "floor_ms": float(f"{floor_ms(weights, kv):.4g}")}
    if kind in SIFAR_KINDS:
        common_fields.update(sifar_fields(before))
    if trace is not None:
        common_fields["allreduce_trace"] = trace
    if breakdown is not None:
        common_fields["breakdown"] = breakdown
    del dec
    return [make_record(variant, loop, tp, batch, context, s, seconds, tokens,
                        dict(common_fields, loop_s=round(loop_s, 2), cache_copies=copies))
            for loop, seconds, tokens, loop_s, copies in timed]


TRACE_STEPS = 48  # traced pipelined steps: 48 x 64 all-reduces (8B) stay within one trace ring


def step_breakdown(dec, context: int, first) -> dict:
    """BREAKDOWN_STEPS back-to-back steps traced on the device, their time split by kernel kind
    (bench.probes.step_kernels.step_breakdown), or {"error": why}."""
    from bench.probes import step_kernels

    try:
        dec.seek(context - BREAKDOWN_STEPS - 8, first)
        dec.advance(3)  # compiled and warm before the trace starts
        dec.token()
        return step_kernels.step_breakdown(dec, BREAKDOWN_STEPS)
    except Exception as e:  # noqa: BLE001 - recorded; the benchmark goes on
        return {"error": f"{type(e).__name__}: {e}"}


def trace_allreduces(dec, s, context: int, first) -> dict:
    """Per-call latency of the all-reduces inside TRACE_STEPS back-to-back decode steps, from the
    device's own timestamps (bench.calltrace.summarize), or {"error": why}."""
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
    """{"entry": n, "loop": n}: KV-cache copies in the optimised HLO of the executable this loop
    runs from here (compiling it now, as its first step would)."""
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
        params = common.block(families.family_of(config).random_params(config, mesh,
                                                                       seed=s["seed"]))
        used_sifar = False
        for case in mine:
            used_sifar |= case[3][1] in SIFAR_KINDS
            recs = run_variant(config, mesh, params, case, s, bar)
            records += recs
            for r in recs:
                if r["cache_copies"]:
                    bar.write(f"KV CACHE COPIED: TP={tp} {r['allreduce']} {r['loop']}: "
                              f"{r['cache_copies']} (copies per call / per loop iteration)")
            for r in recs:
                if r.get("sifar_check", "ok") != "ok":
                    bar.write(f"SIFAR CHECK FAILED: TP={tp} {r['allreduce']}: {r['sifar_check']}")
                    break
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
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _gain(t_ref: float, t_x: float) -> str:
    return f"{(t_ref / t_x - 1) * 100:+.1f}%"


def _gap(t_psum: float, t_identity: float, t_x: float) -> str:
    d = t_psum - t_identity
    if d <= 0:
        return "n/a (psum <= identity)"
    return f"{(t_psum - t_x) / d * 100:.0f}%"


def table_rows(records, order) -> tuple[list[str], list[list]]:
    """Every record (annotated by with_baseline): TP, loop, batch, context, variant, with the
    ratios against psum and the baseline, and to the memory floor."""
    idx = _index(records)
    headers = ["TP", "loop", "batch", "context", "all-reduce", "TPOT median ms", "TPOT p99 ms",
               "tokens/s", "vs psum", "vs baseline", "x floor", "gap recovered", "retries/call",
               "same tokens as psum"]
    rows = []
    for r in sorted(records, key=lambda r: (r["tp"], LOOPS.index(r["loop"]), r["batch"],
                                            r["context"], _order(order, r["allreduce"]))):
        ps, ident = idx.get((*_key(r), "psum")), idx.get((*_key(r), "identity"))
        vs = f"{ps['tpot_ms_median'] / r['tpot_ms_median']:.3f}x" if ps else "-"
        gap = "-"
        if r["kind"] in SIFAR_KINDS and ps and ident:
            gap = _gap(ps["tpot_ms_median"], ident["tpot_ms_median"], r["tpot_ms_median"])
        rpc = r.get("retries_per_call")
        match = "-"
        if ps and r is not ps:
            match = f"{_prefix_match(r['generated'], ps['generated'])}/{len(ps['generated'])}"
        rows.append([r["tp"], r["loop"], r["batch"], r["context"], _named(r),
                     f"{r['tpot_ms_median']:.3f}", f"{r['tpot_ms_p99']:.3f}",
                     f"{r['tokens_per_s']:.1f}", vs, _ratio(r.get("vs_baseline")),
                     _ratio(r.get("floor_ratio")), gap, "-" if rpc is None else f"{rpc:.4f}",
                     match])
    return headers, rows


def _order(order, label) -> int:
    return order.index(label) if label in order else len(order)


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}x"


def _named(r) -> str:
    """The record's variant, '(baseline)' after it where it is the baseline at its point."""
    return r["allreduce"] + (" (baseline)" if r.get("baseline") == r["allreduce"] else "")


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
    """Copies of the records, each with "baseline": the label of the fastest baseline row at its
    (TP, loop, batch, context), None where no baseline row ran; "vs_baseline": its tokens/s over
    the baseline's (> 1: faster)."""
    best = baselines(records, s)
    out = []
    for r in records:
        b = best.get(_key(r))
        out.append(dict(r, baseline=b["allreduce"] if b else None,
                        vs_baseline=round(b["tpot_ms_median"] / r["tpot_ms_median"], 4)
                        if b else None))
    return out


def floor_rows(records, s) -> tuple[list[str], list[list]]:
    """Batch 1, the loops' context, every loop and variant (records annotated by
    with_baseline): TPOT against the memory floor, lax.psum and the baseline."""
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
    from bench.probes import step_kernels

    headers = (["TP", "all-reduce"] + [k.replace("_", "-") + " us" for k in step_kernels.BREAKDOWN]
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
                    + [f"{b[f'{k}_us']:.1f}" for k in step_kernels.BREAKDOWN]
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
    """The paper's kind of table: sifar's tokens/s gain over psum per batch (rows) and KV length
    (columns); each cell 'sifar (fused) [identity]'."""
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


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def budget_lines(records, s) -> list[str]:
    """Per TP, pipelined, batch 1: psum TPOT = weights streamed (at the assumed bandwidth) +
    all-reduce share (psum - identity) + the rest."""
    idx = _index(records)
    ctx = s["context"][0]
    out = []
    ref = idx.get((1, "pipelined", 1, ctx, "psum"))
    for tp in sorted({r["tp"] for r in records}):
        ps = idx.get((tp, "pipelined", 1, ctx, "psum"))
        ident = idx.get((tp, "pipelined", 1, ctx, "identity"))
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
    return (f"{s['preset']} ({c.num_layers} layers, hidden {c.hidden_size}{moe}, {s['dtype']}), "
            f"random weights and KV cache; loops {','.join(s['loops'])} at batch 1, KV length "
            f"{s['context'][0]}; sweep ({','.join(s['sweep_loops']) or 'none'}) batch "
            f"{s['batch']} x KV length {s['context']}; {s['tokens']} timed steps (sync, stream, "
            f"on_device), {s['samples']} pipelined samples, on_device {s['chunk']} tokens per "
            f"dispatch, stream {s['in_flight']} steps in flight")


def out_dir(args, platform: str) -> Path:
    """GPU results go where they are committed; a CPU demo into a git-ignored directory."""
    return Path(args.out) if args.out else common.default_out(platform)


BREAKDOWN_SKIPPED = ("--breakdown: skipped, a CPU run has no device trace of GPU kernels to "
                     "break down")


def floor_note(s) -> str:
    floor = (f"Floor: a step's weights and KV cache (per rank) read once at "
             f"{HBM_BYTES_PER_S / 1e12:g} TB/s (floor_ms; x floor = TPOT / floor_ms, floor_ratio "
             "in the JSON). ")
    if not s["baselines"]:
        return floor + "Baseline: none (no in-decoder one-shot or two-shot row ran)."
    return floor + (f"Baseline: the fastest of the in-decoder rows {' or '.join(s['baselines'])} "
                    "at the same TP, loop, batch and KV length (the paper's baseline, the better "
                    "of a one-shot and a two-shot all-reduce, given every decoder improvement ours "
                    "gets); vs baseline: tokens/s over the baseline's.")


METHOD_NOTE = (
    "TPOT per loop (tokens/s = batch / TPOT): sync, the median of one step followed by reading "
    "its token; stream, the median gap between consecutive tokens of Decoder.decode(loop="
    "'stream'); pipelined, steps dispatched back to back with the tokens read once at the end, from "
    f"the difference of runs of {PIPELINE_STEPS[1]} and {PIPELINE_STEPS[0]} steps (the device-bound "
    "step time); on_device, the median gap between chunks of K tokens run in one lax.fori_loop "
    "dispatch, / K. vs psum: tokens/s relative to lax.psum at the same TP, loop, batch and KV "
    "length. Gap recovered: (t_psum - t_x) / (t_psum - t_identity), the share of the all-reduce "
    "cost removed (identity = no all-reduce: wrong numbers, the upper bound of an unfused model). "
    "Attention runs over exactly the KV length (one bucket), filled between "
    "KV length - steps and KV length. Same tokens as psum: generated tokens (sequence 0) equal to "
    "lax.psum's before the first difference (bf16 rounding of another summation order may flip an "
    "argmax; identity differs at once).")


def write_outputs(args, s, env, records, platform, final: bool):
    host = env["host"]
    order = label_order(s)
    d = out_dir(args, platform)
    records = with_baseline(records, s)
    json_path = common.write_json(common.results_path(d, "decode", host, ".json"), records)
    notes = [CPU_NOTE] if platform == "cpu" else []
    notes += [describe_run(s) + ".", METHOD_NOTE, floor_note(s)]
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
                 "The optimised HLO of every timed executable updates the KV cache in place: no "
                 "copy per call, none per on-device loop iteration (models.hlo.cache_copies).")
    sections = []
    headers, rows = paper_rows(records, s)
    if rows:
        sections.append(("Against the paper: batch 1, KV length "
                         f"{s['context'][0]} (paper: 8x H200, Llama-3.1-8B FP8, SiFAR vs NCCL)",
                         common.markdown_table(headers, rows)))
    headers, rows = floor_rows(records, s)
    if rows:
        sections.append((f"Memory floor, lax.psum and the baseline: batch 1, KV length "
                         f"{s['context'][0]}", common.markdown_table(headers, rows)))
    for tp in sorted({r["tp"] for r in records if r["tp"] > 1}):
        for loop in s["sweep_loops"]:
            grid = sweep_grid(records, s, tp, loop)
            if grid:
                sections.append((f"Sweep, TP={tp}, {loop}: tokens/s gain over lax.psum",
                                 common.markdown_table(*grid)))
    headers, rows = tail_rows(records)
    if rows:
        sections.append(("Tail of the per-step time (batch 1)", common.markdown_table(headers, rows)))
    headers, rows = allreduce_tail_rows(records)
    if rows:
        sections.append(("sifar all-reduces inside the decode step: per-call latency from device "
                         f"timestamps ({TRACE_STEPS} back-to-back steps, every rank, block 0's view)",
                         common.markdown_table(headers, rows)))
    headers, rows = breakdown_rows(records)
    if rows:
        sections.append((f"Where a step's device time goes: {BREAKDOWN_STEPS} back-to-back steps "
                         "traced (batch 1, the loops' KV length; microseconds per step)",
                         common.markdown_table(headers, rows)))
    budget = budget_lines(records, s)
    if budget:
        sections.append((f"Per-token budget, pipelined, batch 1 (assumed HBM bandwidth "
                         f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s)", "\n".join(f"- {b}" for b in budget)))
    sections.append(("Every record", common.markdown_table(*table_rows(records, order))))
    sifar_rows = [[r["allreduce"], r["tp"], r["batch"], r["context"], r.get("algorithm_used") or "-",
                   " ".join(f"{a}: {v.get('calls', 0)} calls, {v.get('retries', 0)} retries, "
                            f"{v.get('timeouts', 0)} timeouts"
                            for a, v in r.get("sifar_stats", {}).items()) or "-",
                   r.get("sifar_check", "-")]
                  for r in records if r["kind"] in SIFAR_KINDS and r["loop"] == _first_loop(r, records)]
    if sifar_rows:
        sections.append(("sifar_jax.stats() per variant (all its loops; calls once per rank, "
                         "retries per warp on GPUs)",
                         common.markdown_table(["all-reduce", "TP", "batch", "KV length",
                                                "algorithm used", "counters", "check"], sifar_rows)))
    md_path = common.write_markdown(common.results_path(d, "decode", host, ".md"),
                                    f"Decode TPOT on {host}", env, sections, notes)
    png_path = None
    if final and not args.no_plot and records:
        png_path = plot(records, order, common.results_path(d, "decode", host, ".png"), host,
                        platform, s)
    return json_path, md_path, png_path


def _first_loop(r, records) -> str:
    """The first loop recorded for r's variant and point (one stats row per variant)."""
    return next(x["loop"] for x in records
                if (x["tp"], x["batch"], x["context"], x["allreduce"])
                == (r["tp"], r["batch"], r["context"], r["allreduce"]))


def plot(records, order, path, host, platform, s):
    plt = common.pyplot()
    if plt is None:
        return None

    idx = _index(records)
    ctx = s["context"][0]
    tps = sorted({r["tp"] for r in records})
    labels = [o for o in dict.fromkeys(order) if any(r["allreduce"] == o for r in records)]
    loops = [x for x in LOOPS if any(r["loop"] == x for r in records)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    groups = [(tp, loop) for tp in tps for loop in loops
              if any(idx.get((tp, loop, 1, ctx, lb)) for lb in labels)]
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        xs, ys = [], []
        for j, (tp, loop) in enumerate(groups):
            r = idx.get((tp, loop, 1, ctx, label))
            if r is not None:
                xs.append(j + (i - (len(labels) - 1) / 2) * width)
                ys.append(r["tokens_per_s"])
        if xs:
            bars = ax.bar(xs, ys, width, label=label, hatch="//" if label == "identity" else None)
            ax.bar_label(bars, fmt="%.0f", fontsize=6, rotation=90, padding=2)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"TP={tp}\n{loop}" for tp, loop in groups], fontsize=7)
    ax.set_ylabel("tokens/s (batch 1)")
    ax.set_title(f"every loop, batch 1, KV length {ctx}")
    ax.margins(y=0.15)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[1]
    top = max(tps)
    loop = s["sweep_loops"][0] if s["sweep_loops"] else "pipelined"
    for b in s["batch"]:
        xs, ys = [], []
        for c in s["context"]:
            ps, sf = idx.get((top, loop, b, c, "psum")), idx.get((top, loop, b, c, "sifar"))
            if ps and sf:
                xs.append(c)
                ys.append((ps["tpot_ms_median"] / sf["tpot_ms_median"] - 1) * 100)
        if xs:
            ax.plot(xs, ys, marker="o", label=f"batch {b}")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(s["context"], [str(c) for c in s["context"]])
    ax.set_xlabel("KV length")
    ax.set_ylabel("sifar tokens/s gain over lax.psum (%)")
    ax.set_title(f"sweep, TP={top}, {loop}")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    title = f"Decode, {s['preset']} {s['dtype']}, {host}"
    if platform == "cpu":
        title += " (XLA:CPU smoke test, not GPU performance)"
    return common.save_figure(fig, title, path)


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

    print()
    print(f"[{env['host']}] {describe_run(s)}")
    records = with_baseline(records, s)
    headers, rows = paper_rows(records, s)
    if rows:
        print(common.plain_table(headers, rows))
        print()
    headers, rows = floor_rows(records, s)
    if rows:
        print(f"Batch 1 against the memory floor (weights and KV cache per rank read once at "
              f"{HBM_BYTES_PER_S / 1e12:g} TB/s), lax.psum and the baseline "
              f"(the fastest of {', '.join(s['baselines']) or 'none'}):")
        print(common.plain_table(headers, rows))
        print()
    headers, rows = breakdown_rows(records)
    if rows:
        print(f"Where a step's device time goes ({BREAKDOWN_STEPS} steps traced, us per step):")
        print(common.plain_table(headers, rows))
        print()
    for line in budget_lines(records, s):
        print(line)
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
