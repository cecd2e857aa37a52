"""The benchmarks' tests: the CPU rule's check (a CPU run prints and writes no timing figure).
Not a conftest.py: tests/ has one, and the sifar_jax tests import from it as `conftest`; the
fixture `timing_figures` is registered there."""

from __future__ import annotations

import re

_FIGURE = re.compile(r"[-+]?\d[\d.]*\s*(?:ms|us|µs|s|tokens/s|TB/s|GB/s)\b|\b\d+\.\d+x\b"
                     r"|[-+]\d+(?:\.\d+)?%")
_UNIT_HEADER = re.compile(r"\b(?:ms|us|tokens/s|TB/s|TPOT|TTFT|floor|latency)\b", re.I)


def find_timing_figures(text: str) -> list[str]:
    """Timing figures in terminal output or markdown: a number with a unit of time or rate, a
    ratio (1.234x), a gain (+4.5%), and any table (markdown or plain) whose header names one."""
    lines = text.splitlines()
    found = [m.group(0) for m in _FIGURE.finditer(text)]
    for head, rule in zip(lines, lines[1:]):
        if re.fullmatch(r"\|?[\s|:-]*-{3}[\s|:-]*", rule) and _UNIT_HEADER.search(head):
            found.append(head)
    return found
