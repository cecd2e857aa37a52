"""Probe: where a decode step's device time goes, kernel by kernel, for each all-reduce variant.

The decoder with no all-reduce at all (identity) bounds every variant from below; issue 10 asks
the fused sifar decoder to reach it. This profiles a few back-to-back steps of each variant with
`jax.profiler` (CUPTI) and sums the device time of the kernels per step by kind (our all-reduce,
NCCL, matmuls, reductions, the rest), so the cost of the all-reduce shows next to the XLA kernels
it replaces (the fused call replaces the residual add and RMSNorm fusions).

Durations are the kernels' own device times. The span per step (first kernel's start to last
kernel's end, over the profiled steps) includes the gaps between kernels, which match a
command-buffer run only where XLA keeps command buffers while profiling
(`XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true`, where this XLA knows the
flag); the step time to quote comes from `bench.decode`.

The breakdown (`breakdown` in each variant's result; `bench.decode --breakdown` puts it in its
records) splits a step into matmul / attention / all-reduce / other / idle microseconds, each
kernel classified through the instruction of the step's optimised HLO that launched it
(`hlo_kinds`): all-reduce (our kernels, with the fused call's add and norm; NCCL's; XLA's
collectives, the sampler's all-gather of the vocabulary shards included), matmul (a dot or GEMM
that reads a model weight: the weight-streaming projections and the LM head), attention (reads
or writes the KV cache, or comes from an attention/RoPE function of the model's source: RoPE, the
cache update, scores, softmax, the value matmul), other (norms, residual adds, activations, the
embedding gather, sampling); idle = span - busy. Kernels that match no HLO instruction are
classified by name (matmul or other) and counted in `unmatched`. Written and unit-tested on
XLA:CPU's HLO and a GPU-shaped one; kernels are matched by the profile's `hlo_op` stat or by the
name XLA:GPU derives from the instruction's ('.' and '-' as '_').

    python -m bench.probes.step_kernels                    # GPU host: TP=2 (1 with one GPU)
    python -m bench.probes.step_kernels --quick            # CPU: the tiny model, host only
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import statistics
import tempfile
from pathlib import Path

import jax

from bench import common

VARIANTS = {"psum": ("psum", "psum", "auto", False), "sifar": ("sifar", "sifar", "auto", False),
            "sifar+fused": ("sifar+fused", "sifar", "auto", True),
            # the fused call without its L2 prefetch of the next weight
            "sifar+fused:pf0": ("sifar+fused:pf0", "sifar", "auto", True, 0),
            "identity": ("identity", "identity", "auto", False)}


def kind_of(kernel: str) -> str:
    """A kernel's kind, from its name."""
    k = kernel.lower()
    if "matvec" in k or "addsplits" in k:  # sifar_jax.matvec's kernels (the MoE experts)
        return "matmul"
    if "sifar" in k:
        return "sifar"
    if "nccl" in k:
        return "nccl"
    if any(t in k for t in ("mha_forward", "flash", "attention")):  # e.g. the Pallas decode kernel
        return "attention"
    if any(t in k for t in ("gemm", "dot", "cublas", "cutlass", "xmma", "matmul")):
        return "matmul"
    if "reduce" in k or "reduction" in k:
        return "reduction"
    return "other"


# ------------------------------------------------ kernels -> HLO instructions --
BREAKDOWN = ("matmul", "attention", "all_reduce", "other")
# Opcodes that launch no kernel of their own (or only move a buffer's name).
_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "call", "while",
              "conditional", "opt-barrier", "after-all", "partition-id", "replica-id",
              "all-reduce-done", "copy-done", "send-done", "recv-done", "async-done"}
# Opcodes through which a value stays the same bytes (followed back to their source).
_PASS = {"bitcast", "copy", "reshape", "transpose", "convert", "get-tuple-element", "broadcast",
         "slice", "dynamic-slice"}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
_FUNCTION_LOCATION = re.compile(r"^(\d+) \{file_name_id=\d+ function_name_id=(\d+) ")
_FRAME = re.compile(r"^(\d+) \{file_location_id=(\d+) ")
# Source functions whose kernels count as attention (the innermost user frame's name).
ATTENTION_FUNCTIONS = re.compile(r"attention|attend|rope", re.IGNORECASE)


def _instructions(text: str):
    """{computation: [(name, shape, opcode, operands, attributes)]} and the entry's name, from
    an optimised HLO module's text; the stack frame table as {frame id: function name}."""
    comps: dict[str, list] = {}
    entry, cur, section = None, None, None
    names, locations, frames = {}, {}, {}
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if section and line and not line.startswith((" ", "%", "ENTRY", "HloModule")):
            if section == "FunctionNames" and " " in line:
                k, v = line.split(" ", 1)
                names[k] = v.strip('"')
            elif section == "FileLocations" and (m := _FUNCTION_LOCATION.match(line)):
                locations[m.group(1)] = m.group(2)
            elif section == "StackFrames" and (m := _FRAME.match(line)):
                frames[m.group(1)] = m.group(2)
            continue
        if not line.startswith(" "):
            section = None
            m = _COMPUTATION.match(line)
            cur = m.group(1) if m else None
            if cur is not None:
                comps[cur] = []
                if line.startswith("ENTRY"):
                    entry = cur
            continue
        m = _INSTRUCTION.match(line.strip())
        if cur is None or not m:
            continue
        name, shape, opcode, rest = m.groups()
        depth, end = 1, len(rest)  # the operand list ends at its matching parenthesis
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                end = i
                break
        operands = re.findall(r"%([\w.\-]+)", rest[:end])
        comps[cur].append((name, re.sub(r"\{[^}]*\}", "", shape), opcode, operands,
                           rest[end + 1:] if opcode != "parameter" else rest[:end]))
    functions = {f: names.get(locations.get(loc, ""), "") for f, loc in frames.items()}
    return comps, entry, functions


def _is_matmul(instruction) -> bool:
    """A dot, a convolution, or a library GEMM (cuBLAS through a custom call) or sifar_jax.matvec."""
    _, _, opcode, _, attrs = instruction
    return opcode in ("dot", "convolution") or (opcode == "custom-call" and any(
        t in attrs.lower() for t in ("gemm", "cublas", "matmul", "matvec")))


def _is_allreduce_target(target: str) -> bool:
    """A custom call of sifar_jax's all-reduces (sifar_allreduce*, sifar_psum_add_rmsnorm) or
    NCCL's; not sifar_jax.matvec (sifar_matvec), which is a matmul."""
    return ("sifar" in target and "matvec" not in target) or "nccl" in target


def hlo_kinds(text: str, n_weights: int, cache_shapes=()) -> dict[str, str]:
    """{instruction name: kind} for every instruction of an optimised HLO module that runs a
    kernel: "all_reduce", "matmul" (a dot or GEMM with an operand that is one of the first
    n_weights entry parameters, the model's weights), "attention" (reads or writes a value of
    one of cache_shapes, HLO shapes without layout such as 'bf16[1,4,1024,128]', or comes from
    a function ATTENTION_FUNCTIONS names), "other". Names are also given with '.' and '-' as
    '_', the form XLA:GPU gives its kernels."""
    comps, entry, functions = _instructions(text)
    by_name = {c: {i[0]: i for i in instrs} for c, instrs in comps.items()}
    callers = {}  # computation run by `call` (command buffers) -> (caller computation, operands)
    for c, instrs in comps.items():
        for name, shape, opcode, operands, attrs in instrs:
            for callee in re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", attrs):
                callers.setdefault(callee, (c, operands))
    cache_shapes = set(cache_shapes)

    def source(comp: str, name: str, seen=0):
        """('weight' | 'cache' | None) of the value `name` in `comp`, followed back through
        pass-through instructions, fusion and call parameters, single-operand fusions."""
        ins = by_name.get(comp, {}).get(name)
        if ins is None or seen > 64:
            return None
        _, shape, opcode, operands, attrs = ins
        if shape in cache_shapes:
            return "cache"
        if opcode == "parameter":
            index = int(re.match(r"\s*(\d+)", attrs).group(1))
            if comp == entry:
                return "weight" if index < n_weights else None
            caller = callers.get(comp)
            if caller is None or index >= len(caller[1]):
                return None
            return source(caller[0], caller[1][index], seen + 1)
        if opcode in _PASS or (opcode == "fusion" and len(operands) == 1):
            return source(comp, operands[0], seen + 1) if operands else None
        return None

    def inside(comp: str, name: str) -> list:
        """The instruction and, for a fusion, those of its fused computation(s), as
        (computation, instruction) pairs."""
        out, todo = [], [(comp, by_name[comp][name])]
        while todo:
            c, ins = todo.pop()
            out.append((c, ins))
            for callee in re.findall(r"calls=%?([\w.\-]+)", ins[4]):
                todo += [(callee, i) for i in comps.get(callee, [])]
        return out

    def frame_function(attrs: str) -> str:
        m = re.search(r"stack_frame_id=(\d+)", attrs)
        return functions.get(m.group(1), "") if m else ""

    # The computations whose instructions launch kernels: the entry and what it runs through
    # call (command buffers), while, conditional and async wrappers; not a fusion's body (it runs
    # inside the fusion's kernel) nor a reduction's to_apply.
    running, todo = set(), [entry]
    while todo:
        c = todo.pop()
        if c is None or c in running or c not in comps:
            continue
        running.add(c)
        for _, _, opcode, _, attrs in comps[c]:
            if opcode in ("call", "while", "conditional") or opcode.startswith("async"):
                todo += re.findall(r"(?:to_apply|body|condition|calls|true_computation|"
                                   r"false_computation)=%?([\w.\-]+)", attrs)
                for group in re.findall(r"branch_computations=\{([^}]*)\}", attrs):
                    todo += re.findall(r"%?([\w.\-]+)", group)
    kinds = {}
    for c in running:
        for name, shape, opcode, operands, attrs in comps[c]:
            if opcode in _NO_KERNEL:
                continue
            parts = inside(c, name)
            ops = {i[2] for _, i in parts}
            target = " ".join(re.findall(r'custom_call_target="([^"]*)"', attrs)).lower()
            if (ops & {"all-reduce", "all-reduce-start", "reduce-scatter", "all-gather",
                       "all-gather-start", "collective-permute", "collective-permute-start"}
                    or _is_allreduce_target(target)):
                kind = "all_reduce"
            elif any(source(pc, op) == "weight" for pc, i in parts if _is_matmul(i)
                     for op in i[3]):
                kind = "matmul"
            elif shape in cache_shapes or any(
                    source(pc, op) == "cache" for pc, i in parts for op in i[3]) or any(
                    ATTENTION_FUNCTIONS.search(frame_function(i[4])) for _, i in parts):
                kind = "attention"
            else:
                kind = "other"
            kinds[name] = kind
            kinds.setdefault(re.sub(r"[.\-]", "_", name), kind)
    return kinds


def kernel_kind(name: str, hlo_op: str | None, kinds: dict[str, str]) -> str | None:
    """A profiled kernel's breakdown kind: by its HLO instruction (the profile's hlo_op stat, or
    the kernel's own name), our and NCCL's kernels by name; None if nothing matches."""
    k = kind_of(name)
    if k in ("sifar", "nccl"):
        return "all_reduce"
    for key in (hlo_op, name, re.sub(r"[.\-]", "_", hlo_op or "")):
        if key and key in kinds:
            return kinds[key]
    return None


def breakdown(kernels, steps: int, kinds: dict[str, str]) -> dict:
    """Microseconds per step by BREAKDOWN kind, of profiled kernels [(name, start_ns,
    duration_ns[, hlo_op])] classified by hlo_kinds' map; idle = the span's time with no kernel
    running, overlap = kernel time that ran beside another kernel (a command buffer runs
    independent kernels concurrently), so busy = span - idle + overlap and neither is ever
    negative."""
    us = dict.fromkeys(BREAKDOWN, 0.0)
    unmatched = 0
    for k in kernels:
        kind = kernel_kind(k[0], k[3] if len(k) > 3 else None, kinds)
        if kind is None:
            unmatched += 1
            kind = {"matmul": "matmul", "attention": "attention"}.get(kind_of(k[0]), "other")
        us[kind] += k[2] / 1e3
    busy = sum(k[2] for k in kernels) / 1e3
    span = ((max(k[1] + k[2] for k in kernels) - min(k[1] for k in kernels)) / 1e3
            if kernels else 0.0)
    covered, end = 0, None  # the union of the kernels' intervals, in ns
    for _, start, dur, *_ in sorted(kernels, key=lambda k: k[1]):
        if end is None or start >= end:
            covered += dur
            end = start + dur
        elif start + dur > end:
            covered += start + dur - end
            end = start + dur
    covered /= 1e3
    out = {f"{kind}_us": round(v / steps, 1) for kind, v in us.items()}
    out.update(idle_us=round((span - covered) / steps, 1),
               overlap_us=round((busy - covered) / steps, 1), busy_us=round(busy / steps, 1),
               span_us=round(span / steps, 1), kernels=round(len(kernels) / steps, 1),
               unmatched=round(unmatched / steps, 1))
    return out


def format_breakdown(b: dict) -> str:
    """One line: us per step by kind, idle, and how many kernels matched no HLO instruction."""
    return (", ".join(f"{k.replace('_', '-')} {b[f'{k}_us']:.1f}" for k in BREAKDOWN)
            + f", idle {b['idle_us']:.1f} us per step ({b['kernels']:g} kernels, "
            f"{b['unmatched']:g} classified by name only)")


def decoder_kinds(dec) -> dict[str, str]:
    """hlo_kinds of the step a Decoder runs next (its weights: the first entry parameters, one
    per array it passes, dec.weights.leaves (the norm scales packed); its KV cache: the shard shape of
    each cache leaf)."""
    from models import hlo

    shapes = {hlo.hlo_shape(a.dtype, a.sharding.shard_shape(a.shape))
              for a in jax.tree.leaves(dec.state["cache"])}
    return hlo_kinds(dec.compiled_step().as_text(), len(dec.weights.leaves), shapes)


def step_breakdown(dec, steps: int) -> dict:
    """Profile `steps` back-to-back steps of a Decoder (from where it stands, compiled and
    warm) and break their device time down (breakdown); {"note": why} without GPU kernels."""
    kinds = decoder_kinds(dec)
    kernels = profile_steps(dec, steps)
    if not kernels:
        return {"note": "no GPU kernels in the profile (not a GPU host)"}
    return {"steps": steps, **breakdown(kernels, steps, kinds)}


def device_kernels(xspace_path: str) -> list[tuple[str, int, int, str | None]]:
    """[(name, start_ns, duration_ns, hlo_op)] of the kernels on the first GPU's streams
    (hlo_op: the HLO instruction XLA annotated the launch with, where the profile says)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xspace_path)
    planes = sorted((p for p in data.planes if p.name.startswith("/device:GPU:")),
                    key=lambda p: p.name)
    if not planes:
        return []
    out = []
    for line in planes[0].lines:
        if not line.name.startswith("Stream"):
            continue  # "XLA Ops", "XLA Modules": annotations over the same kernels
        out += [(e.name, int(e.start_ns), int(e.duration_ns), _stat(e, "hlo_op"))
                for e in line.events]
    return out


def _stat(event, key: str) -> str | None:
    try:
        return next((str(v) for k, v in event.stats if k == key), None)
    except Exception:  # noqa: BLE001 - a profile without stats: classified by name
        return None


def per_step(kernels, steps: int, top: int) -> dict:
    """Counts and device microseconds per step, by kind and for the `top` longest kernels."""
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    by_name = collections.defaultdict(list)
    for name, _, dur, *_ in kernels:
        by_kind[kind_of(name)][0] += 1
        by_kind[kind_of(name)][1] += dur / 1e3
        by_name[name].append(dur / 1e3)
    busy = sum(k[2] for k in kernels) / 1e3
    span = (max(k[1] + k[2] for k in kernels) - min(k[1] for k in kernels)) / 1e3
    names = sorted(by_name, key=lambda n: -sum(by_name[n]))[:top]
    return {
        "kernels_per_step": round(len(kernels) / steps, 1),
        "busy_us_per_step": round(busy / steps, 1),
        # first kernel's start to last kernel's end: idle = span - busy (kernels on one stream)
        "span_us_per_step": round(span / steps, 1),
        "by_kind": {k: {"count": round(c / steps, 1), "us": round(t / steps, 1)}
                    for k, (c, t) in sorted(by_kind.items())},
        "top": [{"kernel": n[:120], "kind": kind_of(n), "count": round(len(by_name[n]) / steps, 1),
                 "median_us": round(statistics.median(by_name[n]), 2),
                 # a kernel run at several shapes (one name, several calls) is multimodal
                 "p25_us": round(common.percentile(by_name[n], 25), 2),
                 "p75_us": round(common.percentile(by_name[n], 75), 2),
                 "us": round(sum(by_name[n]) / steps, 1)} for n in names],
    }


def profile_steps(dec, steps: int) -> list[tuple[str, int, int]]:
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            dec.advance(steps)
            dec.token()
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        return device_kernels(files[0]) if files else []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.step_kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=None, help="default: 2 (1 with one GPU)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=8, help="profiled back-to-back steps")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--top", type=int, default=12, help="kernels listed per variant")
    p.add_argument("--quick", action="store_true", help="tiny model (CPU)")
    p.add_argument("--preset", default=None,
                   help="model shapes, any family's preset (default: llama3_8b; tiny with --quick)")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = p.parse_args(argv)
    # Here, not at the top: bench.decode imports this module (--breakdown), and a second copy of
    # bench.decode, run as __main__, would start jax.distributed again.
    from bench import decode as bd
    from models import families, make_mesh

    platform, devices = common.bench_devices(min_gpus=1)
    gpu = platform == "gpu"
    tp = args.tp or (2 if len(devices) >= 2 else 1)
    preset = args.preset or ("tiny" if args.quick or not gpu else "llama3_8b")
    if preset not in bd.PRESETS:
        p.error(f"--preset {preset!r}: choose from {sorted(bd.PRESETS)}")
    config = bd.PRESETS[preset]().replace(dtype="bfloat16" if gpu else "float32",
                                          max_seq_len=args.context)
    mesh = make_mesh(tp, devices=devices[:tp])
    params = families.family_of(config).random_params(config, mesh, seed=0)
    s = {"warmup": 2, "samples": 1, "tokens": args.steps, "chunk": 16}
    results = {"host": common.host_tag(devices), "tp": tp, "preset": preset,
               "steps": args.steps, "context": args.context, "variants": {}}
    for name in [v.strip() for v in args.variants.split(",") if v.strip()]:
        variant = VARIANTS[name]
        dec = bd.make_decoder(config, mesh, params, variant, 1, args.context, 0)
        dec.seek(args.context - args.steps - 8, bd.start_tokens(config, 1, 0))
        dec.advance(3)  # compiled and warm
        dec.token()
        kinds = decoder_kinds(dec)
        kernels = profile_steps(dec, args.steps)
        del dec
        if not kernels:
            results["variants"][name] = {"note": "no GPU kernels in the profile (not a GPU host)"}
            print(f"{name}: no GPU kernels in the profile", flush=True)
            continue
        r = per_step(kernels, args.steps, args.top)
        r["breakdown"] = breakdown(kernels, args.steps, kinds)
        results["variants"][name] = r
        print(f"{name}: " + format_breakdown(r["breakdown"]), flush=True)
        kinds = ", ".join(f"{k} {v['count']} x = {v['us']} us" for k, v in r["by_kind"].items())
        print(f"{name}: {r['kernels_per_step']} kernels, {r['busy_us_per_step']} us busy of "
              f"{r['span_us_per_step']} us per step ({kinds})", flush=True)
        for t in r["top"]:
            print(f"    {t['us']:8.1f} us  {t['count']:5.1f} x {t['median_us']:6.2f} "
                  f"(p25 {t['p25_us']:.2f}, p75 {t['p75_us']:.2f})  [{t['kind']}] {t['kernel']}",
                  flush=True)
    if args.out:
        path = common.write_json(Path(args.out), results)
        print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
