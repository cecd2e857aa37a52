"""A broken checkpoint as a user meets it: a safetensors file truncated or not safetensors at all, a
tensor missing or misshapen, an index that is not JSON, names a shard that is not there or maps a
tensor to a file that lacks it. The loader (models.load_hf_checkpoint, a family's) raises one
CheckpointError (a ValueError) naming the file and the tensor, before anything is placed on a
device; `python -m models.generate --checkpoint DIR` prints it as one `error:` line, exit code 2.

Each case is built from a small valid checkpoint (a tiny Llama at TP 2): dense float32, FP8
(compressed-tensors per channel, weights/fp8_load.py's own reader) and dense loaded with
quantize="fp8" (quantized as it loads).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import models
from models import LLAMA, LlamaConfig, generate, make_mesh
from models.decoder import compile_cache
from models.weights import checkpoint, fp8_checkpoint as fc
from models.weights.checkpoint import CheckpointError
from models.weights.transforms import quantize_params

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ST, INDEX = "model.safetensors", checkpoint.INDEX_FILE
DOWN = "model.layers.1.mlp.down_proj.weight"  # row-parallel: TP splits its dim 1
NORM = "model.layers.0.input_layernorm.weight"  # replicated


def _need(n):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """kind -> (a valid checkpoint dir, its tensors): 'dense' (float32) and 'fp8'."""
    config = LlamaConfig.tiny()
    params = LLAMA.random_params(config, make_mesh(1), seed=3)
    out = {}
    for kind, p in (("dense", params), ("fp8", quantize_params(params, LLAMA))):
        path = str(tmp_path_factory.mktemp(kind))
        LLAMA.save_hf_checkpoint(p, config, path)
        out[kind] = path, {k: np.array(v) for k, v in
                           fc.read_safetensors(os.path.join(path, ST)).items()}
    return out


def _rewrite(path, tensors):
    fc.write_safetensors(os.path.join(path, ST), tensors)


def _shards(path, tensors, mapping=None):
    """tensors in two files, a.safetensors and b.safetensors, and an index: `mapping` changes
    where the index says some are."""
    os.remove(os.path.join(path, ST))
    names = sorted(tensors)
    files = {n: "a.safetensors" if k % 2 == 0 else "b.safetensors" for k, n in enumerate(names)}
    for fn in ("a.safetensors", "b.safetensors"):
        fc.write_safetensors(os.path.join(path, fn),
                             {n: tensors[n] for n in names if files[n] == fn})
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(files, **(mapping or {}))}, f)


def _truncate(path, tensors):
    with open(os.path.join(path, ST), "rb") as f:
        data = f.read()
    with open(os.path.join(path, ST), "wb") as f:
        f.write(data[: len(data) * 2 // 3])


def _random_bytes(path, tensors):
    with open(os.path.join(path, ST), "wb") as f:
        f.write(np.random.default_rng(0).bytes(5000))


def _header_not_json(path, tensors):
    with open(os.path.join(path, ST), "wb") as f:
        f.write((64).to_bytes(8, "little") + b"{not json" + b" " * 55 + bytes(100))


def _missing(path, tensors):
    _rewrite(path, {k: v for k, v in tensors.items() if k != DOWN})


def _misshapen(name, cut):
    def spoil(path, tensors):
        t = dict(tensors)
        t[name] = np.ascontiguousarray(t[name][..., :-cut])  # an FP8 one keeps its row scales
        _rewrite(path, t)
    return spoil


def _index_not_json(path, tensors):
    _shards(path, tensors)
    with open(os.path.join(path, INDEX), "w") as f:
        f.write("{not json")


def _index_missing_shard(path, tensors):
    _shards(path, tensors, {DOWN: "c.safetensors"})


def _index_wrong_file(path, tensors):
    names = sorted(tensors)
    # DOWN is in one of the two files: say it is in the other
    here = "a.safetensors" if names.index(DOWN) % 2 == 0 else "b.safetensors"
    _shards(path, tensors, {DOWN: "b.safetensors" if here == "a.safetensors" else "a.safetensors"})


# (case, spoil(path, tensors), the message: a regex)
CASES = [
    ("truncated", _truncate, rf"{ST}: truncated: "),
    ("random bytes", _random_bytes, rf"{ST}: not a safetensors file"),
    ("header not JSON", _header_not_json,
     rf"{ST}: not a safetensors file \(its header is not JSON"),
    ("missing tensor", _missing, rf"no tensor '{DOWN}' in {ST}"),
    ("misshapen split", _misshapen(DOWN, 1),
     rf"{ST}: tensor '{DOWN}' has shape \(128, 255\), expected \(128, 256\)"),
    ("misshapen replicated", _misshapen(NORM, 2),
     rf"{ST}: tensor '{NORM}' has shape \(126,\), expected \(128,\)"),
    ("index not JSON", _index_not_json, rf"{INDEX}: not JSON"),
    ("index names a missing shard", _index_missing_shard,
     rf"{INDEX}: maps '{DOWN}' to c.safetensors, which is not in "),
    ("index maps to the wrong file", _index_wrong_file,
     rf"{INDEX}: maps '{DOWN}' to [ab].safetensors, which does not hold it"),
]
# what each kind of checkpoint is loaded as: (the valid checkpoint, quantize)
KINDS = {"dense": ("dense", None), "fp8": ("fp8", None), "quantize-at-load": ("dense", "fp8")}


@contextlib.contextmanager
def no_new_arrays(what):
    """Fails if the block left any device array alive that was not alive before it."""
    gc.collect()
    before = jax.live_arrays()
    ids = {id(a) for a in before}
    try:
        yield
    finally:
        gc.collect()
        new = [a.shape for a in jax.live_arrays() if id(a) not in ids]
        assert not new, f"{what}: arrays placed before the error: {new}"


def _broken(valid, tmp_path, kind, spoil):
    src, tensors = valid[KINDS[kind][0]]
    path = str(tmp_path / "ck")
    os.makedirs(path)
    with open(os.path.join(src, checkpoint.CONFIG_FILE)) as f:
        hf = f.read()
    with open(os.path.join(path, checkpoint.CONFIG_FILE), "w") as f:
        f.write(hf)
    _rewrite(path, tensors)
    spoil(path, tensors)
    return path


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case,spoil,match", CASES, ids=[c[0] for c in CASES])
def test_the_loader_names_the_file_and_tensor_before_placing_anything(valid, tmp_path, kind,
                                                                      case, spoil, match):
    _need(2)
    path = _broken(valid, tmp_path, kind, spoil)
    with pytest.raises(CheckpointError, match=match) as e:
        with no_new_arrays(case):
            LLAMA.load_hf_checkpoint(path, make_mesh(2), quantize=KINDS[kind][1])
    assert "\n" not in str(e.value)


@pytest.fixture
def no_compile_cache(monkeypatch):
    monkeypatch.setenv(compile_cache.ENV_OFF, "1")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case,spoil,match", CASES, ids=[c[0] for c in CASES])
def test_the_command_line_prints_one_error_line(valid, tmp_path, capsys, no_compile_cache, kind,
                                                case, spoil, match):
    _need(2)
    path = _broken(valid, tmp_path, kind, spoil)
    quantize = ["--quantize", KINDS[kind][1]] if KINDS[kind][1] else []
    assert generate.main(["--checkpoint", path, "--tp", "2", "--tokens", "2", "--no-warmup",
                          "--allreduce", "psum", *quantize]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --checkpoint {path}: "), err
    assert re.search(match, lines[0]), lines[0]


def test_the_package_function_raises_it_too(valid, tmp_path):
    path = _broken(valid, tmp_path, "dense", _missing)
    with pytest.raises(CheckpointError, match=rf"no tensor '{DOWN}'"):
        models.load_hf_checkpoint(path, make_mesh(1))


def test_a_checkpoint_without_safetensors_is_one(tmp_path, valid):
    path = _broken(valid, tmp_path, "dense", lambda p, t: os.remove(os.path.join(p, ST)))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors file"):
        LLAMA.load_hf_checkpoint(path, make_mesh(1))


def test_valid_checkpoints_in_two_shards_still_load(valid, tmp_path):
    """The checks refuse none of the valid layouts: the same tensors in two files and an index
    load to the same parameters."""
    _need(2)
    for kind in ("dense", "fp8"):
        path = _broken(valid, tmp_path / kind, kind, _shards)
        _, params = LLAMA.load_hf_checkpoint(path, make_mesh(2))
        _, ref = LLAMA.load_hf_checkpoint(valid[kind][0], make_mesh(2))
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_in_a_real_process_it_is_one_line_and_no_traceback(valid, tmp_path):
    path = _broken(valid, tmp_path, "dense", _truncate)
    env = dict(os.environ, **{compile_cache.ENV_OFF: "1"})
    r = subprocess.run([sys.executable, "-m", "models.generate", "--checkpoint", path,
                        "--tokens", "2", "--no-warmup", "--allreduce", "psum"],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: --checkpoint {path}: {ST}: truncated: "), r.stderr


def test_config_json_that_is_not_json_is_one(tmp_path, capsys, no_compile_cache):
    (tmp_path / "config.json").write_text("{'model_type': 'llama'}")
    with pytest.raises(CheckpointError, match="config.json: not JSON"):
        models.load_hf_checkpoint(str(tmp_path), make_mesh(1))
    assert generate.main(["--checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --checkpoint {tmp_path}: config.json: not JSON") and \
        err.count("\n") == 1, err


def test_the_expected_shapes_are_the_checkpoints_at_any_tp(valid):
    """hf_shapes of a layout whose KV heads are copied (tiny: 4 KV heads at TP 8) is the
    checkpoint's own: each KV head once."""
    _, tensors = valid["dense"]
    want = {k: v.shape for k, v in tensors.items()}
    for tp in (1, 2, 8):
        assert LLAMA.hf_shapes(LLAMA.layout(LlamaConfig.tiny(), tp)) == want


@pytest.fixture(scope="module")
def fused_qwen(tmp_path_factory):
    """A tiny Qwen3-MoE's tensors with its experts fused (transformers 5's layout), and its
    config.json."""
    from models.qwen3_moe import QWEN3_MOE, Qwen3MoeConfig
    from models.qwen3_moe.hf import to_hf_tensors

    config = Qwen3MoeConfig.tiny()
    params = QWEN3_MOE.random_params(config, make_mesh(1), seed=2)
    return to_hf_tensors(params, config, fused_experts=True), config.to_hf_config()


GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"  # [E, 2 I, hidden] = [8, 64, 64]


@pytest.mark.parametrize("cut,match", [
    # the layout the config's shapes do not name: checked chunk by chunk
    ((slice(None), slice(None), slice(0, 63)),
     rf"{ST}: tensor '{GATE_UP}' \(8, 64, 63\): these give \['layers'\]\[1\]\['moe'\]"
     rf"\['gate_up'\]\[0:8\] the shape \(8, 63, 2, 8\), expected \(8, 64, 2, 8\)"),
    ((slice(None), slice(0, 62), slice(None)),
     rf"{ST}: tensor '{GATE_UP}' has shape \(8, 62, 64\): the model reads \[56:64\] of its dim 1"),
    ("grow", rf"{ST}: tensor '{GATE_UP}' has shape \(8, 66, 64\): the model reads 64 of its dim 1"),
])
def test_fused_experts_of_the_wrong_shape_are_named(fused_qwen, tmp_path, cut, match):
    """Where the config's shapes (hf_shapes) do not name a tensor, each chunk the devices will
    read is built from the headers alone and its shape checked, and a tensor read only in part
    is named."""
    from models.qwen3_moe import QWEN3_MOE

    _need(4)
    tensors, hf = dict(fused_qwen[0]), fused_qwen[1]
    a = tensors[GATE_UP]
    tensors[GATE_UP] = (np.concatenate([a, a[:, :2]], axis=1) if cut == "grow"
                        else np.ascontiguousarray(a[cut]))
    (tmp_path / "config.json").write_text(json.dumps(hf))
    fc.write_safetensors(str(tmp_path / ST), tensors)
    with pytest.raises(CheckpointError, match=match):
        with no_new_arrays("fused"):
            QWEN3_MOE.load_hf_checkpoint(str(tmp_path), make_mesh(4))
