"""sifar_jax.decode_step's limits and workspace size against what the op itself enforces.

The Python layer reads them from the extension (ffi/step/llama_step.h, StepWorkspace in
llama_step.cc); these tests call the op (the CPU backend) around each value, so a value Python
checks against that differs from the one the op checks fails here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sifar_jax
from sifar_jax import _ext, decode_step
from sifar_jax.decode_step import HEAD_DIM, LlamaLayer

H, F, S = 256, 256, 16  # hidden, FFN width, cache length: the smallest shapes the op takes


def _model(kv_heads: int, group: int, layers: int, seed: int = 0):
    """Operands of a bf16 model (x, rope, pos, final_norm, layers, cache)."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return jnp.asarray(rng.uniform(-0.05, 0.05, shape), jnp.bfloat16)

    one = jnp.ones((1,), jnp.float32)
    norm = jnp.ones((H,), jnp.bfloat16)
    q = kv_heads * group * HEAD_DIM
    blocks = [LlamaLayer(norm, w(kv_heads * (group + 2) * HEAD_DIM, H), one, w(H, q), one, norm,
                         w(2 * F, H), one, w(H, F), one) for _ in range(layers)]
    angle = rng.uniform(0, 3, HEAD_DIM).astype(np.float32)
    rope = jnp.asarray(np.stack([np.cos(angle), np.sin(angle)]))
    cache = jnp.zeros((layers, 2, 1, kv_heads, S, HEAD_DIM), jnp.bfloat16)
    return w(H), rope, jnp.asarray([3, 0], jnp.int32), norm, blocks, cache


def _raw_call(operands, *, workspace: int, layers: int, kv_heads: int, group: int,
              ranks: int = 1, timeout_ns: int = 10**9):
    """The FFI target with the given attributes and workspace size, none of sifar_jax's own
    checks in between."""
    x, rope, pos, fnorm, blocks, cache = operands
    flat = [x, rope, pos, fnorm, *[a for b in blocks for a in b], cache]
    call = jax.ffi.ffi_call(
        _ext.TARGETS.llama_step,
        (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(cache.shape, cache.dtype),
         jax.ShapeDtypeStruct((workspace,), jnp.uint8), jax.ShapeDtypeStruct((0,), jnp.float32)),
        input_output_aliases={len(flat) - 1: 1})
    out = call(*flat, layers=np.int64(layers), kv_heads=np.int64(kv_heads),
               group=np.int64(group), eps=np.float32(1e-5), ranks=np.int64(ranks),
               oneshot=np.int64(0), timeout_ns=np.int64(timeout_ns), skew_ns=np.int64(0),
               absent_rank=np.int64(-1))
    return jax.block_until_ready(out)


# (kv_heads, group, layers, ranks)
SHAPES = [(1, 2, 2, 1), (2, 2, 2, 2), (2, 1, 3, 1), (4, 2, 1, 4)]


@pytest.mark.parametrize("kv_heads,group,layers,ranks", SHAPES)
def test_workspace_bytes_is_the_size_the_op_takes(kv_heads, group, layers, ranks):
    """The op runs with workspace_bytes(...) bytes and rejects any other size, naming
    workspace_bytes' value as the one it wants."""
    ops = _model(kv_heads, group, layers)
    want = decode_step.workspace_bytes(H, kv_heads, group, F, layers, ranks)
    h, _, work, _ = _raw_call(ops, workspace=want, layers=layers, kv_heads=kv_heads, group=group,
                              ranks=ranks)
    assert work.shape == (want,) and bool(jnp.isfinite(h.astype(jnp.float32)).all())
    for wrong in (want - 256, want + 256):
        with pytest.raises(Exception, match=f"the workspace must be {want} bytes, got {wrong}"):
            _raw_call(ops, workspace=wrong, layers=layers, kv_heads=kv_heads, group=group,
                      ranks=ranks)


def test_workspace_bytes_known_values():
    """StepWorkspace's layout worked by hand (every part rounded up to 256 bytes): status words,
    barrier counters, per-head counts, [ranks > 1: the all-reduce's words], qkv, attention,
    SwiGLU and residual outputs, the attention's split partials (kv x 64 x group x 130 float32)."""
    # H=256, kv=1, group=2, F=256, 2 layers, 1 rank
    assert decode_step.workspace_bytes(256, 1, 2, 256, 2) == (
        256 + 256 + 256 + 1024 + 512 + 512 + 512 + 66560) == 69888
    # H=256, kv=2, group=2, F=256, 2 layers, 2 ranks
    assert decode_step.workspace_bytes(256, 2, 2, 256, 2, 2) == (
        256 + 256 + 256 + 4096 + 2048 + 1024 + 512 + 2048 + 133120) == 143616
    with pytest.raises(ValueError, match="group in"):
        decode_step.workspace_bytes(256, 1, decode_step.MAX_GROUP + 1, 256, 2)


def test_llama_step_sizes_its_workspace():
    """The public call (which sizes the workspace with workspace_bytes) runs, with and without
    virtual ranks."""
    x, rope, pos, fnorm, blocks, cache = _model(2, 2, 2)
    h, _ = sifar_jax.llama_step(x, rope, pos, fnorm, blocks, cache, kv_heads=2, group=2, eps=1e-5)
    assert bool(jnp.isfinite(h.astype(jnp.float32)).all())
    h2, _, _, status = sifar_jax.llama_step_virtual_ranks(
        x, rope, pos, fnorm, blocks, cache, kv_heads=2, group=2, eps=1e-5, ranks=2)
    assert not decode_step.check_step_status(status).failed
    assert status.shape == (decode_step.STATUS_WORDS,)


@pytest.mark.parametrize("attr,limit,message", [
    ("group", "MAX_GROUP", "group in [1, {}]"),
    ("layers", "MAX_LAYERS", "layers must be in [1, {}]"),
    ("ranks", "MAX_RANKS", "ranks must be in [1, {}]"),
])
def test_limits_are_the_ones_the_op_enforces(attr, limit, message):
    """Each limit decode_step checks is where the op's own check starts refusing: at the limit
    the op gets past that check (it fails later, on operands built for another shape), one past
    it that check refuses."""
    value = getattr(decode_step, limit)
    ops = _model(8, 1, 1)
    kw = dict(layers=1, kv_heads=8, group=1, ranks=1)
    text = message.format(value)

    def error(v):
        try:
            _raw_call(ops, workspace=256, **{**kw, attr: v})
        except Exception as e:  # noqa: BLE001 - the op's error, whatever else it says
            return str(e)
        return ""

    assert text not in error(value)
    assert text in error(value + 1)


def test_timeout_limit_is_the_ones_the_op_enforces():
    ops = _model(2, 1, 1)
    ws = decode_step.workspace_bytes(H, 2, 1, F, 1, 2)
    top = int(decode_step.MAX_TIMEOUT_S * 1e9)
    _raw_call(ops, workspace=ws, layers=1, kv_heads=2, group=1, ranks=2, timeout_ns=top)
    with pytest.raises(Exception, match="timeout_ns in"):
        _raw_call(ops, workspace=ws, layers=1, kv_heads=2, group=1, ranks=2, timeout_ns=top + 1)
    assert 0 < decode_step.DEFAULT_TIMEOUT_S <= decode_step.MAX_TIMEOUT_S


def test_chunk_is_the_ops_multiple():
    """H must be a multiple of CHUNK: the op refuses H = CHUNK * k + CHUNK / 2 with its own
    message naming CHUNK."""
    c = decode_step.CHUNK
    x = jnp.zeros((H + c // 2,), jnp.bfloat16)
    ops = list(_model(1, 1, 1))
    ops[0] = x
    with pytest.raises(Exception, match=f"H must be a multiple of {c}"):
        _raw_call(tuple(ops), workspace=256, layers=1, kv_heads=1, group=1)
