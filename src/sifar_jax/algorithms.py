"""Algorithm names and ids, read from the extension (the one list lives in
ffi/core/protocol.h, SIFAR_ALGORITHMS)."""

from __future__ import annotations

import warnings

from . import _ext

_TABLE = {a["name"]: a for a in _ext.lib.algorithms()}

ONESHOT = "oneshot"
TWOSHOT = "twoshot"
ONESHOT_DB = "oneshot_db"
SIFAR_FLAG = "sifar_flag"
SIFAR = "sifar"
MULTICAST = "multicast"
SIFAR_PUSH = "sifar_push"
AUTO = "auto"
assert all(n in _TABLE for n in (ONESHOT, TWOSHOT, ONESHOT_DB, SIFAR_FLAG, SIFAR, MULTICAST, SIFAR_PUSH))

IDS = {name: a["id"] for name, a in _TABLE.items()}
NAMES = {v: k for k, v in IDS.items()}
# What each one does, for the README table and error messages.
DESCRIPTIONS = {name: a["description"] for name, a in _TABLE.items()}

ALL = tuple(sorted(IDS, key=IDS.get))
# Algorithms that run without any special hardware (a CPU and a CUDA kernel).
PORTABLE = tuple(n for n in ALL if _TABLE[n]["portable"])
# Correct by construction under the PTX memory model; "auto" picks only these.
EXACT = tuple(n for n in ALL if _TABLE[n]["exact"])
# Epoch-tagged (LL) words: validity travels with the data.
TAGGED = tuple(n for n in ALL if _TABLE[n]["tagged"])

_warned: set[str] = set()


def validate(algorithm: str) -> str:
    if algorithm == AUTO or algorithm in IDS:
        if algorithm in IDS and algorithm not in EXACT and algorithm not in _warned:
            _warned.add(algorithm)
            warnings.warn(
                f"sifar_jax: algorithm {algorithm!r} is the paper's ablation and not correct by "
                f"construction (its flag check can pass a stale payload); use 'sifar' for results "
                f"you rely on",
                stacklevel=4,
            )
        return algorithm
    raise ValueError(
        f"sifar_jax: unknown algorithm {algorithm!r}; choose one of "
        f"{', '.join((AUTO,) + ALL)}"
    )
