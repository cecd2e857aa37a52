"""Where a decode step's device time goes: `bench.decode --breakdown`.

A few back-to-back steps are profiled with `jax.profiler` (CUPTI, GPUs only) and each kernel is
classified through the instruction of the step's optimised HLO that launched it (`hlo_kinds`):
all_reduce (our kernels, the fused call included; NCCL's; XLA's collectives), matmul (a dot or GEMM
reading a model weight: the projections and the LM head), attention (reads or writes the KV cache,
or comes from an attention/RoPE function of the model's source), other (norms, residual adds,
activations, embedding, sampling). A kernel that matches no instruction is classified by its name
and counted in `unmatched`. Kernels match by the profile's `hlo_op` stat or by the name XLA:GPU
derives from the instruction's ('.' and '-' as '_').
"""

from __future__ import annotations

import glob
import re
import tempfile

import jax

BREAKDOWN = ("matmul", "attention", "all_reduce", "other")
# Opcodes that launch no kernel of their own (or only move a buffer's name).
_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "call", "while",
              "conditional", "opt-barrier", "after-all", "partition-id", "replica-id",
              "all-reduce-done", "copy-done", "send-done", "recv-done", "async-done"}
# Opcodes through which a value stays the same bytes (followed back to their source).
_PASS = {"bitcast", "copy", "reshape", "transpose", "convert", "get-tuple-element", "broadcast",
         "slice", "dynamic-slice"}
_COLLECTIVES = {"all-reduce", "all-reduce-start", "reduce-scatter", "all-gather",
                "all-gather-start", "collective-permute", "collective-permute-start"}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
_FUNCTION_LOCATION = re.compile(r"^(\d+) \{file_name_id=\d+ function_name_id=(\d+) ")
_FRAME = re.compile(r"^(\d+) \{file_location_id=(\d+) ")
# Source functions whose kernels count as attention (the innermost user frame's name).
ATTENTION_FUNCTIONS = re.compile(r"attention|attend|rope", re.IGNORECASE)


def kind_of(kernel: str) -> str:
    """A kernel's kind from its name alone: sifar, nccl, attention, matmul, reduction, other."""
    k = kernel.lower()
    for kind, marks in (("matmul", ("matvec", "addsplits")),  # sifar_jax.matvec's (MoE experts)
                        ("sifar", ("sifar",)), ("nccl", ("nccl",)),
                        ("attention", ("mha_forward", "flash", "attention")),
                        ("matmul", ("gemm", "dot", "cublas", "cutlass", "xmma", "matmul")),
                        ("reduction", ("reduce", "reduction"))):
        if any(m in k for m in marks):
            return kind
    return "other"


def _operands_end(rest: str) -> int:
    """Where an instruction's operand list ends: at its matching parenthesis."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return i
    return len(rest)


def _instructions(text: str):
    """{computation: [(name, shape, opcode, operands, attributes)]}, the entry's name, and the
    stack frame table as {frame id: function name}, from an optimised HLO module's text."""
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
                entry = cur if line.startswith("ENTRY") else entry
            continue
        m = _INSTRUCTION.match(line.strip())
        if cur is None or not m:
            continue
        name, shape, opcode, rest = m.groups()
        end = _operands_end(rest)
        comps[cur].append((name, re.sub(r"\{[^}]*\}", "", shape), opcode,
                           re.findall(r"%([\w.\-]+)", rest[:end]),
                           rest[end + 1:] if opcode != "parameter" else rest[:end]))
    functions = {f: names.get(locations.get(loc, ""), "") for f, loc in frames.items()}
    return comps, entry, functions


def _is_matmul(instruction) -> bool:
    """A dot, a convolution, or a library GEMM (cuBLAS through a custom call) or sifar_jax.matvec."""
    _, _, opcode, _, attrs = instruction
    return opcode in ("dot", "convolution") or (opcode == "custom-call" and any(
        t in attrs.lower() for t in ("gemm", "cublas", "matmul", "matvec")))


def _running(comps, entry) -> set:
    """The computations whose instructions launch kernels: the entry and what it runs through
    call (command buffers), while, conditional and async wrappers; not a fusion's body."""
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
    return running


def hlo_kinds(text: str, n_weights: int, cache_shapes=()) -> dict[str, str]:
    """{instruction name: kind} for every instruction of an optimised HLO module that runs a
    kernel. Weights are the first n_weights entry parameters; cache_shapes are HLO shapes without
    layout ('bf16[1,4,1024,128]'). Names are also given with '.' and '-' as '_' (XLA:GPU's)."""
    comps, entry, functions = _instructions(text)
    by_name = {c: {i[0]: i for i in instrs} for c, instrs in comps.items()}
    callers = {}  # computation run by `call` (command buffers) -> (caller computation, operands)
    for c, instrs in comps.items():
        for _, _, _, operands, attrs in instrs:
            for callee in re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", attrs):
                callers.setdefault(callee, (c, operands))
    cache_shapes = set(cache_shapes)

    def source(comp: str, name: str, seen=0):
        """'weight', 'cache' or None: where `name` in `comp` comes from, followed back through
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
        """(computation, instruction) of the instruction and of its fused computations."""
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

    kinds = {}
    for c in _running(comps, entry):
        for name, shape, opcode, operands, attrs in comps[c]:
            if opcode in _NO_KERNEL:
                continue
            parts = inside(c, name)
            target = " ".join(re.findall(r'custom_call_target="([^"]*)"', attrs)).lower()
            # sifar_jax's all-reduce custom calls (not sifar_matvec, a matmul) or NCCL's
            our_call = ("sifar" in target and "matvec" not in target) or "nccl" in target
            if {i[2] for _, i in parts} & _COLLECTIVES or our_call:
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
    """A profiled kernel's kind: by its HLO instruction (the profile's hlo_op stat, or the
    kernel's own name), our and NCCL's kernels by name; None if nothing matches."""
    if kind_of(name) in ("sifar", "nccl"):
        return "all_reduce"
    for key in (hlo_op, name, re.sub(r"[.\-]", "_", hlo_op or "")):
        if key and key in kinds:
            return kinds[key]
    return None


def breakdown(kernels, steps: int, kinds: dict[str, str]) -> dict:
    """Microseconds per step by BREAKDOWN kind of profiled kernels [(name, start_ns, duration_ns[,
    hlo_op])]; idle = the span's time with no kernel running, overlap = kernel time beside another
    kernel (command buffers overlap kernels), so busy = span - idle + overlap, neither negative."""
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
            covered, end = covered + dur, start + dur
        elif start + dur > end:
            covered, end = covered + start + dur - end, start + dur
    covered /= 1e3
    out = {f"{kind}_us": round(v / steps, 1) for kind, v in us.items()}
    out.update(idle_us=round((span - covered) / steps, 1),
               overlap_us=round((busy - covered) / steps, 1), busy_us=round(busy / steps, 1),
               span_us=round(span / steps, 1), kernels=round(len(kernels) / steps, 1),
               unmatched=round(unmatched / steps, 1))
    return out


def decoder_kinds(dec) -> dict[str, str]:
    """hlo_kinds of the step a Decoder runs next: its weights are the first entry parameters, one
    per array it passes (dec.weights.leaves, the norm scales packed); its KV cache, each cache leaf's
    shard shape."""
    from models.decoder import hlo

    shapes = {hlo.hlo_shape(a.dtype, a.sharding.shard_shape(a.shape))
              for a in jax.tree.leaves(dec.state["cache"])}
    return hlo_kinds(dec.compiled_step().as_text(), len(dec.weights.leaves), shapes)


def device_kernels(xspace_path: str) -> list[tuple[str, int, int, str | None]]:
    """[(name, start_ns, duration_ns, hlo_op)] of the kernels on the first GPU's streams."""
    from jax.profiler import ProfileData

    planes = sorted((p for p in ProfileData.from_file(xspace_path).planes
                     if p.name.startswith("/device:GPU:")), key=lambda p: p.name)
    if not planes:
        return []
    return [(e.name, int(e.start_ns), int(e.duration_ns), _stat(e, "hlo_op"))
            for line in planes[0].lines if line.name.startswith("Stream")  # not the annotations
            for e in line.events]


def _stat(event, key: str) -> str | None:
    try:
        return next((str(v) for k, v in event.stats if k == key), None)
    except Exception:  # noqa: BLE001 - a profile without stats: classified by name
        return None


def step_breakdown(dec, steps: int) -> dict:
    """Profile `steps` back-to-back steps of a Decoder (compiled and warm) and break their device
    time down; {"note": why} without GPU kernels."""
    kinds = decoder_kinds(dec)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            dec.advance(steps)
            dec.token()
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        kernels = device_kernels(files[0]) if files else []
    if not kernels:
        return {"note": "no GPU kernels in the profile (not a GPU host)"}
    return {"steps": steps, **breakdown(kernels, steps, kinds)}
