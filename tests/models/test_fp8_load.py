"""load_hf_checkpoint on FP8 checkpoints (models/fp8_load.py): tiny Llama and Qwen3-MoE models
written in each hub layout (compressed-tensors per channel / per tensor with input_scale,
fine-grained FP8 with blocks, also blocks that straddle heads or TP shards), loaded at TP 1, 2
and 4 on CPU host devices.

Every Fp8Weight leaf dequantizes bit for bit to the checkpoint's q x s, laid out by an
independent path: the same q x s written as a float32 checkpoint and read by the dense loader.
The prefill logits on the FP8 params equal those on the dequantized weights within float32
summation order. quantize="fp8" of a bf16 checkpoint gives quantize_per_channel's bits of each
whole tensor whatever the TP split. save_hf_checkpoint writes the layout back bit for bit. Each bad
input is an Fp8CheckpointError naming the tensor, raised before anything is placed.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from models import make_mesh
from models.llama import LLAMA, LlamaConfig
from models.qwen3_moe import QWEN3_MOE, Qwen3MoeConfig
from models.weights import checkpoint, fp8_checkpoint as fc
from models.weights.types import Fp8Weight, dequantize, dequantize_stack

E4M3 = ml_dtypes.float8_e4m3fn


def ct(strategy):
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": {"num_bits": 8, "type": "float",
                                                             "strategy": "tensor"},
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy}}}}


def fine(block):
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    return qc if block is None else dict(qc, weight_block_size=block)


# [48, 32]: 3 heads of 16 rows per block, TP shards of gate_up / lm_head start inside blocks;
# [24, 32]: blocks straddle heads (regridded to 8 rows); [128, 128] as the hub ships.
LAYOUTS = {"ct_channel": ct("channel"), "ct_tensor": ct("tensor"), "fp8_48x32": fine([48, 32]),
           "fp8_24x32": fine([24, 32]), "fp8_128": fine([128, 128]), "fp8_tensor": fine(None)}
FAMILIES = {"llama": (LLAMA, LlamaConfig.tiny(intermediate_size=320)),
            "qwen3_moe": (QWEN3_MOE, Qwen3MoeConfig.tiny(moe_intermediate_size=64))}


def _need(n):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")


def _projection(name: str, head: bool) -> bool:
    return name.endswith("_proj.weight") or (head and name == "lm_head.weight")


def write_fp8(path, family, config, qc, seed=0, head=False):
    """An FP8 checkpoint of random non-zero e4m3 values and scales in qc's layout (the LM head
    too with head); returns the float32 tensors q x s (the rest as written)."""
    rng = np.random.default_rng(seed)
    scheme = fc.parse_quantization_config({"quantization_config": qc})
    dense = family.to_hf_tensors(family.random_params(config, make_mesh(1), seed), config)
    out, ref = {}, {}
    for name, a in dense.items():
        if not _projection(name, head):
            out[name] = ref[name] = a
            continue
        n, k = a.shape
        q = np.clip(rng.standard_normal((n, k)) * 32, -448, 448).astype(E4M3)
        q[q.astype(np.float32) == 0] = E4M3(1.0)
        bn, bk = {"tensor": (n, k), "channel": (1, k)}.get(scheme.strategy, scheme.block)
        s = rng.uniform(0.5, 2, (-(-n // bn), -(-k // bk))).astype(np.float32) / 256
        module = name[: -len(".weight")]
        fc.write_fp8_weight(out, module, q, s, scheme)
        if scheme.layout == "compressed-tensors":
            out[f"{module}.input_scale"] = np.float32(rng.uniform(0.5, 2)).reshape(())  # unused
        ref[name] = q.astype(np.float32) * np.repeat(np.repeat(s, bn, 0)[:n], bk, 1)[:, :k]
    if head:
        qc = dict(qc, ignore=[]) if "ignore" in qc else qc
    _write(path, dict(config.to_hf_config(), quantization_config=qc), out)
    return ref


def _write(path, hf_config, tensors):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f)
    fc.write_safetensors(os.path.join(path, "model.safetensors"), tensors)


def _dense(w, path):
    if not isinstance(w, Fp8Weight):
        return w
    f = dequantize_stack if "moe" in jax.tree_util.keystr(path) else dequantize
    return f(w, jnp.float32)


def dequantized(params):
    return jax.tree_util.tree_map_with_path(lambda p, w: _dense(w, p), params,
                                            is_leaf=lambda x: isinstance(x, Fp8Weight))


def _fp8_paths(params):
    leaves = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, Fp8Weight))[0]
    return sorted(jax.tree_util.keystr(p) for p, w in leaves if isinstance(w, Fp8Weight))


def prefill_logits(family, config, mesh, params, tokens):
    """Prefill logits [T, vocab] of family's forward on params (FP8 or dense)."""
    layout = family.layout(config, mesh.shape["tp"])
    kw = {"params": params} if "params" in inspect.signature(family.make_forward).parameters else {}
    if not kw and _fp8_paths(params):
        pytest.skip("the forward takes FP8 params with the fp8decode branch's make_forward")
    fwd = jax.jit(family.make_forward(layout, mesh, **kw))
    cache = family.init_cache(layout, mesh, 1, config.max_seq_len)
    logits, _, _ = fwd(params, cache, jnp.asarray(tokens[None]),
                       jnp.arange(len(tokens), dtype=jnp.int32), {})
    return np.asarray(logits[0], np.float32)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(family name, layout name) -> (path, float32 reference tensors), written once."""
    cache = {}

    def get(fam, lay, head=False):
        if (fam, lay, head) not in cache:
            family, config = FAMILIES[fam]
            path = str(tmp_path_factory.mktemp(f"{fam}_{lay}"))
            ref = write_fp8(path, family, config, LAYOUTS[lay], seed=len(cache), head=head)
            ref_path = path + "_f32"
            checkpoint.save(ref, config.to_hf_config(), ref_path)
            cache[fam, lay, head] = path, ref_path
        return cache[fam, lay, head]

    return get


CASES = [("llama", lay, tp) for lay in LAYOUTS for tp in (1, 2, 4)] + [
    ("qwen3_moe", lay, tp) for lay in ("ct_channel", "fp8_48x32", "fp8_tensor") for tp in (1, 4)]


# the cases whose logits are compared too (each costs two compiles)
LOGITS = {("llama", "fp8_48x32", 2), ("llama", "ct_tensor", 4), ("llama", "fp8_24x32", 1),
          ("qwen3_moe", "fp8_48x32", 4), ("qwen3_moe", "ct_channel", 1)}


@pytest.mark.parametrize("fam,lay,tp", CASES, ids=[f"{f}-{lay}-tp{t}" for f, lay, t in CASES])
def test_leaves_are_the_checkpoints_q_times_s_and_logits_match(written, fam, lay, tp):
    _need(tp)
    family, config = FAMILIES[fam]
    path, ref_path = written(fam, lay, head=(lay == "fp8_48x32"))
    mesh = make_mesh(tp)
    got_config, params = family.load_hf_checkpoint(path, mesh)
    _, want = family.load_hf_checkpoint(ref_path, mesh)
    projections = {"qkv", "o", "gate_up", "down"} | ({"lm_head"} if lay == "fp8_48x32" else set())
    assert {p.split("'")[-2] for p in _fp8_paths(params)} == projections
    assert got_config.quantization == fc.parse_quantization_config(
        {"quantization_config": LAYOUTS[lay]}).spec
    for p, w in jax.tree_util.tree_flatten_with_path(
            params, is_leaf=lambda x: isinstance(x, Fp8Weight))[0]:
        if isinstance(w, Fp8Weight):
            assert w.q.dtype == jnp.float8_e4m3fn and w.scale.dtype == jnp.float32
    for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(dequantized(params))[0],
                         jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(p))
    if (fam, lay, tp) in LOGITS:
        tokens = np.random.default_rng(3).integers(0, config.vocab_size, 12, dtype=np.int32)
        got = prefill_logits(family, config, mesh, params, tokens)
        ref = prefill_logits(family, config, mesh, want, tokens)
        # float32 throughout: the same products, the sums in another order
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


# ---- save: the layout written back ---------------------------------------------------------------

@pytest.mark.parametrize("fam,lay,tp", [("llama", "ct_channel", 2), ("llama", "ct_tensor", 4),
                                        ("llama", "fp8_24x32", 2), ("llama", "fp8_48x32", 4),
                                        ("qwen3_moe", "fp8_48x32", 4)])
def test_save_writes_the_source_layout_back_bit_for_bit(written, tmp_path, fam, lay, tp):
    _need(tp)
    family, _ = FAMILIES[fam]
    path, _ = written(fam, lay, head=(lay == "fp8_48x32"))
    config, params = family.load_hf_checkpoint(path, make_mesh(tp))
    family.save_hf_checkpoint(params, config, str(tmp_path))
    src, back = fc.read_checkpoint_dir(path), fc.read_checkpoint_dir(str(tmp_path))
    assert sorted(back) == sorted(n for n in src if not n.endswith("input_scale"))
    for name, a in src.items():
        if not name.endswith("input_scale"):
            assert back[name].dtype == a.dtype, name
            np.testing.assert_array_equal(back[name].view(np.uint8), a.view(np.uint8), name)
    hf = checkpoint.read_hf_config(str(tmp_path))
    assert fc.parse_quantization_config(hf).spec == config.quantization
    again, reloaded = family.load_hf_checkpoint(str(tmp_path), make_mesh(tp))
    assert again.quantization == config.quantization
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reloaded)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


# ---- quantize="fp8" of a bf16 checkpoint ---------------------------------------------------------

def test_quantize_at_load_is_per_channel_of_whole_tensors_at_any_tp(tmp_path):
    config = LlamaConfig.tiny(intermediate_size=320, dtype="bfloat16")
    params = LLAMA.random_params(config, make_mesh(1), seed=5)
    LLAMA.save_hf_checkpoint(params, config, str(tmp_path / "bf16"))
    dense = LLAMA.to_hf_tensors(params, config)
    ref = {}
    for name, a in dense.items():  # each whole tensor quantized: the bits every TP must give
        if _projection(name, head=True):
            q, s = fc.quantize_per_channel(a)
            a = q.astype(np.float32) * s
        ref[name] = np.asarray(a, np.float32)
    checkpoint.save(ref, config.replace(dtype="float32").to_hf_config(), str(tmp_path / "ref"))
    tokens = np.random.default_rng(4).integers(0, config.vocab_size, 12, dtype=np.int32)
    for tp in (1, 2, 4):
        _need(tp)
        mesh = make_mesh(tp)
        got_config, fp8 = LLAMA.load_hf_checkpoint(str(tmp_path / "bf16"), mesh, quantize="fp8",
                                                   dtype="float32")
        assert got_config.quantization == "compressed-tensors:channel"
        assert "['lm_head']" in _fp8_paths(fp8)  # the head too
        _, want = LLAMA.load_hf_checkpoint(str(tmp_path / "ref"), mesh)
        for a, b in zip(jax.tree.leaves(dequantized(fp8)), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # against the bf16 model (float32 compute on both): per-channel e4m3's error, measured
    got = prefill_logits(LLAMA, got_config, mesh, fp8, tokens)
    _, bf16 = LLAMA.load_hf_checkpoint(str(tmp_path / "bf16"), mesh, dtype="float32")
    base = prefill_logits(LLAMA, got_config, mesh, bf16, tokens)
    err = np.abs(got - base).max() / np.abs(base).max()
    assert 0 < err < QUANTIZE_BOUND, err


# max |logit error| / max |logit| of per-channel e4m3 against the bf16 weights, tiny random
# Llama (2 layers, 12 tokens): measured 0.043 (docs/reference.md)
QUANTIZE_BOUND = 0.06


# ---- bad input -----------------------------------------------------------------------------------

def _bad_cases():
    m = "model.layers.1.mlp.down_proj"
    s = f"{m}.weight_scale_inv"
    yield "missing scale", lambda t, c: t.pop(s), f"{s}: missing"
    yield "scale shape", lambda t, c: t.__setitem__(s, np.ones((2, 2), np.float32)), \
        rf"{s}: shape \(2, 2\), expected \(3, 10\)"
    for what, v in (("nan", np.nan), ("inf", np.inf), ("zero", 0.0)):
        yield f"{what} scale", (lambda v: lambda t, c: t[s].__setitem__((0, 0), v))(v), \
            f"{s}: non-finite or zero"
    yield "negative scale", lambda t, c: t[s].__setitem__((1, 2), -1.0), f"{s}: negative"
    yield "e5m2 weight", lambda t, c: t.__setitem__(
        f"{m}.weight", t[f"{m}.weight"].astype(ml_dtypes.float8_e5m2)), \
        f"{m}.weight: dtype F8_E5M2, expected F8_E4M3"
    yield "bf16 weight", lambda t, c: t.__setitem__(
        f"{m}.weight", t[f"{m}.weight"].astype(ml_dtypes.bfloat16)), \
        f"{m}.weight: dtype BF16, expected F8_E4M3"
    yield "float8 norm", lambda t, c: t.__setitem__(
        "model.norm.weight", t["model.norm.weight"].astype(E4M3)), \
        "model.norm.weight: a float8 tensor that is not one of the projections"
    yield "quant_method", lambda t, c: c.update(quant_method="gptq"), "quant_method 'gptq'"
    yield "block size", lambda t, c: c.update(weight_block_size=[128, 8]), "weight_block_size"
    yield "fmt", lambda t, c: c.update(fmt="e5m2"), "fmt 'e5m2'"


BAD = list(_bad_cases())


@contextlib.contextmanager
def no_new_arrays(what):
    """Fails if the block, raising, left any device array alive that was not alive before it
    (the arrays alive before are held, so none is collected and its id reused)."""
    gc.collect()
    before = jax.live_arrays()
    ids = {id(a) for a in before}
    try:
        yield
    finally:
        gc.collect()
        new = [a.shape for a in jax.live_arrays() if id(a) not in ids]
        assert not new, f"{what}: arrays placed before the error: {new}"


def test_bad_inputs_are_named_before_anything_is_placed(written, tmp_path):
    _need(2)
    path, _ = written("llama", "fp8_48x32", head=True)
    mesh = make_mesh(2)
    src, hf = fc.read_checkpoint_dir(path), checkpoint.read_hf_config(path)
    for what, spoil, msg in BAD:
        tensors = {k: np.array(v) for k, v in src.items()}
        qc = dict(hf["quantization_config"])
        spoil(tensors, qc)
        bad = str(tmp_path / what.replace(" ", "_"))
        _write(bad, dict(hf, quantization_config=qc), tensors)
        with pytest.raises(fc.Fp8CheckpointError, match=msg):
            with no_new_arrays(what):
                LLAMA.load_hf_checkpoint(bad, mesh)
    strategy = json.loads(json.dumps(ct("channel")))
    strategy["config_groups"]["group_0"]["weights"]["strategy"] = "group"
    _write(str(tmp_path / "group"), dict(hf, quantization_config=strategy), src)
    with pytest.raises(fc.Fp8CheckpointError, match="strategy 'group'"):
        LLAMA.load_hf_checkpoint(str(tmp_path / "group"), mesh)
    with pytest.raises(ValueError, match="quantize must be None or 'fp8'"):
        LLAMA.load_hf_checkpoint(path, mesh, quantize="int4")


def test_blocks_a_shard_cannot_take_are_refused(tmp_path):
    """down's K = 368 over 2 ranks: 184 columns each, blocks of 32 would leave 8-wide ones."""
    config = LlamaConfig.tiny(intermediate_size=368)
    write_fp8(str(tmp_path), LLAMA, config, LAYOUTS["fp8_48x32"])
    with pytest.raises(fc.Fp8CheckpointError, match=r"mlp.down_proj.weight: its scale blocks of "
                       r"32 input columns do not line up with TP=2's shards of 184"):
        with no_new_arrays("blocks"):
            LLAMA.load_hf_checkpoint(str(tmp_path), make_mesh(2))
    LLAMA.load_hf_checkpoint(str(tmp_path), make_mesh(1))  # whole rows: fine


def test_ignore_patterns():
    scheme = fc.Fp8Scheme("compressed-tensors", "channel",
                          ignore=("re:.*lm_head", "re:.*mlp.gate$"))
    assert not scheme.quantized("lm_head") and not scheme.quantized("model.layers.3.mlp.gate")
    assert scheme.quantized("model.layers.3.mlp.gate_proj")


def test_dtype_is_the_compute_dtype_and_projections_stay_fp8(written):
    path, _ = written("qwen3_moe", "fp8_48x32")
    config, params = QWEN3_MOE.load_hf_checkpoint(path, make_mesh(2), dtype="bfloat16")
    assert config.dtype == "bfloat16"
    layer = params["layers"][0]
    for w in (layer["attn"]["qkv"], layer["moe"]["gate_up"], layer["moe"]["down"]):
        assert isinstance(w, Fp8Weight) and w.q.dtype == jnp.float8_e4m3fn
    for a in (params["embed"], params["lm_head"], layer["moe"]["router"],
              layer["attn"]["q_norm"]["weight"], layer["input_norm"]["weight"]):
        assert a.dtype == jnp.bfloat16


def test_the_command_line_names_fp8_weights_and_a_bad_checkpoint_in_one_line(written, tmp_path,
                                                                              capsys):
    """models.generate: an FP8 checkpoint's banner says weights=fp8; a bad one is one `error:`
    line and exit 2 (the CLI's contract), not a traceback."""
    from models import generate

    path, _ = written("llama", "ct_channel")
    assert generate.main(["--checkpoint", path, "--tokens", "2", "--allreduce", "psum",
                          "--no-warmup", "--no-compile-cache"]) == 0
    assert "weights=fp8" in capsys.readouterr().out.splitlines()[0]
    tensors = {k: np.array(v) for k, v in fc.read_checkpoint_dir(path).items()}
    tensors.pop("model.layers.0.mlp.down_proj.weight_scale")
    _write(str(tmp_path / "bad"), checkpoint.read_hf_config(path), tensors)
    assert generate.main(["--checkpoint", str(tmp_path / "bad"), "--tokens", "2",
                          "--no-warmup"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --checkpoint") and err.count("\n") == 1
    assert "down_proj.weight_scale: missing" in err


def test_float8_tensors_without_a_quantization_config_are_named(written, tmp_path):
    path, _ = written("llama", "ct_channel")
    hf = checkpoint.read_hf_config(path)
    hf.pop("quantization_config")
    _write(str(tmp_path / "noqc"), hf, fc.read_checkpoint_dir(path))
    with pytest.raises(ValueError, match="F8_E4M3 tensor read as a dense weight"):
        LLAMA.load_hf_checkpoint(str(tmp_path / "noqc"), make_mesh(1))


def test_per_channel_scales_as_a_vector_read_as_a_column():
    """transformers reshapes a [N] per-channel weight_scale to [N, 1]; so do we."""
    q = np.asarray(np.random.default_rng(0).uniform(-4, 4, (6, 32)), E4M3)
    s = np.random.default_rng(1).uniform(0.5, 2, (6,)).astype(np.float32)
    scheme = fc.parse_quantization_config({"quantization_config": ct("channel")})
    _, col, block = fc.read_fp8_weight({"m.weight": q, "m.weight_scale": s[:, None]}, "m", scheme)
    _, vec, _ = fc.read_fp8_weight({"m.weight": q, "m.weight_scale": s}, "m", scheme)
    assert vec.shape == (6, 1) and np.array_equal(vec, col) and block == (1, 32)


def test_quantizing_another_familys_params_is_named():
    from models import quantize_params

    config = LlamaConfig.tiny()
    params = LLAMA.random_params(config, make_mesh(1))
    with pytest.raises(ValueError, match="another family"):
        quantize_params(params, QWEN3_MOE)


def test_the_package_level_functions_follow_the_family(written):
    """models.load_hf_checkpoint / random_params pick the family from the checkpoint / config."""
    import models
    from models.weights.types import is_quantized

    path, _ = written("qwen3_moe", "ct_channel")
    config, params = models.load_hf_checkpoint(path, make_mesh(1))
    assert isinstance(config, Qwen3MoeConfig) and is_quantized(params)
    assert is_quantized(models.random_params(config, make_mesh(1), quantize="fp8"))
