"""What `algorithm="auto"` runs, by payload size and group size, from measurements.

A table maps (group size, payload bytes) to one of our exact algorithms or to
"psum" (hand the payload to lax.psum). Each group size has rows
(max_bytes, choice) in ascending order: a payload of B bytes (whole 16-byte
lines, as it is moved) takes the first row with B <= max_bytes, i.e. the
measurement at the smallest measured size that is at least B; past the largest
measured size a table written by the benchmark's sweep says lax.psum (its
measurements end where ours stop paying), the built-in table keeps the rule
before tables (nothing was measured there: the slot, which the user sets,
decides). A group
size the table does not list keeps the rule of the library before tables:
sifar while the payload fits the slot.

Which table applies to a communicator: the one given to
`init(mesh, auto_table=PATH)`, else the one named by $SIFAR_AUTO_TABLE
(read once, at the first lookup), else the built-in one. Each holds for the
platform it was measured on ("cuda" or "cpu"); the built-in one only for CUDA
GPUs of the H100/H200 class (NVLink), where it was measured. `python -m
bench.allreduce --write-auto-table PATH` writes one from its own run.

A table is consulted at trace time: a function already traced keeps the
choices it was traced with.

Handing a payload to lax.psum because the table says so is a choice: no
warning. A payload the table gives to one of ours but that does not fit the
slot still falls back with the usual warning (raise slot_bytes, or use a table
that says lax.psum there). Tables written by the benchmark never choose ours
above the default slot (DEFAULT_SLOT_BYTES), so a default init never needs a
bigger slot for them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading

import jax

from . import algorithms
from .defaults import DEFAULT_SLOT_BYTES

SCHEMA = "sifar-jax/auto-table/1"
PSUM = "psum"  # the choice that hands a payload to lax.psum
ENV = "SIFAR_AUTO_TABLE"
# bench.allreduce's name for lax.psum in its records.
BENCH_PSUM = "lax.psum"
# The measurements a table is built from: chains of data-dependent
# all-reduces in one jitted shard_map, the level at which lax.psum is measured.
LEVEL = "jit"


@dataclasses.dataclass(frozen=True)
class Table:
    """Choices per group size: {nranks: ((max_bytes, choice), ...)} ascending."""

    platform: str  # "cuda" or "cpu": the communicators it applies to
    rows: dict
    device_kinds: tuple = ()  # substrings of jax's device_kind it applies to; () any
    source: str = ""
    # Past the largest measured size: PSUM, or None (the rule before tables).
    past_last: str | None = PSUM

    def lookup(self, nranks: int, nbytes: int) -> str | None:
        """An algorithm name or PSUM; None where the table has no row for nranks."""
        rows = self.rows.get(int(nranks))
        if not rows:
            return None
        for max_bytes, choice in rows:
            if nbytes <= max_bytes:
                return choice
        return self.past_last

    def applies_to(self, platform: str, device_kind: str) -> bool:
        return platform == self.platform and (
            not self.device_kinds or any(k in device_kind for k in self.device_kinds))

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "platform": self.platform,
            "device_kinds": list(self.device_kinds),
            "source": self.source,
            "past_last": self.past_last,
            "entries": [{"nranks": n, "max_bytes": b, "choice": c}
                        for n in sorted(self.rows) for b, c in self.rows[n]],
        }


# Measured on 2x H200 (bench/results/allreduce-2xH200.json, jit level, TP=2):
# sifar was the fastest of every algorithm and of lax.psum at each size from 4
# to 64 KB (2.7-3.5 us against lax.psum's 8.6-13.9 us). Nothing was measured
# above 64 KB: there the slot decides, as before tables (a user who raised
# slot_bytes, e.g. for prefill, keeps sifar). tests/sifar_jax/test_autotable.py rebuilds
# this table from that file.
BUILTIN = Table(
    platform="cuda",
    rows={2: tuple((kb * 1024, algorithms.SIFAR) for kb in (4, 8, 16, 32, 64))},
    device_kinds=("H100", "H200"),
    source="bench/results/allreduce-2xH200.json (jit level, TP=2)",
    past_last=None,
)


# ------------------------------------------------------------ reading files --
def from_json(data: dict, where: str = "auto table") -> Table:
    """A Table from its JSON object; ValueError naming what is wrong."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"sifar_jax: {where}: not an auto table (schema {SCHEMA!r} expected)")
    platform = data.get("platform")
    if platform not in ("cuda", "cpu"):
        raise ValueError(f"sifar_jax: {where}: platform must be 'cuda' or 'cpu', got {platform!r}")
    allowed = set(algorithms.EXACT) | {PSUM}
    rows: dict = {}
    for e in data.get("entries", []):
        n, b, c = e.get("nranks"), e.get("max_bytes"), e.get("choice")
        if not (isinstance(n, int) and n >= 1 and isinstance(b, int) and b > 0):
            raise ValueError(f"sifar_jax: {where}: bad entry {e!r} (nranks and max_bytes must be "
                             f"positive integers)")
        if c not in allowed:
            raise ValueError(f"sifar_jax: {where}: entry {e!r} chooses {c!r}; choose one of "
                             f"{', '.join(sorted(allowed))} (auto picks only exact algorithms)")
        rows.setdefault(n, {})[b] = c
    if not rows:
        raise ValueError(f"sifar_jax: {where}: no entries")
    past_last = data.get("past_last", PSUM)
    if past_last not in (PSUM, None):
        raise ValueError(f"sifar_jax: {where}: past_last must be {PSUM!r} or null, "
                         f"got {past_last!r}")
    return Table(platform, {n: tuple(sorted(r.items())) for n, r in rows.items()},
                 tuple(data.get("device_kinds", ())), str(data.get("source", "")), past_last)


def load(path) -> Table:
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"sifar_jax: auto table {path}: not JSON ({e})") from None
    return from_json(data, f"auto table {path}")


def write(table: Table, path) -> str:
    path = os.fspath(path)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(table.to_json(), f, indent=1)
        f.write("\n")
    return path


# ------------------------------------------------------ from a benchmark run --
def from_records(records: list[dict], platform: str, *, device_kinds: tuple = (),
                 source: str = "", max_ours_bytes: int | None = None) -> Table:
    """The table of a bench.allreduce run: per group size and measured size,
    the fastest of our exact algorithms and lax.psum at the jit level (medians
    resolved above their noise only; a size where none is resolved gets no
    row). Above `max_ours_bytes` (default: the default slot) lax.psum is
    chosen whatever was measured: the table must never need a bigger slot."""
    if max_ours_bytes is None:
        max_ours_bytes = DEFAULT_SLOT_BYTES
    best: dict = {}
    for r in records:
        if r.get("level") != LEVEL or r.get("us_median") is None:
            continue
        alg = r["algorithm"]
        if alg == BENCH_PSUM:
            choice = PSUM
        elif alg in algorithms.EXACT:
            if r["bytes"] > max_ours_bytes:
                continue
            choice = alg
        else:
            continue
        key = (int(r["tp"]), int(r["bytes"]))
        if key not in best or r["us_median"] < best[key][0]:
            best[key] = (r["us_median"], choice)
    rows: dict = {}
    for (n, b), (_, choice) in sorted(best.items()):
        rows.setdefault(n, []).append((b, choice))
    if not rows:
        raise ValueError(f"no resolved {LEVEL}-level measurement to build an auto table from")
    return Table(platform, {n: tuple(r) for n, r in rows.items()}, tuple(device_kinds), source)


# ------------------------------------------------------------ the one in use --
_lock = threading.Lock()
_state = {"given": None, "env": None, "env_read": False}


def use(path_or_table) -> Table | None:
    """Makes a table (a path or a Table) the one auto consults, for its
    platform; None returns to $SIFAR_AUTO_TABLE / the built-in one. What
    `init(mesh, auto_table=...)` calls."""
    table = path_or_table
    if table is not None and not isinstance(table, Table):
        table = load(table)
    with _lock:
        _state["given"] = table
    return table


def _from_env() -> Table | None:
    with _lock:
        if not _state["env_read"]:
            _state["env_read"] = True
            path = os.environ.get(ENV)
            _state["env"] = load(path) if path else None
        return _state["env"]


@functools.lru_cache(maxsize=None)
def _device_kind(device_id: int) -> str:
    for d in jax.devices():
        if d.id == device_id:
            return d.device_kind
    return ""


def table_for(comm) -> Table | None:
    """The table that decides for this communicator (None: none applies)."""
    kind = _device_kind(comm.groups[0][0]) if comm.groups else ""
    for table in (_state["given"], _from_env(), BUILTIN):
        if table is not None and table.applies_to(comm.platform, kind):
            return table
    return None


def choice(comm, nranks: int, nbytes: int) -> str | None:
    """What auto runs for a payload of nbytes over nranks ranks of `comm`: an
    algorithm, PSUM, or None (no table: the rule before tables)."""
    table = table_for(comm)
    return table.lookup(nranks, nbytes) if table is not None else None
