"""DecodeOptions (how a decoder runs, one frozen value), the Decoder's constructor, and the
size rules of models/ (no function or class over 80 lines; the Decoder facade at most 250)."""

import ast
import inspect
import pathlib

import pytest

from models import Decoder, LlamaConfig, make_mesh, random_params
from models.decoder.options import DecodeOptions

MODELS = pathlib.Path(__file__).resolve().parents[2] / "models"


def test_platform_defaults_are_resolved_once():
    mesh = make_mesh(1)
    opts = DecodeOptions()
    assert not opts.resolved and (opts.kv_layout, opts.gemm_rows, opts.attn_impl) == (None,) * 3
    cpu = opts.resolve(mesh)
    assert cpu.resolved and (cpu.kv_layout, cpu.gemm_rows, cpu.attn_impl) == ("bshd", 1, "xla")
    assert cpu.resolve(mesh) is cpu
    mine = DecodeOptions(kv_layout="bhsd", gemm_rows=2, attn_impl="pallas")
    assert mine.resolve(mesh) is mine  # given values are kept


def test_options_are_frozen_hashable_and_checked():
    opts = DecodeOptions(compiler_options={"b": 2, "a": 1})
    assert opts.compiler_options == (("a", 1), ("b", 2)) and opts.xla_options() == {"a": 1, "b": 2}
    assert DecodeOptions().xla_options() is None
    assert hash(opts) == hash(DecodeOptions(compiler_options={"a": 1, "b": 2}))
    with pytest.raises(AttributeError):
        opts.allreduce = "sifar"
    for bad, match in [(dict(allreduce="nccl"), "allreduce must be one of"),
                       (dict(slot_bytes=4096), "slot_bytes"),
                       (dict(prefetch_bytes=4096), "prefetch_bytes"),
                       (dict(gemm_rows=0), "gemm_rows"), (dict(batch_size=0), "batch_size"),
                       (dict(kv_layout="sbhd"), "kv_layout"), (dict(attn_impl="x"), "attn_impl")]:
        with pytest.raises(ValueError, match=match):
            DecodeOptions(**bad)


def test_the_decoder_takes_options_and_three_keywords():
    params = inspect.signature(Decoder.__init__).parameters
    assert len(params) - 1 <= 8  # without self
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
    assert {"options", "allreduce", "batch_size", "max_seq_len"} <= set(params)
    config, mesh = LlamaConfig.tiny(), make_mesh(1)
    dec = Decoder(config, mesh, random_params(config, mesh, seed=1),
                  DecodeOptions(batch_size=3, gemm_rows=2), batch_size=2, max_seq_len=64)
    assert (dec.options.batch_size, dec.batch_size, dec.max_seq_len) == (2, 2, 64)
    assert (dec.gemm_rows, dec.kv_layout, dec.options.resolved) == (2, "bshd", True)
    assert dec.layout.tp == 1 and dec.layout.shapes == config


def _lengths():
    for path in sorted(MODELS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = path.relative_to(MODELS).as_posix()
                yield f"{name}:{node.name}", node.end_lineno - node.lineno + 1


def test_no_function_or_class_in_models_is_over_80_lines_and_the_facade_over_250():
    facade = "decoder/decoder.py:Decoder"
    lengths = dict(_lengths())
    assert 0 < lengths[facade] <= 250
    long = {name: n for name, n in lengths.items() if n > 80 and name != facade}
    assert not long, long
