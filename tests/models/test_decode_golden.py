"""Tokens and logits of every decoder variant (psum, sifar, sifar_buffers, fused; both KV
layouts; gemm_rows 2; Pallas attention; unpacked params; batch 2 with prompts of different
lengths; the MoE's matvec and gather experts) and every loop equal, bit for bit, those that the
code before the options object (commit 71ea98f) recorded in data/decode_golden.npz
(tests/models/decode_golden.py wrote it)."""

import os

import numpy as np
import pytest

import sifar_jax
from tests.models import decode_golden

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "decode_golden.npz")


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as f:
        return dict(f)


@pytest.mark.parametrize("name", sorted(decode_golden.VARIANTS))
def test_variant_equals_recorded(golden, name):
    try:
        got = decode_golden.run_variant(name)
    finally:
        sifar_jax.shutdown()
    want = {k: v for k, v in golden.items() if k.startswith(name + "/")}
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        np.testing.assert_array_equal(np.asarray(got[key]), value, err_msg=key)


def test_recording_covers_every_loop_and_kind():
    kinds = {opts.get("allreduce", "psum") for _, _, opts, _ in decode_golden.VARIANTS.values()}
    assert kinds == {"psum", "sifar", "sifar_buffers"}
    assert any(opts.get("fused") for _, _, opts, _ in decode_golden.VARIANTS.values())
    assert {opts.get("kv_layout", "bshd") for *_, opts, _ in decode_golden.VARIANTS.values()} == {
        "bshd", "bhsd"}
    assert set(decode_golden.LOOPS) == {"sync", "stream", "pipelined", "on_device"}
