"""bench.decode's flags (parse_args), read once into ONE frozen value (settings() -> Settings),
the variants it times (Variant: a label and the DecodeOptions it runs) and its cases."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Optional

import jax

import models
from bench import common, ttft
from bench.decode import model_api as api

PIPELINE_STEPS = (4, 20)  # back-to-back runs whose difference gives one pipelined TPOT sample
BASELINE_ALGORITHMS = ("oneshot", "twoshot")  # the paper's baseline, run inside our decoder
SHAPES = ("full", "tp2_rank")  # as the preset says, or one rank's share at TP=2 on one device
VIRTUAL_RANKS = (1, 2, 4)  # --virtual-ranks: the persistent step's ranks on one device
STEP_ALLREDUCES = ("sifar", "oneshot")  # --step-allreduce: the persistent rows at TP >= 2
PRESETS = {name: family.presets[name] for name, family in api.presets().items()}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of the tables: its label ("psum", "sifar:oneshot", "sifar+fused", "persistent",
    "persistent:oneshot") and the options it runs (the run's kv_layout, gemm_rows and attn_impl
    filled in)."""
    label: str
    options: models.DecodeOptions


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything the flags say, read once (settings())."""
    platform: str
    preset: str
    config: Any  # the model the run times: dtype, --shapes, --moe-impl, max_seq_len applied
    shapes: str
    dtype: str
    quantize: Optional[str]  # "fp8": the projections quantized to e4m3 per channel
    to_rows: bool  # dense projections held as [N, K] rows (models.to_rows)
    options: models.DecodeOptions  # what every variant shares: kv_layout, gemm_rows, attn_impl
    tp: tuple[int, ...]
    variants: tuple[Variant, ...]
    baselines: tuple[str, ...]  # labels of the baseline rows
    batch: tuple[int, ...]
    context: tuple[int, ...]
    loops: tuple[str, ...]
    sweep_loops: tuple[str, ...]
    tokens: int
    samples: int
    chunk: int
    in_flight: int
    seed: int
    step: str  # "xla", "persistent" or "both" (the persistent rows: batch 1, every TP)
    fused_tp1: bool
    sweep_all: bool
    breakdown: bool
    breakdown_asked: bool
    trace: bool
    ttft: tuple[int, ...]  # prompt lengths (): no TTFT
    ttft_only: bool
    virtual_ranks: tuple[int, ...]  # (): none
    out: Optional[str]
    compile_cache: bool
    warmup: int = 2
    step_allreduces: tuple[str, ...] = STEP_ALLREDUCES  # the persistent rows' at TP >= 2

    @property
    def gpu(self) -> bool:
        return self.platform == "gpu"

    @property
    def weights(self) -> str:
        """Each record's "weights": "fp8", else the dtype's name."""
        return "fp8" if self.quantize else self.dtype

    @property
    def stem(self) -> str:
        """The results' file stem: FP8 and rows runs side by side with the dense ones."""
        return "decode-fp8" if self.quantize else "decode-rows" if self.to_rows else "decode"

    def chunks(self) -> int:
        """on_device dispatches: the first (it compiles) and the gap after it are not timed."""
        return max(4, self.tokens // self.chunk) + 2

    def steps_needed(self, loop: str) -> int:
        """Decode steps one timed loop runs (its start position is context - this - 1)."""
        return {"sync": self.warmup + self.tokens, "stream": self.warmup + self.tokens,
                "pipelined": self.warmup + self.samples * sum(PIPELINE_STEPS),
                "on_device": self.chunk * self.chunks()}[loop]


# ---------------------------------------------------------------------- flags --
def _ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in " ".join(map(str, values)).replace(",", " ").split())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.decode",
                                description="Time per output token of the decoder with psum / "
                                            "sifar / identity, every loop, batch x KV length "
                                            "(docs/reference.md).",
                                epilog="Deprecated spellings, still read: --weights fp8 = "
                                       "--quantize fp8; --weights rows = --to-rows; --weights "
                                       "bf16 = the default.")
    add = p.add_argument
    add("--preset", choices=sorted(PRESETS), default=None,
        help="model shapes, any family's (default: llama3_8b on GPU, tiny on CPU)")
    add("--shapes", choices=SHAPES, default="full",
        help="tp2_rank: one rank's share of TP=2 (half the heads, MLP and vocabulary) as a model "
             "on one device, TP=1, no all-reduce")
    add("--moe-impl", choices=api.MOE_IMPLS, default=None, help="an MoE preset's expert computation")
    add("--dtype", default=None, help="default: bfloat16 on GPU, the preset's on CPU")
    add("--quantize", choices=("fp8",), default=None,
        help="fp8: the projections quantized to e4m3 per channel (as models.generate --quantize)")
    add("--to-rows", action="store_true",
        help="dense projections held as [N, K] rows (models.to_rows), the layout the persistent "
             "step streams, which the XLA step reads too (default: the einsum layout)")
    add("--weights", choices=("bf16", "rows", "fp8"), default=None,
        help=argparse.SUPPRESS)  # deprecated: fp8 is --quantize fp8, rows is --to-rows
    add("--allreduce", default="psum,sifar,identity",
        help="comma list of psum, sifar, identity, sifar:<algorithm>, sifar_buffers[:<algorithm>]")
    add("--baselines", default=",".join(BASELINE_ALGORITHMS),
        help="sifar algorithms whose rows 'sifar:<alg>' make the baseline ('none': no rows)")
    add("--fused", choices=("auto", "on", "off"), default="auto",
        help="the sifar+fused row (auto: where the library has it; on: also at TP=1)")
    add("--sweep-all-variants", dest="sweep_all", action="store_true",
        help="the fused and baseline rows at every sweep point too")
    add("--breakdown", action="store_true",
        help="GPUs: steps traced per variant, device time by kernel kind")
    add("--tp", nargs="+", default=None,
        help="TP sizes in order (default: powers of two up to the devices, then 1; CPU: 2 1)")
    add("--loops", default=",".join(models.LOOPS), help="loops at batch 1 and the first context")
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
    add("--kv-layout", choices=("auto", *sorted(api.KV_LAYOUTS)), default="auto")
    add("--gemm-rows", type=int, default=None, help="DecodeOptions(gemm_rows=)")
    add("--attn-impl", choices=api.ATTN_IMPLS, default=None, help="DecodeOptions(attn_impl=)")
    add("--step", choices=("xla", "persistent", "both"), default="xla",
        help="batch 1, every TP: DecodeOptions(step=) of the rows (xla: the XLA decoders' rows; "
             "persistent: the persistent step's rows only; both: them beside the XLA rows). "
             "The persistent rows: 'persistent' (at TP >= 2 sifar inside) and "
             "'persistent:<all-reduce>' for the others of --step-allreduce; where the step "
             "cannot serve the model the row is not run and the log says why")
    add("--step-allreduce", default=",".join(STEP_ALLREDUCES),
        help="comma list of the all-reduces inside the persistent step at TP >= 2 (sifar, "
             "oneshot): one row each (DecodeOptions(step_allreduce=))")
    add("--virtual-ranks", nargs="?", const=",".join(map(str, VIRTUAL_RANKS)), default=None,
        metavar="R", help="also time the persistent step at R virtual ranks on one device (default "
                          "1,2,4) with sifar and oneshot inside: the cost per all-reduce phase "
                          "(weights it streams: --quantize fp8 or --to-rows)")
    add("--no-trace", action="store_true", help="skip the per-call all-reduce trace")
    add("--quick", action="store_true", help="tiny model, few steps (CPU, CI)")
    add("--out", default=None, help="results directory")
    add("--ttft", nargs="?", const="default", default=None, metavar="LENGTHS",
        help="also time to first token per variant (default 128,1024,4096; CPU 16,64)")
    add("--ttft-only", action="store_true", help="only the time to first token")
    add("--no-compile-cache", action="store_true", help="no persistent compilation cache")
    args = p.parse_args(argv)
    if args.weights:  # the old spelling: one flag for what are two choices now
        print(f"NOTE: --weights {args.weights} is deprecated: "
              + {"fp8": "--quantize fp8", "rows": "--to-rows", "bf16": "the default"}[args.weights],
              file=sys.stderr)
        args.quantize = args.quantize or ("fp8" if args.weights == "fp8" else None)
        args.to_rows = args.to_rows or args.weights == "rows"
    return args


# ------------------------------------------------------------------ variants --
def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip() and v.strip() != "none"]


def baseline_labels(args) -> list[str]:
    """'sifar:<alg>' per --baselines; none without the extension (psum and identity alone)."""
    algs = _names(args.baselines)
    if not algs:
        return []
    try:
        import sifar_jax  # noqa: F401
    except ImportError:
        print("NOTE: no sifar_jax extension: no baseline rows", flush=True)
        return []
    return [f"sifar:{a}" for a in algs]


def _variant(item: str, base: models.DecodeOptions) -> Variant:
    kind, _, alg = item.partition(":")
    alg = alg or "auto"
    if kind not in api.ALLREDUCE_KINDS:
        raise SystemExit(f"unknown all-reduce {kind!r}; choose from {api.ALLREDUCE_KINDS}")
    if kind not in api.SIFAR_KINDS and alg != "auto":
        raise SystemExit(f"{item!r}: only {' and '.join(api.SIFAR_KINDS)} take an algorithm")
    if kind in api.SIFAR_KINDS:
        import sifar_jax

        try:
            sifar_jax.algorithms.validate(alg)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    return Variant(kind if alg == "auto" else f"{kind}:{alg}",
                   base.replace(allreduce=kind, algorithm=alg))


def parse_variants(args, base: models.DecodeOptions) -> list[Variant]:
    """psum, the baseline rows right after it, the --allreduce rest, "sifar+fused" after
    "sifar" (--fused), each once; each runs `base` with its all-reduce."""
    items = _names(args.allreduce)
    at = items.index("psum") + 1 if "psum" in items else 0
    items[at:at] = [b for b in baseline_labels(args) if b not in items]
    out: dict[str, Variant] = {}
    for v in (_variant(item, base) for item in items):
        out.setdefault(v.label, v)
    out = list(out.values())
    missing = api.fused_add_norm_available()
    if args.fused == "on" and missing:
        raise SystemExit(f"--fused on: {missing}")
    labels = [v.label for v in out]
    if args.fused != "off" and not missing and "sifar" in labels:
        fused = base.replace(allreduce="sifar", fused=True)
        out.insert(labels.index("sifar") + 1, Variant("sifar+fused", fused))
    return out


# ------------------------------------------------------------------- settings --
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


def _loops(text: str) -> tuple[str, ...]:
    loops = tuple(_names(text))
    for loop in loops:
        if loop not in models.LOOPS:
            raise SystemExit(f"unknown loop {loop!r}; choose from {models.LOOPS}")
    return loops


def _config(args, preset: str, dtype: str, context) -> Any:
    config = PRESETS[preset]()
    if args.shapes == "tp2_rank":
        config = tp2_rank_config(config)
    config = config.replace(dtype=dtype, max_seq_len=max(context))
    if args.moe_impl:
        if not hasattr(config, "moe_impl"):
            raise SystemExit(f"--moe-impl: {preset} is not an MoE")
        config = config.replace(moe_impl=args.moe_impl)
    return config


def _checked(s: Settings) -> Settings:
    """s, or SystemExit for what the flags cannot do together."""
    if (s.quantize or s.to_rows) and s.ttft:
        what = "--quantize fp8" if s.quantize else "--to-rows"
        raise SystemExit(f"--ttft runs dense weights only (bench/ttft.py): not with {what}")
    if s.quantize and s.to_rows:
        raise SystemExit("--to-rows holds dense weights as rows; FP8 projections are rows already")
    need = max(s.steps_needed(loop) for loop in set(s.loops) | set(s.sweep_loops))
    for c in s.context:
        if c < 64 or c & (c - 1):
            raise SystemExit(f"--context {c}: must be a power of two >= 64 (one attention bucket)")
        if need >= c // 2:
            raise SystemExit(f"--context {c}: the loops need {need} steps, which must stay in the "
                             f"top half of the context; raise --context or lower --tokens/--samples")
    return s


def settings(args, platform: str, n_devices: int) -> Settings:
    gpu = platform == "gpu"
    quick = args.quick or not gpu
    preset = args.preset or ("llama3_8b" if gpu and not args.quick else "tiny")
    dtype = args.dtype or ("bfloat16" if gpu else PRESETS[preset]().dtype)
    context = _ints(args.context) if args.context else (256, 512) if quick else (1024, 4096, 16384)
    config = _config(args, preset, dtype, context)
    base = models.DecodeOptions(kv_layout=None if args.kv_layout == "auto" else args.kv_layout,
                                gemm_rows=args.gemm_rows, attn_impl=args.attn_impl, step="xla")
    variants = tuple(parse_variants(args, base))
    wanted = {f"sifar:{a}" for a in _names(args.baselines)}
    lengths = () if args.ttft is None and not args.ttft_only else ttft.parse_lengths(
        args.ttft or "default", platform)
    return _checked(Settings(
        platform=platform, preset=preset, config=config, shapes=args.shapes, dtype=dtype,
        quantize=args.quantize, to_rows=args.to_rows, options=base,
        tp=tuple(tp_sizes(args, config, platform, n_devices)), variants=variants,
        baselines=tuple(v.label for v in variants if v.label in wanted),
        batch=_ints(args.batch) if args.batch else (1, 2) if quick else (1, 2, 4, 8),
        context=context, loops=_loops(args.loops),
        sweep_loops=() if args.no_sweep else _loops(args.sweep_loops),
        tokens=args.tokens or (16 if quick else 128), samples=args.samples or (2 if quick else 6),
        chunk=args.chunk, in_flight=args.in_flight, seed=args.seed, step=args.step,
        fused_tp1=args.fused == "on", sweep_all=args.sweep_all,
        breakdown=args.breakdown and gpu, breakdown_asked=args.breakdown,
        trace=not args.no_trace, ttft=tuple(lengths), ttft_only=args.ttft_only,
        virtual_ranks=_ints([args.virtual_ranks]) if args.virtual_ranks else (),
        out=args.out, compile_cache=not args.no_compile_cache,
        step_allreduces=_step_allreduces(args.step_allreduce)))


def _step_allreduces(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(_names(text)))
    bad = [n for n in names if n not in STEP_ALLREDUCES]
    if bad or not names:
        raise SystemExit(f"--step-allreduce {text!r}: a comma list of {', '.join(STEP_ALLREDUCES)}")
    return names


def tp_sizes(args, config, platform: str, n_devices: int) -> list[int]:
    if args.tp:
        tps = list(_ints(args.tp))
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
            models.family_of(config).check_tp(config, t)
        except ValueError as e:
            raise SystemExit(f"--tp {t}: {e}") from None
    return list(dict.fromkeys(tps))


# ---------------------------------------------------------------------- cases --
def persistent_variants(s: Settings, tp: int) -> list[Variant]:
    """The persistent step's rows at `tp`: one ("persistent") at TP=1, one per
    --step-allreduce at TP >= 2 ("persistent" with sifar inside, "persistent:oneshot")."""
    opts = s.options.replace(step="persistent")
    if tp == 1:
        return [Variant("persistent", opts)]
    return [Variant("persistent" if a == "sifar" else f"persistent:{a}",
                    opts.replace(step_allreduce=a)) for a in s.step_allreduces]


def cases(s: Settings) -> list[tuple[int, int, int, Variant, tuple[str, ...]]]:
    """[(tp, batch, context, variant, loops)]: the loops at batch 1 and the first context, the
    sweep elsewhere. TP=1 runs lax.psum (and the fused rows with --fused on); the fused and
    baseline rows run at the loops' point only unless --sweep-all-variants; the persistent
    rows (--step, persistent_variants) at batch 1, every TP."""
    base = (1, s.context[0])
    points = [base] + [(b, c) for c in s.context for b in s.batch if (b, c) != base]
    out = []
    for tp in s.tp:
        variants = list(s.variants) if tp > 1 else [Variant("psum", s.options)] + [
            v for v in s.variants if s.fused_tp1 and v.options.fused]
        if s.step != "xla":
            variants = (variants if s.step == "both" else []) + persistent_variants(s, tp)
        for b, c in points:
            loops = s.loops + tuple(x for x in s.sweep_loops if x not in s.loops) \
                if (b, c) == base else s.sweep_loops
            here = [v for v in variants if ((b, c) == base or s.sweep_all
                    or not (v.options.fused or v.label in s.baselines))
                    and (b == 1 or v.options.step != "persistent")]
            if loops:
                out += [(tp, b, c, v, loops) for v in here]
    return out
