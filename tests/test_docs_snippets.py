"""Every ```python block of README.md and docs/adoption.md runs, as written.

Each block runs alone in a fresh interpreter (8 XLA:CPU host devices, the repository root as
the current directory and on PYTHONPATH), so a snippet that fails fails the suite. A block that
is not meant to run alone says so in an HTML comment on the line directly above its fence:

    <!-- snippet: skip (the reason) -->
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/adoption.md")
TIMEOUT_S = 300
FENCE = re.compile(r"^```python\s*$")
SKIP = re.compile(r"^<!--\s*snippet:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->\s*$")


def snippets(doc: str) -> list[tuple[int, str, str | None]]:
    """(line of the opening fence, code, reason to skip or None) of each python block."""
    lines = (REPO / doc).read_text().splitlines()
    found = []
    i = 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            start = i
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            assert end is not None, f"{doc}:{start + 1}: unclosed ```python block"
            above = lines[start - 1].strip() if start > 0 else ""
            skip = SKIP.match(above)
            if above.startswith("<!--") and "snippet" in above and not skip:
                raise AssertionError(f"{doc}:{start}: malformed snippet marker {above!r} "
                                     f"(expected '<!-- snippet: skip (reason) -->')")
            found.append((start + 1, "\n".join(lines[start + 1:end]) + "\n",
                          skip["reason"] if skip else None))
            i = end
        i += 1
    return found


CASES = [(doc, line, code, reason) for doc in DOCS for line, code, reason in snippets(doc)]


def test_the_docs_have_snippets():
    for doc in DOCS:
        assert any(reason is None for _, _, reason in snippets(doc)), f"{doc}: no block runs"


def _env() -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


@pytest.mark.parametrize("doc,line,code,reason", CASES,
                         ids=[f"{doc}:{line}" for doc, line, _, _ in CASES])
def test_snippet_runs(doc, line, code, reason):
    if reason is not None:
        pytest.skip(f"{doc}:{line}: {reason}")
    try:
        p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{doc}:{line}: still running after {TIMEOUT_S} s\n{e.stderr or ''}")
    assert p.returncode == 0, (
        f"{doc}:{line}: the snippet failed (exit {p.returncode})\n--- code ---\n{code}"
        f"--- stderr ---\n{p.stderr[-4000:]}")
