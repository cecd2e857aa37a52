"""Dense projections held as rows (models.to_rows, quant.RowWeight): the [N, K] layout the
persistent step streams, read by the XLA step and prefill too, so a bf16 decoder holds one copy
of its weights for both steps. On the CPU the persistent step runs the op's C++ reference (as
step="persistent" asks on host devices, test_persistent.py); on a GPU the kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sifar_jax
from models import Decoder, from_rows, make_mesh, to_rows
from models.decoder import step_choice
from models.decoder.options import DecodeOptions
from models.llama import step as persistent
from models.registry import FAMILIES
from models.weights.types import RowWeight, is_projection

LLAMA = FAMILIES["llama"]
# Of the largest logit over 12 teacher-forced steps: the persistent step (bf16 rows) against
# the XLA step on the same rows. Measured on the CPU reference, 2026-12-06: 0.69e-2 (the
# FP8 step's bound in test_persistent.py, which this config's roundings are the same kind of).
BOUND = 2e-2


def _config(**kw):
    base = dict(dtype="bfloat16", hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128,
                intermediate_size=512, num_layers=2, vocab_size=512, max_seq_len=64)
    base.update(kw)
    return LLAMA.preset("tiny", **base)


@pytest.fixture(scope="module")
def dense():
    cfg = _config()
    mesh = make_mesh(1)
    return cfg, mesh, LLAMA.random_params(cfg, mesh, seed=2)


def _decoder(cfg, mesh, params, step):
    return Decoder(cfg, mesh, params, DecodeOptions(kv_layout="bhsd", step=step))


def _projections(params):
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_projection)[0]
    return {jax.tree_util.keystr(p): w for p, w in flat if isinstance(w, RowWeight)}


def test_rows_hold_the_dense_weights_and_go_back_exactly(dense):
    cfg, mesh, params = dense
    rows = to_rows(params, cfg)
    held = _projections(rows)
    # every layer's qkv, o, gate_up and down, and the LM head
    assert len(held) == 4 * cfg.num_layers + 1, sorted(held)
    qkv = rows["layers"][0]["attn"]["qkv"]
    dense_qkv = np.asarray(params["layers"][0]["attn"]["qkv"], np.float32)  # [H, KV, G+2, D]
    np.testing.assert_array_equal(np.asarray(qkv.w, np.float32),
                                  np.transpose(dense_qkv, (1, 2, 3, 0)))
    assert qkv.rows().shape == (dense_qkv.size // cfg.hidden_size, cfg.hidden_size)
    back = from_rows(rows, cfg)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # the sizes and shapes the decoder plans with are the dense model's
    assert LLAMA.dense_shapes(rows) == LLAMA.dense_shapes(params)
    assert (LLAMA.step_weight_bytes(LLAMA.layout(cfg, 1), rows)
            == LLAMA.step_weight_bytes(LLAMA.layout(cfg, 1), params))


def test_rows_stay_sharded_where_they_lie():
    """TP=2 on the CPU's devices: each RowWeight is split on the dim the einsum weight was
    (the output dims for qkv and gate_up, the contracted one for o and down), each shard the
    dense shard's transpose, and the XLA step reads the rows to the dense model's logits."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    cfg = _config()
    mesh = make_mesh(2)
    params = LLAMA.random_params(cfg, mesh, seed=4)
    rows = to_rows(params, cfg)
    layer = rows["layers"][0]
    assert tuple(layer["attn"]["qkv"].w.sharding.spec)[0] == "tp"  # KV heads, the first out dim
    assert tuple(layer["mlp"]["down"].w.sharding.spec)[-1] == "tp"  # FFN, the contracted dim
    from jax.sharding import PartitionSpec as P

    # o [H, heads, D] split on its heads (the einsum weight's first dim), gate_up [2, F, H]
    # on F; the shards are the dense shards transposed
    assert layer["attn"]["o"].w.sharding.spec == P(None, "tp", None)
    assert layer["mlp"]["gate_up"].w.sharding.spec == P(None, "tp", None)
    for name, group in (("o", "attn"), ("gate_up", "mlp")):
        for got, want in zip(layer[group][name].w.addressable_shards,
                             params["layers"][0][group][name].addressable_shards):
            w = np.asarray(want.data, np.float32)
            n_in = layer[group][name].n_in
            np.testing.assert_array_equal(
                np.asarray(got.data, np.float32),
                np.transpose(w, tuple(range(n_in, w.ndim)) + tuple(range(n_in))))
    seq = np.random.default_rng(1).integers(0, cfg.vocab_size, 6, dtype=np.int32)
    want = _decoder(cfg, mesh, params, "xla").teacher_forced_logits(seq[None])[0]
    got = _decoder(cfg, mesh, rows, "xla").teacher_forced_logits(seq[None])[0]
    np.testing.assert_allclose(got, want, atol=1e-2 * np.abs(want).max())


def test_xla_step_on_rows_is_the_dense_step(dense):
    """The XLA prefill and step read rows as einsums in the stored dim order: the same products
    (the same sums up to their order) as on the einsum-layout weights."""
    cfg, mesh, params = dense
    seq = np.random.default_rng(3).integers(0, cfg.vocab_size, 12, dtype=np.int32)
    want = _decoder(cfg, mesh, params, "xla").teacher_forced_logits(seq[None])[0]
    got = _decoder(cfg, mesh, to_rows(params, cfg), "xla").teacher_forced_logits(seq[None])[0]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-2 * np.abs(want).max())
    np.testing.assert_array_equal(
        _decoder(cfg, mesh, params, "xla").generate(seq[:4], 8),
        _decoder(cfg, mesh, to_rows(params, cfg), "xla").generate(seq[:4], 8))


def test_persistent_step_on_bf16_rows(dense, monkeypatch):
    cfg, mesh, params = dense
    rows = to_rows(params, cfg)
    seq = np.random.default_rng(5).integers(0, cfg.vocab_size, 12, dtype=np.int32)
    ref = _decoder(cfg, mesh, rows, "xla")
    want = ref.teacher_forced_logits(seq[None])[0]
    calls, real = [], sifar_jax.llama_step
    heads = []

    def spy(*a, **k):
        calls.append(1)
        heads.append(k.get("head"))
        return real(*a, **k)

    monkeypatch.setattr(sifar_jax, "llama_step", spy)
    dec = _decoder(cfg, mesh, rows, "persistent")
    assert dec.step_kind == "persistent", dec.step_reason
    got = dec.teacher_forced_logits(seq[None])[0]
    assert calls, "the persistent step did not run"
    assert heads[0] is not None and heads[0][0].dtype == jnp.bfloat16  # the head inside the op
    assert np.isfinite(got).all()
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 0 < err <= BOUND, err
    # greedy tokens equal up to the first near-tie: a step whose top-2 margin (the XLA step's
    # logits on the same tokens) is within BOUND, which bf16 roundings may break either way
    # (on one H100, 2026-12-06: the 10th token differed)
    got, want = dec.generate(seq[:4], 10)[0], ref.generate(seq[:4], 10)[0]
    diff = np.flatnonzero(got != want)
    if diff.size:
        lx = ref.teacher_forced_logits(np.concatenate([seq[:4], want[:diff[0]]])[None])[0][-1]
        top = np.sort(lx)[-2:]
        assert top[1] - top[0] <= BOUND * np.abs(lx).max(), (diff[0], top, np.abs(lx).max())


def test_nothing_compiles_after_warmup_on_rows(dense, monkeypatch):
    """Decoder.warmup compiles the persistent step on rows with the prefills: streams within
    its limits compile nothing more and trace no further step."""
    cfg, mesh, params = dense
    calls, real = [], sifar_jax.llama_step
    monkeypatch.setattr(sifar_jax, "llama_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    dec = _decoder(cfg, mesh, to_rows(params, cfg), "persistent")
    dec.warmup(8, 24, loops=("stream",))
    traced = len(calls)
    assert traced
    rng = np.random.default_rng(2)
    for n in (3, 8):
        assert len(list(dec.stream(rng.integers(0, cfg.vocab_size, n, dtype=np.int32), 24))) == 24
    assert dec.compiles_after_warmup == 0 and len(calls) == traced


def test_dense_weights_say_how_to_hold_rows(dense):
    cfg, mesh, params = dense
    opts = DecodeOptions(kv_layout="bhsd", step="persistent").resolve(mesh)
    why = persistent.reason(LLAMA, LLAMA.layout(cfg, 1), mesh, opts, params, reference=True)
    assert why and "models.to_rows" in why, why
    with pytest.raises(ValueError, match="models.to_rows"):
        Decoder(cfg, mesh, params, opts)
    assert persistent.reason(LLAMA, LLAMA.layout(cfg, 1), mesh, opts, to_rows(params, cfg),
                             reference=True) is None


def test_params_for_step_moves_only_what_the_step_will_read():
    """The CLI's conversion (step_choice.params_for_step, the persistent step's rows_for_step):
    rows where step="persistent" (or "auto", on a GPU) would then run, the params untouched
    otherwise (the XLA step asked, "auto" on a CPU, or a step that declines for another
    reason)."""
    cfg, mesh = _config(), make_mesh(1)
    params = LLAMA.random_params(cfg, mesh, seed=6)
    xla = DecodeOptions(kv_layout="bhsd", step="xla")
    assert step_choice.params_for_step(LLAMA, cfg, mesh, xla, params) is params
    if jax.devices()[0].platform != "gpu":  # "auto" never runs the CPU reference
        auto = DecodeOptions(kv_layout="bhsd", step="auto")
        assert step_choice.params_for_step(LLAMA, cfg, mesh, auto, params) is params
    bshd = DecodeOptions(kv_layout="bshd", step="persistent")
    assert step_choice.params_for_step(LLAMA, cfg, mesh, bshd, params) is params
    qkv = params["layers"][0]["attn"]["qkv"]
    want = np.transpose(np.asarray(qkv, np.float32), (1, 2, 3, 0))
    out = step_choice.params_for_step(LLAMA, cfg, mesh, DecodeOptions(kv_layout="bhsd",
                                                                      step="persistent"), params)
    assert isinstance(out["layers"][0]["attn"]["qkv"], RowWeight)
    np.testing.assert_array_equal(np.asarray(out["layers"][0]["attn"]["qkv"].w, np.float32), want)
    assert qkv.is_deleted()  # donated: one copy of the weights


def test_to_rows_donating_holds_one_weight_twice_at_most(peak_live_bytes):
    """donate=True converts one weight per jit and deletes it once its rows exist: the live
    bytes never exceed those before the call plus the largest projection."""
    cfg, mesh = _config(num_layers=4), make_mesh(1)
    params = LLAMA.random_params(cfg, mesh, seed=7)
    largest = max(a.nbytes for a in jax.tree.leaves(params))
    before, peak, rows = peak_live_bytes(lambda: to_rows(params, cfg, donate=True))
    assert isinstance(rows["layers"][3]["mlp"]["down"], RowWeight)
    assert before < peak <= before + largest, (peak, before, largest)


def test_to_rows_errors(dense):
    cfg, mesh, params = dense
    fp8 = LLAMA.random_params(cfg, mesh, seed=1, quantize="fp8")
    with pytest.raises(ValueError, match="already in the kernels' output-major layout"):
        to_rows(fp8, cfg)
    from models import quantize_params

    with pytest.raises(ValueError, match="from_rows first"):
        quantize_params(to_rows(params, cfg), cfg)


def test_save_of_rows_is_the_dense_checkpoint(dense, tmp_path):
    cfg, _, params = dense
    LLAMA.save_hf_checkpoint(to_rows(params, cfg), cfg, str(tmp_path / "rows"))
    LLAMA.save_hf_checkpoint(params, cfg, str(tmp_path / "dense"))
    from safetensors.numpy import load_file

    a = load_file(str(tmp_path / "rows" / "model.safetensors"))
    b = load_file(str(tmp_path / "dense" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_hf_tensors_of_rows_are_the_dense_ones(dense):
    cfg, _, params = dense
    a, b = LLAMA.to_hf_tensors(to_rows(params, cfg), cfg), LLAMA.to_hf_tensors(params, cfg)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.skipif(jax.devices()[0].platform != "gpu",
                    reason="GPU only: XLA:CPU's dot emitter transposes qkv and gate_up back to "
                           "the einsum layout on every step (measured 2026-12-06)")
def test_gpu_xla_step_reads_rows_in_place(dense):
    """The XLA step's optimised HLO on rows writes no array of any projection's shape (stored
    or einsum, 3-D or 2-D, bf16 or float32) outside the fusions that read it: the weights are
    read where they lie, never transposed or copied into a buffer of their own."""
    from models.decoder import hlo

    cfg, mesh, params = dense
    rows = to_rows(params, cfg)
    dec = _decoder(cfg, mesh, rows, "xla")
    dec.reset(16)
    dec.step(np.array([1]))
    text = dec.compiled_step().as_text()
    shapes = set()
    for w in _projections(rows).values():
        n, k = w.rows().shape
        for dims in (w.w.shape, tuple(w.in_dims) + tuple(w.out_dims), (n, k), (k, n)):
            shapes.update(hlo.hlo_shape(dt, dims) for dt in (w.dtype, jnp.float32))
    found = {s: hlo.cache_copies(text, s) for s in shapes}
    assert not any(found.values()), {s: f for s, f in found.items() if f}
