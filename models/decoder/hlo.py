"""Reading compiled HLO text: does an executable copy the KV cache?

A decode step must update the cache in place (the state is donated and aliased); an on-device
loop must also carry it through the while loop without a copy per iteration. XLA says so only in
the optimised HLO (`Compiled.as_text()`): a cache-sized `copy`, or a fusion that does not end in
the in-place dynamic-update-slice, is a copy of the cache.
"""

from __future__ import annotations

import re

import numpy as np

_HLO_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}
# instructions that produce a cache-shaped value without moving its bytes (a dynamic-update-slice
# writes into its operand's buffer: where it cannot, copy insertion adds an explicit copy)
_FREE = {"get-tuple-element", "parameter", "bitcast", "tuple", "while", "conditional", "call",
         "opt-barrier", "dynamic-update-slice"}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\(")
_LAYOUT = re.compile(r"\{[^}]*\}")


def hlo_shape(dtype, shape) -> str:
    """'f32[1,64,2,16]': how HLO writes an array type (without its layout)."""
    name = _HLO_TYPES.get(np.dtype(dtype).name, np.dtype(dtype).name)
    return f"{name}[{','.join(str(int(d)) for d in shape)}]"


def computations(text: str) -> dict[str, list[str]]:
    """name -> instruction lines; the entry computation is also under 'ENTRY'."""
    out: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        if not line.startswith(" "):
            m = _COMPUTATION.match(line)
            cur = m.group(1) if m else None
            if cur is not None:
                out[cur] = []
                if line.startswith("ENTRY"):
                    out["ENTRY"] = out[cur]
            continue
        if cur is not None and line.strip():
            out[cur].append(line.strip())
    return out


def _root_opcode(lines: list[str]) -> str | None:
    for line in lines:
        if line.startswith("ROOT"):
            m = _INSTRUCTION.match(line)
            return m.group(3) if m else None
    return None


def _with_callees(comps: dict[str, list[str]], name: str) -> list[str]:
    """The lines of a computation and of those it runs through `call` (e.g. XLA:GPU's command
    buffers), not of fusions (checked by their root) nor of while bodies (a place of their own)."""
    lines, todo, seen = [], [name], set()
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for line in comps[c]:
            lines.append(line)
            m = _INSTRUCTION.match(line)
            if m and m.group(3) == "call":
                todo += re.findall(r"to_apply=%?([\w.\-]+)", line)
            elif m and m.group(3) == "conditional":
                for group in re.findall(r"(?:branch_computations=\{([^}]*)\}|"
                                        r"(?:true|false)_computation=(%?[\w.\-]+))", line):
                    todo += re.findall(r"%?([\w.\-]+)", " ".join(group))
    return lines


def cache_shapes(cache) -> list[str]:
    """The HLO shapes (hlo_shape) of one rank's KV cache array (sharding.cache_dims), of one
    layer's keys and values, and of one layer's keys: a copy of any of them is a copy of the
    cache (cache_copies)."""
    shard = cache.sharding.shard_shape(cache.shape)
    return [hlo_shape(cache.dtype, shard[i:]) for i in range(3)]


def cache_copies(text: str, shape: str) -> dict[str, list[str]]:
    """Instructions that write a fresh array of `shape` (see hlo_shape) other than in place,
    per place: "entry" (the computation run once per call) and "loop" (every while body).
    An empty dict: the cache is neither copied per call nor per loop iteration."""
    comps = computations(text)
    entry = next((n for n, lines in comps.items() if lines is comps.get("ENTRY") and n != "ENTRY"),
                 None)
    places = {"entry": _with_callees(comps, entry) if entry else []}
    for b in sorted(set(re.findall(r"body=%?([\w.\-]+)", text))):
        places.setdefault("loop", []).extend(_with_callees(comps, b))
    found: dict[str, list[str]] = {}
    for place, lines in places.items():
        for line in lines:
            m = _INSTRUCTION.match(line)
            if m is None or _LAYOUT.sub("", m.group(2)) != shape or m.group(3) in _FREE:
                continue
            if m.group(3) == "fusion":
                called = re.search(r"calls=%?([\w.\-]+)", line)
                if called and _root_opcode(comps.get(called.group(1), [])) == "dynamic-update-slice":
                    continue  # writes the step's slice into the operand's buffer
            found.setdefault(place, []).append(line[:240])
    return found
