"""models.generate's promise for the combinations of arguments the model refuses (shapes, TP,
quantization, the all-reduce's slot): each is one `error:` line on stderr and exit code 2, with
or without the warm-up, from the library's own ValueError; an unexpected exception stays a
traceback. (The arguments checked before jax starts: test_generate.py; a bad checkpoint:
test_checkpoint_errors.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

import sifar_jax
from models import generate, make_mesh
from models.decoder import compile_cache
from models.qwen3_moe import QWEN3_MOE, Qwen3MoeConfig
from models.weights.transforms import quantize_params

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# qwen3_moe_tiny's experts are 32 wide: at TP 4 a rank holds 8 of down's contracted columns
FP8_AT_TP4 = "FP8 weights: 'down' has 8 contracted columns per rank at TP=4"
BASE = ["--tokens", "2", "--allreduce", "psum"]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.setenv(compile_cache.ENV_OFF, "1")
    sifar_jax.shutdown()
    yield
    sifar_jax.shutdown()


def _need(n):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")


def _error(capsys, argv) -> str:
    assert generate.main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def qwen_checkpoints(tmp_path_factory):
    """qwen3_moe_tiny's random weights as a bf16-style (float32) checkpoint and an FP8 one."""
    config = Qwen3MoeConfig.tiny()
    params = QWEN3_MOE.random_params(config, make_mesh(1), seed=1)
    out = {}
    for kind, p in (("dense", params), ("fp8", quantize_params(params, QWEN3_MOE))):
        out[kind] = str(tmp_path_factory.mktemp(kind))
        QWEN3_MOE.save_hf_checkpoint(p, config, out[kind])
    return out


def test_the_users_command_in_a_real_process(tmp_path):
    """`--preset qwen3_moe_tiny --tp 4 --quantize fp8`: a 32-line traceback ending in a clear
    ValueError, before; one line now."""
    env = dict(os.environ, **{compile_cache.ENV_OFF: "1"})
    r = subprocess.run([sys.executable, "-m", "models.generate", "--preset", "qwen3_moe_tiny",
                        "--tp", "4", "--quantize", "fp8", *BASE], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: ") and FP8_AT_TP4 in r.stderr, r.stderr


@pytest.mark.parametrize("warmup", [[], ["--no-warmup"]], ids=["warmup", "no-warmup"])
@pytest.mark.parametrize("kind,quantize", [("dense", True), ("fp8", False), ("fp8", True)],
                         ids=["dense-quantize", "fp8", "fp8-quantize"])
def test_fp8_weights_at_a_tp_that_leaves_a_rank_too_few_columns(capsys, qwen_checkpoints, kind,
                                                                quantize, warmup):
    """An FP8 checkpoint, or a dense one with --quantize fp8, at TP 4: one line, named as the
    checkpoint loads (it was a traceback from the first compile with --no-warmup)."""
    _need(4)
    argv = ["--checkpoint", qwen_checkpoints[kind], "--tp", "4", *BASE, *warmup]
    line = _error(capsys, argv + (["--quantize", "fp8"] if quantize else []))
    assert "8 contracted columns per rank at TP=4" in line, line


def test_an_fp8_checkpoint_at_such_a_tp_is_refused_before_anything_is_placed(qwen_checkpoints):
    _need(4)
    before = {id(a) for a in jax.live_arrays()}
    for path, quantize in ((qwen_checkpoints["fp8"], None), (qwen_checkpoints["dense"], "fp8")):
        with pytest.raises(ValueError, match="8 contracted columns per rank at TP=4"):
            QWEN3_MOE.load_hf_checkpoint(path, make_mesh(4), quantize=quantize)
    assert not [a.shape for a in jax.live_arrays() if id(a) not in before]
    QWEN3_MOE.load_hf_checkpoint(qwen_checkpoints["fp8"], make_mesh(2))  # 16 columns: fine


def test_random_fp8_weights_at_such_a_tp_are_refused_before_they_are_made(capsys, monkeypatch):
    _need(4)
    line = _error(capsys, ["--preset", "qwen3_moe_tiny", "--tp", "4", "--quantize", "fp8", *BASE])
    assert FP8_AT_TP4 in line, line
    before = {id(a) for a in jax.live_arrays()}
    with pytest.raises(ValueError, match=FP8_AT_TP4):
        QWEN3_MOE.random_params(Qwen3MoeConfig.tiny(), make_mesh(4), quantize="fp8")
    assert not [a.shape for a in jax.live_arrays() if id(a) not in before]


def test_a_sifar_algorithm_whose_slot_the_prefill_exceeds_without_the_warmup(capsys):
    """With the warm-up the compile names it (one line); with --no-warmup the request's own
    first compile did, as a traceback."""
    _need(2)
    for warmup in ([], ["--no-warmup"]):
        line = _error(capsys, ["--tp", "2", "--tokens", "2", "--algorithm", "oneshot",
                               "--slot-bytes", "1024", *warmup])
        assert "exceeds the 1024-byte slot" in line, line


def test_an_unexpected_exception_stays_a_traceback(monkeypatch):
    """Only the library's ValueErrors where the model is made, loaded or compiled become an
    error line: anything else propagates (here, from making the weights)."""
    def broken(*a, **k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(type(QWEN3_MOE), "random_params", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        generate.main(["--preset", "qwen3_moe_tiny", *BASE])


def test_multicast_where_the_environment_refuses_it_is_one_line(capsys, monkeypatch):
    """--algorithm multicast without SIFAR_ENABLE_MULTICAST=1: sifar_jax's guard refuses it (a
    RuntimeError, from the first trace: a traceback, warm-up or not); named before jax compiles
    anything."""
    from sifar_jax import multicast

    monkeypatch.delenv(multicast.ENABLE_VAR, raising=False)
    for warmup in ([], ["--no-warmup"]):
        line = _error(capsys, ["--tp", "2", "--tokens", "2", "--algorithm", "multicast",
                               *warmup])
        assert line.startswith("error: --algorithm multicast: ") and \
            multicast.refusal() in line, line
