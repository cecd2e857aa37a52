"""tools/: the sanitizer scripts' Python cases still run against the product's kernels (on the
CPU here, through the CPU handlers and Pallas' interpreter; compute-sanitizer runs them on a
GPU host), so an API change in sifar_jax.matvec or models/ shows here, not in GPU time."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from bench import common

TOOLS = common.REPO_ROOT / "tools"


@pytest.mark.parametrize("script", ["sanitize_matvec.sh", "sanitize_attention.sh"])
def test_sanitizer_cases_run_on_the_cpu(script):
    text = (TOOLS / script).read_text()
    (code,) = re.findall(r"<<'PY'\n(.*?)\nPY\n", text, re.S)
    assert "source tools/sanitize_run.sh" in text and "sanitize_python" in text
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        filter(None, [os.environ.get("PYTHONPATH"), str(common.REPO_ROOT / "src"),
                      str(common.REPO_ROOT)])))
    r = subprocess.run([sys.executable, "-c", code], cwd=common.REPO_ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"{script[:-3]}: all calls ran" in r.stdout
