"""Algorithm names and ids (ids match ffi/protocol.h)."""

from __future__ import annotations

ONESHOT = "oneshot"
TWOSHOT = "twoshot"
ONESHOT_DB = "oneshot_db"
SIFAR_FLAG = "sifar_flag"
SIFAR = "sifar"
MULTICAST = "multicast"
SIFAR_PUSH = "sifar_push"
AUTO = "auto"

IDS = {ONESHOT: 0, TWOSHOT: 1, ONESHOT_DB: 2, SIFAR_FLAG: 3, SIFAR: 4, MULTICAST: 5, SIFAR_PUSH: 6}
NAMES = {v: k for k, v in IDS.items()}

# What each one removes, for the README table and error messages.
DESCRIPTIONS = {
    ONESHOT: "top barrier, pull-reduce, bottom barrier",
    TWOSHOT: "top barrier, reduce-scatter, mid barrier, all-gather, bottom barrier",
    ONESHOT_DB: "dual buffering: top barrier, pull-reduce, no bottom barrier",
    SIFAR_FLAG: "dual buffering + speculative pull, validated by a reduced flag (the paper)",
    SIFAR: "dual buffering + speculative pull of epoch-tagged words (default)",
    MULTICAST: "redundant pull with NVLink multicast multimem.ld_reduce (opt-in, GPU only)",
    SIFAR_PUSH: "sifar with the tagged words pushed to the peers and polled locally",
}

ALL = tuple(IDS)
# Algorithms that run without any special hardware.
PORTABLE = (ONESHOT, TWOSHOT, ONESHOT_DB, SIFAR_FLAG, SIFAR, SIFAR_PUSH)


def validate(algorithm: str) -> str:
    if algorithm == AUTO or algorithm in IDS:
        return algorithm
    raise ValueError(
        f"sifar_jax: unknown algorithm {algorithm!r}; choose one of "
        f"{', '.join((AUTO,) + ALL)}"
    )
