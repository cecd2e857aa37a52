"""docs/design.md names only paths that exist, and stays a map (at most MAX_LINES lines).

A path is a backticked token without spaces that contains a "/" and either starts with one of
the repository's top folders (PREFIXES) or ends in a source or document suffix (SUFFIXES).
`a/b.{h,cc}` stands for `a/b.h` and `a/b.cc`; a path ending in "/" must be a directory.
Pure file reading: no jax, no extension.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
MAX_LINES = 500
PREFIXES = ("ffi/", "src/", "models/", "bench/", "tests/", "tools/", "docs/")
SUFFIXES = (".py", ".cc", ".cu", ".cuh", ".h", ".md")


def _expand(token: str) -> list[str]:
    """`a/b.{h,cc}` -> [`a/b.h`, `a/b.cc`] (one brace group, as the docs write them)."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    head, tail = token[: m.start()], token[m.end():]
    return [p for alt in m.group(1).split(",") for p in _expand(head + alt + tail)]


def design_paths(text: str) -> list[str]:
    """Every repository path the text names in backticks, in order, without repeats."""
    found: dict[str, None] = {}
    for token in re.findall(r"`([^`\s]+)`", text):
        if "/" not in token:
            continue
        for path in _expand(token):
            if path.startswith(PREFIXES) or path.endswith(SUFFIXES):
                found[path] = None
    return list(found)


def test_extraction():
    text = ("`ffi/core/protocol.h`, `ffi/runtime/comm.{h,cc}`, `bench/decode/`, `python -m x`, "
            "`a/b.py`, `lax.psum`, `x / y`, `sifar_jax.call_trace`, `[B, S]`, `foo/bar`")
    assert design_paths(text) == ["ffi/core/protocol.h", "ffi/runtime/comm.h",
                                  "ffi/runtime/comm.cc", "bench/decode/", "a/b.py"]


def test_design_is_a_map():
    lines = DESIGN.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"docs/design.md has {len(lines)} lines (at most {MAX_LINES})"


@pytest.mark.parametrize("path", design_paths(DESIGN.read_text()))
def test_design_path_exists(path):
    target = ROOT / path
    if path.endswith("/"):
        assert target.is_dir(), f"docs/design.md names the folder {path}, which does not exist"
    else:
        assert target.exists(), f"docs/design.md names {path}, which does not exist"
