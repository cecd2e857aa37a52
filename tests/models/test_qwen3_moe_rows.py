"""The Qwen3-MoE family's bf16 projections held as rows (models.to_rows, RowWeight): the
attention's as Llama's, the expert stacks with their expert dim kept first (gate_up
[E, 2, I, H], down [E, H, I]: the op's [E, 2I, H] and [E, H, I] as they lie). The XLA step and
prefill read the same rows (model.experts, both moe_impls and the many-token path), and so
does the persistent step (sifar_jax.qwen3_moe_step; on the CPU its C++ reference).

What is equal: the rows and from_rows are bit for bit the dense weights; the persistent step on
rows is bit for bit the same step on dense weights (which it transposes to the same rows in
each step), up to the float32 sums of an untied head inside the op against XLA's; the XLA
forward on rows is the dense forward's products with XLA:CPU's sums in another order, so
within float rounding, not bit for bit. Measured 2026-12-07 on the CPU, model.experts on rows
against dense, of the largest output: float32 (qwen3_moe_tiny) 2.2e-7 at 1 and 3 tokens, equal
at 16 (the many-token path); bf16 (qwen3_moe_step_tiny) equal at these seeds. Through the
decoder in bf16 one intermediate rounded the other way changes the logits by up to ~1.2e-2 of
the largest at some sequence seeds (none at seed 4), so the bound is 1e-2 at seed 4, as in
test_row_weights.py; float32: 1e-5.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sifar_jax
from models import Decoder, from_rows, generate, make_mesh, to_rows
from models.decoder import step_choice
from models.decoder.options import DecodeOptions
from models.llama import step as llama_step
from models.qwen3_moe import model as moe_model
from models.qwen3_moe import step as moe_step
from models.registry import FAMILIES
from models.weights.types import RowWeight, is_projection

QWEN = FAMILIES["qwen3_moe"]
BOUND = 1e-2  # of the largest logit: the XLA forward on bf16 rows against dense (see above)


@pytest.fixture(scope="module")
def tiny():
    cfg = QWEN.preset("qwen3_moe_tiny")  # float32
    mesh = make_mesh(1)
    return cfg, mesh, QWEN.random_params(cfg, mesh, seed=3)


@pytest.fixture(scope="module")
def step_tiny():
    cfg = QWEN.preset("qwen3_moe_step_tiny")  # bf16, the persistent step's shapes
    mesh = make_mesh(1)
    return cfg, mesh, QWEN.random_params(cfg, mesh, seed=2)


def _rows_of(params):
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_projection)[0]
    return {jax.tree_util.keystr(p): w for p, w in flat if isinstance(w, RowWeight)}


def _decoder(cfg, mesh, params, step, **kw):
    return Decoder(cfg, mesh, params, DecodeOptions(kv_layout="bhsd", step=step, **kw))


def test_rows_hold_the_dense_weights_and_go_back_exactly(tiny):
    cfg, mesh, params = tiny
    rows = to_rows(params, cfg)
    assert len(_rows_of(rows)) == 4 * cfg.num_layers + 1  # qkv, o, gate_up, down; the head
    moe, dense = rows["layers"][0]["moe"], params["layers"][0]["moe"]
    assert not isinstance(moe["router"], RowWeight)  # the router stays [H, E]
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    gu, dn = moe["gate_up"], moe["down"]
    assert (gu.w.shape, gu.n_in, dn.w.shape, dn.n_in) == ((e, 2, i, h), 1, (e, h, i), 1)
    np.testing.assert_array_equal(np.asarray(gu.w), np.transpose(dense["gate_up"], (0, 2, 3, 1)))
    np.testing.assert_array_equal(np.asarray(dn.w), np.transpose(dense["down"], (0, 2, 1)))
    # the op's gate_up [E, 2I, H]: per expert its gate rows, then its up rows
    op_gu, _ = moe_step._rows(gu, 1, stack=True)
    np.testing.assert_array_equal(np.asarray(op_gu[3, i + 5]),
                                  np.asarray(dense["gate_up"][3, :, 1, 5]))
    back = from_rows(rows, cfg)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert QWEN.dense_shapes(rows) == QWEN.dense_shapes(params)
    layout = QWEN.layout(cfg, 1)
    assert QWEN.step_weight_bytes(layout, rows) == QWEN.step_weight_bytes(layout, params)
    a, b = QWEN.to_hf_tensors(rows, cfg), QWEN.to_hf_tensors(params, cfg)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_rows_stay_sharded_where_they_lie():
    """TP=2: each expert stack split on I as the dense one is (gate_up's dim 2 of [E, 2, I, H],
    down's dim 2 of [E, H, I]), each shard the dense shard's transpose; the bytes a rank holds
    are the dense model's; the XLA step reads the rows to the dense model's logits."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    cfg, mesh = QWEN.preset("qwen3_moe_tiny"), make_mesh(2)
    params = QWEN.random_params(cfg, mesh, seed=4)
    rows = to_rows(params, cfg)
    moe = rows["layers"][0]["moe"]
    assert moe["gate_up"].w.sharding.spec == P(None, None, "tp", None)
    assert moe["down"].w.sharding.spec == P(None, None, "tp")
    for name, perm in (("gate_up", (0, 2, 3, 1)), ("down", (0, 2, 1))):
        shards = moe[name].w.addressable_shards
        assert shards[0].data.shape[2] == cfg.moe_intermediate_size // 2
        for got, want in zip(shards, params["layers"][0]["moe"][name].addressable_shards):
            np.testing.assert_array_equal(np.asarray(got.data),
                                          np.transpose(np.asarray(want.data), perm))
    assert QWEN.local_bytes(rows, 2) == QWEN.local_bytes(params, 2)
    seq = np.random.default_rng(1).integers(0, cfg.vocab_size, 6, dtype=np.int32)
    want = _decoder(cfg, mesh, params, "xla").teacher_forced_logits(seq[None])[0]
    got = _decoder(cfg, mesh, rows, "xla").teacher_forced_logits(seq[None])[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    back = from_rows(rows, cfg)
    assert back["layers"][0]["moe"]["down"].sharding.spec == P(None, "tp", None)


def test_to_rows_donating_holds_one_weight_twice_at_most(peak_live_bytes):
    """donate=True: one weight per jit (an expert stack whole), each einsum-layout weight
    deleted once its rows exist: the live bytes never exceed those before the call plus the
    largest projection."""
    cfg, mesh = QWEN.preset("qwen3_moe_step_tiny", num_layers=3), make_mesh(1)
    params = QWEN.random_params(cfg, mesh, seed=8)
    largest = max(a.nbytes for a in jax.tree.leaves(params))
    before, peak, rows = peak_live_bytes(lambda: to_rows(params, cfg, donate=True))
    assert isinstance(rows["layers"][2]["moe"]["down"], RowWeight)
    assert params["layers"][2]["moe"]["gate_up"].is_deleted()
    assert before < peak <= before + largest, (peak, before, largest)


def test_to_rows_errors(tiny):
    cfg, mesh, params = tiny
    fp8 = QWEN.random_params(cfg, mesh, seed=1, quantize="fp8")
    with pytest.raises(ValueError, match="already in the kernels' output-major layout"):
        to_rows(fp8, cfg)
    rows = to_rows(params, cfg)
    assert to_rows(rows, cfg)["layers"][0]["moe"]["gate_up"] is rows["layers"][0]["moe"][
        "gate_up"]  # rows stay as they are


@pytest.mark.parametrize("impl", ["gather", "matvec"])
@pytest.mark.parametrize("tokens", [1, 3, 16])  # 16 x top-2 >= 8 experts: the many-token path
def test_experts_on_rows_are_the_dense_products(tiny, impl, tokens):
    """model.experts on RowWeight stacks against the dense stacks (float32): the same products,
    XLA:CPU's sums in another order. "matvec" takes the gather path for rows (its kernel reads
    [E, K, N] weights): bit for bit "gather"'s on rows."""
    cfg, _, params = tiny
    moe, rmoe = params["layers"][1]["moe"], to_rows(params, cfg)["layers"][1]["moe"]
    x = jax.random.normal(jax.random.key(tokens), (tokens, cfg.hidden_size), jnp.float32)
    weights, ids = moe_model.route(x, moe["router"], cfg.num_experts_per_tok, True)
    want = moe_model.experts(x, weights, ids, moe["gate_up"], moe["down"], impl)
    got = moe_model.experts(x, weights, ids, rmoe["gate_up"], rmoe["down"], impl)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    gathered = moe_model.experts(x, weights, ids, rmoe["gate_up"], rmoe["down"], "gather")
    np.testing.assert_array_equal(got, gathered)


def test_xla_step_and_prefill_on_bf16_rows(step_tiny):
    cfg, mesh, params = step_tiny
    rows = to_rows(params, cfg)
    seq = np.random.default_rng(4).integers(0, cfg.vocab_size, 12, dtype=np.int32)
    for impl in ("gather", "matvec"):
        c = cfg.replace(moe_impl=impl)
        want = _decoder(c, mesh, params, "xla").teacher_forced_logits(seq[None])[0]
        got = _decoder(c, mesh, rows, "xla").teacher_forced_logits(seq[None])[0]
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, atol=BOUND * np.abs(want).max())
    # a prefill of 8 tokens (the many-token path), then steps
    np.testing.assert_array_equal(_decoder(cfg, mesh, params, "xla").generate(seq[:8], 8),
                                  _decoder(cfg, mesh, rows, "xla").generate(seq[:8], 8))


@pytest.mark.parametrize("tie", [True, False])
def test_persistent_step_on_rows_is_the_step_on_dense_weights(tie, monkeypatch):
    """The op's rows are the same on both: tied (the head in XLA on both), the logits are equal
    bit for bit; untied, the rows' head runs inside the op (bf16 rows, float32 sums) and the
    dense model's in XLA: the hidden states and cache equal bit for bit, the logits within the
    float32 sums' order."""
    cfg = QWEN.preset("qwen3_moe_step_tiny", tie_word_embeddings=tie)
    mesh = make_mesh(1)
    params = QWEN.random_params(cfg, mesh, seed=5)
    rows = to_rows(params, cfg)
    seq = np.random.default_rng(4).integers(0, cfg.vocab_size, 8, dtype=np.int32)
    seen, real = [], sifar_jax.qwen3_moe_step

    def spy(*a, **k):
        out = real(*a, **k)
        seen.append((a[4][0].gate_up.dtype, k.get("head")))
        jax.debug.callback(lambda h: hs.append(np.asarray(h)), out[0])
        return out

    monkeypatch.setattr(sifar_jax, "qwen3_moe_step", spy)
    out = {}
    for name, p in (("rows", rows), ("dense", params)):
        hs = []
        dec = _decoder(cfg, mesh, p, "persistent")
        assert dec.step_kind == "persistent", dec.step_reason
        logits = dec.teacher_forced_logits(seq[None])[0]
        jax.effects_barrier()
        out[name] = logits, np.stack(hs), np.asarray(dec.state["cache"], np.float32)
    assert seen[0][0] == jnp.bfloat16 and (seen[0][1] is None) == tie
    for a, b in zip(out["rows"][1:], out["dense"][1:]):
        np.testing.assert_array_equal(a, b)
    if tie:
        np.testing.assert_array_equal(out["rows"][0], out["dense"][0])
    else:
        assert seen[0][1][0].dtype == jnp.bfloat16  # the head streamed inside the op
        np.testing.assert_allclose(out["rows"][0], out["dense"][0], rtol=0,
                                   atol=1e-5 * np.abs(out["dense"][0]).max())


def test_dense_bf16_on_a_gpu_says_how_to_hold_rows(step_tiny, monkeypatch):
    """Where the kernel would run (backend_reason None, the CPU reference not asked for: a GPU's
    view), dense bf16 projections are refused naming models.to_rows and rows are taken; the
    step's prepare_params (llama.rows_for_step) then moves them to rows in place."""
    cfg, mesh, _ = step_tiny
    params = QWEN.random_params(cfg, mesh, seed=6)
    monkeypatch.setattr(llama_step, "backend_reason", lambda mesh, reference=False: None)
    opts = DecodeOptions(kv_layout="bhsd", step="auto").resolve(mesh)
    layout = QWEN.layout(cfg, 1)
    why = moe_step.reason(QWEN, layout, mesh, opts, params)
    assert why and "models.to_rows" in why and "einsum layout" in why, why
    assert moe_step.reason(QWEN, layout, mesh, opts, to_rows(params, cfg)) is None
    qkv = params["layers"][0]["attn"]["qkv"]
    out = step_choice.params_for_step(QWEN, cfg, mesh, opts, params)
    assert isinstance(out["layers"][1]["moe"]["gate_up"], RowWeight)
    assert qkv.is_deleted()  # donated: one copy of the weights


def test_params_for_step_rows_for_the_cpu_reference(step_tiny):
    """step="persistent" on host devices: rows, as for Llama (the CPU reference would transpose
    dense weights in every step); the XLA step and "auto" on a CPU: the params untouched."""
    cfg, mesh, _ = step_tiny
    params = QWEN.random_params(cfg, mesh, seed=7)
    for step in ("xla", "auto"):
        opts = DecodeOptions(kv_layout="bhsd", step=step)
        assert step_choice.params_for_step(QWEN, cfg, mesh, opts, params) is params
    out = step_choice.params_for_step(QWEN, cfg, mesh, DecodeOptions(kv_layout="bhsd",
                                                                     step="persistent"), params)
    assert len(_rows_of(out)) == 4 * cfg.num_layers + 1


def test_generate_step_persistent_on_rows(capsys, monkeypatch):
    """models.generate --step persistent on a bf16 Qwen3-MoE preset: the op runs on rows (the
    CLI moved the projections), the tokens are --step xla's."""
    seen, real = [], sifar_jax.qwen3_moe_step
    monkeypatch.setattr(sifar_jax, "qwen3_moe_step",
                        lambda *a, **k: seen.append(a[4][0].gate_up.dtype) or real(*a, **k))
    moved, real_prepare = [], moe_step.PERSISTENT.prepare_params

    def prepare(*a, **k):
        out = real_prepare(*a, **k)
        moved.append(isinstance(out["layers"][0]["moe"]["gate_up"], RowWeight))
        return out

    monkeypatch.setattr(moe_step.PERSISTENT, "prepare_params", prepare)
    argv = ["--preset", "qwen3_moe_step_tiny", "--tokens", "6", "--no-warmup",
            "--allreduce", "psum"]
    toks = {}
    for step in ("persistent", "xla"):
        assert generate.main(argv + ["--step", step]) == 0
        lines = capsys.readouterr().out.splitlines()
        toks[step] = [ln for ln in lines if ln.startswith("tokens:")][0]
    assert seen and seen[0] == jnp.bfloat16 and moved[0] is True
    assert toks["persistent"] == toks["xla"] and len(toks["xla"].split()) == 1 + 6


def test_bench_to_rows_on_a_qwen3_moe_preset(tmp_path):
    """bench.decode --to-rows on a Qwen3-MoE preset: the XLA and persistent rows run on rows;
    the records say so and a step reads the dense model's bytes."""
    from bench import decode as bd

    args = ["--preset", "qwen3_moe_step_tiny", "--quick", "--tp", "1", "--batch", "1",
            "--context", "256", "--loops", "pipelined", "--no-sweep", "--allreduce", "psum",
            "--fused", "off", "--baselines", "none", "--no-trace"]
    assert bd.main(args + ["--to-rows", "--step", "both", "--out", str(tmp_path / "rows")]) == 0
    assert bd.main(args + ["--out", str(tmp_path / "dense")]) == 0
    recs = json.loads(next((tmp_path / "rows").glob("decode-rows-*.json")).read_text())
    (dense,) = json.loads(next((tmp_path / "dense").glob("decode-*.json")).read_text())
    assert {r["step"] for r in recs} == {"xla", "persistent"}
    assert all(r["weight_layout"] == "rows" and "skipped" not in r for r in recs), recs
    assert dense["weight_layout"] == "einsum"
    assert all(r["weights_bytes_per_rank"] == dense["weights_bytes_per_rank"] for r in recs)
