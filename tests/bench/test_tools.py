"""tools/: the sanitizer scripts' Python cases still run against the product's kernels (on the
CPU here, through the CPU handlers and Pallas' interpreter; compute-sanitizer runs them on a
GPU host), so an API change in sifar_jax.matvec or models/ shows here, not in GPU time."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from bench import common

TOOLS = common.REPO_ROOT / "tools"


@pytest.mark.parametrize("script", ["sanitize_matvec.sh", "sanitize_fp8_matvec.sh",
                                    "sanitize_attention.sh", "sanitize_llama_step.sh"])
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


def test_readme_setup_builds_once_and_ci_runs_its_test_command():
    """The README's two set-up commands: the first installs every extra the benchmarks and the
    tests need in one build, the second is the test command, and .ci/run runs that command
    after installing the same extras."""
    readme = (common.REPO_ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    block = re.search(r"## Set-up.*?```bash\n(.*?)```", readme, re.S).group(1).splitlines()
    install, test = (line.split("#")[0].strip() for line in block)
    assert install.count("pip install") == 1 and '-e ".[bench,test]"' in install
    assert "pip install" not in test and test == "python -m pytest -q tests"
    ci = (common.REPO_ROOT / ".ci" / "run").read_text()
    assert '"$VPY" -m pytest -q tests\n' in ci and '-e ".[bench,test]"' in ci


def _bench_files() -> list:
    r = subprocess.run(["git", "ls-files", "bench"], cwd=common.REPO_ROOT, capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip("not a git checkout")
    return [f for f in r.stdout.split() if not f.startswith("bench/results/")
            and (common.REPO_ROOT / f).exists()]


def test_bench_holds_no_cuda():
    """The lab left the tree (docs/performance.md, Probe ledger): no CUDA under bench/."""
    assert not [f for f in _bench_files() if f.endswith((".cu", ".cuh"))]


def test_bench_holds_what_a_user_runs_within_its_line_budget():
    """bench/ outside results/: at most 4,100 lines in all tracked files (3,500 until issues 58
    and 60 split bench.decode and bench.allreduce into modules of one concern each and added
    the measured floor, the CPU rule and the virtual-ranks rows; 4,000 until issue 59's
    persistent rows at every TP and gpu_host_run.sh's steptp steps)."""
    lines = sum(len((common.REPO_ROOT / f).read_text().splitlines()) for f in _bench_files())
    assert lines <= 4100, lines


def test_bench_modules_and_functions_stay_small():
    """No Python file of bench/ (results/ aside) over 500 lines, no function over 80."""
    import ast

    too_long = []
    for f in (f for f in _bench_files() if f.endswith(".py")):
        text = (common.REPO_ROOT / f).read_text()
        if len(text.splitlines()) > 500:
            too_long.append(f"{f}: {len(text.splitlines())} lines")
        too_long += [f"{f}: {node.name}, {node.end_lineno - node.lineno + 1} lines"
                     for node in ast.walk(ast.parse(text))
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and node.end_lineno - node.lineno + 1 > 80]
    assert not too_long, too_long


@pytest.mark.parametrize("weights", ["fp8", "bf16"])
def test_ab_llama_step_cases_run_on_the_cpu(tmp_path, weights):
    """tools/ab_llama_step.sh's timing process (its first here-document) runs every case at the
    small config on the CPU handlers, with the weights (FP8 or AB_WEIGHTS=bf16) as jit
    arguments, and saves the outputs the A/B compares bit for bit."""
    text = (TOOLS / "ab_llama_step.sh").read_text()
    code = re.findall(r"<<'PY' 2>&1 \|\n(.*?)\nPY\n", text, re.S)[0]
    assert "closed over" in text and "--line-buffered" in text
    env = dict(os.environ, JAX_PLATFORMS="cpu", AB_SHAPES="tiny", AB_TAG="cpu", AB_WEIGHTS=weights,
               AB_OUT=str(tmp_path), PYTHONPATH=os.pathsep.join(
                   filter(None, [os.environ.get("PYTHONPATH"), str(common.REPO_ROOT / "src"),
                                 str(common.REPO_ROOT)])))
    r = subprocess.run([sys.executable, "-c", code], cwd=common.REPO_ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "ab_llama_step: all calls ran (cpu)" in r.stdout
    for case in ("tp1", "tp1-long", "ranks2", "ranks4"):
        assert re.search(rf"^ab cpu {case}: [0-9.]+ ms min", r.stdout, re.M), case
    saved = np.load(tmp_path / "ab-cpu.npz")
    assert set(saved.files) == {"h", "slot", "logits"} and np.isfinite(saved["logits"]).all()
