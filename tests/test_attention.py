"""sifar_jax.decode_attention: one decoding step's RoPE + cache write + attention (ffi/attention/).

On every machine: the CPU handler (impl="kernel") and XLA's ops (impl="xla") against a float64
reference on random data, every dtype, both cache layouts, one and several chunks, GQA groups of
1-8 (3 too), per-sequence start slots and rotary factors, pos at 0, at the bucket's end and past
it; slots that must not be read hold NaN; the cache keeps every other slot's bits. The user
errors. The decoders: tokens of attn_impl "sifar" / "sifar_kernel" equal the einsums' ("xla"),
and the cache stays in place (no copy in the compiled step). With a CUDA GPU: the CUDA kernels
against the same reference on the decoders' real shapes (Llama-3.1-8B and Qwen3-30B-A3B, KV 1K
and 16K).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sifar_jax import attention as att
from tests.conftest import gpu_device_list

DTYPES = ("float32", "bfloat16", "float16")
EPS = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}  # half an ulp

# (B, KV heads, G, D, S slots, length, pos, splits, start or None, per-sequence cos/sin)
CASES = [
    (1, 2, 4, 64, 96, 64, 40, 4, None, False),
    (2, 3, 1, 32, 80, 80, 79, 1, [0, 9], True),  # pos at the bucket's end, one chunk
    (3, 1, 8, 16, 128, 128, 100, 5, [0, 50, 100], False),  # a row whose only slot is pos
    (1, 2, 2, 128, 64, 64, 0, 3, None, False),  # the first token
    (2, 2, 3, 64, 40, 32, 20, 2, [25, 0], True),  # a row with nothing visible: zeros
    (1, 1, 4, 64, 64, 32, 50, 2, None, False),  # pos past the bucket: written, not attended
]


def _case_id(c):
    return f"b{c[0]}kv{c[1]}g{c[2]}d{c[3]}s{c[4]}n{c[5]}p{c[6]}x{c[7]}"


def operands(case, dtype, layout, seed=0):
    """qkv, caches (NaN wherever the call must not read), pos, cos, sin, start."""
    b, kv, g, d, s, length, pos, _, start, per_row = case
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.standard_normal((b, kv, g + 2, d)), dtype)
    cache = rng.standard_normal((2, b, kv, s, d)).astype(np.float32)
    first = np.zeros(b, int) if start is None else np.asarray(start)
    for r in range(b):  # never-visible slots: before start, after pos, past the bucket
        hide = np.ones(s, bool)
        hide[first[r]:min(pos, length - 1) + 1] = False
        cache[:, r, :, hide] = np.nan
    if layout == "bshd":
        cache = cache.transpose(0, 1, 3, 2, 4)
    kc, vc = (jnp.asarray(c, dtype) for c in cache)
    ang = rng.uniform(0, 2 * np.pi, (b if per_row else 1, d // 2)).astype(np.float32)
    ang = np.concatenate([ang, ang], -1)
    cos, sin = np.cos(ang), np.sin(ang)
    if not per_row:
        cos, sin = cos[0], sin[0]
    st = None if start is None else jnp.asarray(start, jnp.int32)
    return qkv, kc, vc, pos, jnp.asarray(cos), jnp.asarray(sin), st


def _round(x, dtype):
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)


def _rope(x32, cos, sin, dtype):
    """The rotary embedding as the kernels compute it (float32, then rounded to dtype)."""
    half = x32.shape[-1] // 2
    rotated = np.concatenate([-x32[..., half:], x32[..., :half]], -1)
    return _round((x32 * cos).astype(np.float32) + (rotated * sin).astype(np.float32), dtype)


def reference(case, qkv, kc, vc, cos, sin, layout):
    """float64 out [B, KV, G, D], its error bound, and the expected key and value written."""
    b, kv, g, d, s, length, pos, _, start, _ = case
    dtype = jnp.dtype(qkv.dtype).name
    x = np.asarray(qkv.astype(jnp.float32))
    c = np.asarray(cos, np.float32).reshape(-1, 1, 1, d)
    sn = np.asarray(sin, np.float32).reshape(-1, 1, 1, d)
    q = _rope(x[:, :, :g], c, sn, dtype)
    k_new = _rope(x[:, :, g:g + 1], c, sn, dtype)[:, :, 0]
    v_new = x[:, :, g + 1].astype(np.float64)
    keys = np.asarray(kc.astype(jnp.float32), np.float64)
    vals = np.asarray(vc.astype(jnp.float32), np.float64)
    if layout == "bshd":
        keys, vals = keys.transpose(0, 2, 1, 3), vals.transpose(0, 2, 1, 3)
    slot = min(max(pos, 0), s - 1)
    keys[:, :, slot], vals[:, :, slot] = k_new, v_new
    out = np.zeros((b, kv, g, d))
    mag = np.zeros_like(out)
    first = np.zeros(b, int) if start is None else np.asarray(start)
    for r in range(b):
        lo, hi = first[r], min(pos, length - 1)
        if lo > hi:
            continue
        scores = np.einsum("kgd,ksd->kgs", q[r], keys[r, :, lo:hi + 1]) / np.sqrt(d)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[r] = np.einsum("kgs,ksd->kgd", p, vals[r, :, lo:hi + 1])
        mag[r] = np.einsum("kgs,ksd->kgd", p, np.abs(vals[r, :, lo:hi + 1]))
    # half an ulp of the output's rounding, plus float32 scores and sums (a few ulp of float32
    # per term, relative to the values' magnitudes)
    bound = EPS[dtype] * np.abs(out) * 1.01 + 1e-5 * mag
    return out, bound, k_new, v_new, slot


def _slots(cache, layout):
    """A cache as [B, KV, S, D]."""
    a = np.asarray(cache.astype(jnp.float32))
    return a if layout == "bhsd" else a.transpose(0, 2, 1, 3)


def check_call(case, dtype, layout, impl, device=None):
    args = operands(case, dtype, layout)
    qkv, kc, vc, pos, cos, sin, start = args
    before_k, before_v = _slots(kc, layout), _slots(vc, layout)
    length, splits = case[5], case[7]
    f = jax.jit(lambda qkv, kc, vc, pos, cos, sin, start: att.decode_attention(
        qkv, kc, vc, pos, cos, sin, length=length, start=start, layout=layout, impl=impl,
        splits=splits))
    if device is not None:
        args = jax.device_put(args, device)
    out, k_after, v_after = f(*args)
    assert out.shape == qkv.shape[:2] + (case[2], case[3]) and out.dtype == qkv.dtype
    want, bound, k_new, v_new, slot = reference(case, qkv, kc, vc, cos, sin, layout)
    got = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.isfinite(got).all(), "a slot that must not be read was read (NaN)"
    np.testing.assert_array_less(np.abs(got - want), bound + 1e-30)
    k_after, v_after = _slots(k_after, layout), _slots(v_after, layout)
    np.testing.assert_array_equal(v_after[:, :, slot], v_new)
    # the key: the kernels' float32 RoPE may contract to an fma: at most one ulp of dtype apart
    np.testing.assert_allclose(k_after[:, :, slot], k_new, rtol=4 * EPS[dtype], atol=1e-6)
    for before, after in ((before_k, k_after), (before_v, v_after)):
        keep = np.ones(before.shape[2], bool)
        keep[slot] = False
        np.testing.assert_array_equal(after[:, :, keep], before[:, :, keep])  # NaN == NaN here
    return got, want, bound


@pytest.mark.parametrize("impl", ["kernel", "xla"])
@pytest.mark.parametrize("layout", sorted(att.LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_on_cpu_matches_float64(case, dtype, layout, impl):
    check_call(case, dtype, layout, impl)


def test_the_reference_check_can_fail():
    """The bound catches one visible slot left out of the softmax (a masking bug)."""
    case = CASES[0]
    got, want, bound = check_call(case, "bfloat16", "bhsd", "kernel")
    short = (case[0], case[1], case[2], case[3], case[4], case[5], case[6], case[7], [1], False)
    qkv, kc, vc, _, cos, sin, _ = operands(case, "bfloat16", "bhsd")
    off, _, _, _, _ = reference(short, qkv, kc, vc, cos, sin, "bhsd")
    assert (np.abs(got - off) > bound).any()


def test_plan_reaches_the_target_within_chunk_limits():
    assert att.attention_plan(1, 8, 1024) == 64  # 512 blocks, chunks of 16
    assert att.attention_plan(1, 8, 64) == 4  # chunks of at least 16 slots
    assert att.attention_plan(1, 8, 16384) == 66  # 528 blocks, chunks of 249
    assert att.attention_plan(1, 8, 1 << 19) == 1024  # at most 1024 chunks
    assert att.attention_plan(64, 8, 1024) == 4  # enough blocks: chunks of at most 256
    for b, kv, n in ((1, 4, 16384), (2, 8, 100), (1, 1, 1), (3, 2, 777)):
        s = att.attention_plan(b, kv, n)
        assert 1 <= s <= n and -(-n // s) <= att.MAX_PLANNED_CHUNK


def test_user_errors_are_clear_at_trace_time():
    qkv, kc, vc, pos, cos, sin, _ = operands(CASES[0], "float32", "bhsd")
    call = att.decode_attention
    with pytest.raises(ValueError, match="impl must be"):
        call(qkv, kc, vc, pos, cos, sin, impl="cudnn")
    with pytest.raises(ValueError, match="layout must be"):
        call(qkv, kc, vc, pos, cos, sin, layout="sbhd")
    with pytest.raises(ValueError, match=r"qkv must be \[B, KV heads, G \+ 2, D\]"):
        call(qkv[:, :, :2], kc, vc, pos, cos, sin)
    with pytest.raises(ValueError, match="a bhsd cache for qkv"):
        call(qkv, kc[:, :1], vc[:, :1], pos, cos, sin)
    with pytest.raises(ValueError, match="two arrays of one rank-4 shape"):
        call(qkv, kc, vc[:, :, :10], pos, cos, sin)
    with pytest.raises(TypeError, match="dtypes"):
        call(qkv, kc, vc.astype(jnp.bfloat16), pos, cos, sin)
    with pytest.raises(ValueError, match="cos and sin must be"):
        call(qkv, kc, vc, pos, cos[:8], sin[:8])
    with pytest.raises(ValueError, match="start must be"):
        call(qkv, kc, vc, pos, cos, sin, start=jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="length=200 must be in"):
        call(qkv, kc, vc, pos, cos, sin, length=200)
    with pytest.raises(ValueError, match="splits=0"):
        call(qkv, kc, vc, pos, cos, sin, splits=0, impl="kernel")
    with pytest.raises(ValueError, match="chunks of at most 512"):
        big = jnp.zeros((1, 2, 1024, 64), jnp.float32)
        call(qkv, big, big, pos, cos, sin, splits=1, impl="kernel")
    wide = jnp.zeros((1, 2, 11, 64), jnp.float32)  # 9 query heads per KV head
    with pytest.raises(TypeError, match="9 query heads per KV head"):
        call(wide, kc, vc, pos, cos, sin, impl="kernel")
    out, _, _ = call(wide, kc, vc, pos, cos, sin)  # auto: XLA's ops where the kernel cannot run
    assert out.shape == (1, 2, 9, 64)
    with pytest.raises(TypeError, match="float32 cache with bfloat16 activations"):
        call(qkv.astype(jnp.bfloat16), kc, vc, pos, cos, sin, impl="kernel")


# ---- the decoders ----------------------------------------------------------------------------------

def _need(n):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices, have {len(jax.devices())} (conftest sets XLA_FLAGS)")


@pytest.mark.parametrize("tp", [1, 2])
def test_decoder_tokens_equal_the_einsums(tp):
    """Three prompts of 3, 11 and 17 tokens in one batch (left-padded: per-row start), every
    loop: attn_impl "sifar" and "sifar_kernel" give the greedy tokens of "xla", and logits of
    one teacher-forced pass through decode steps within float32 rounding."""
    _need(tp)
    from models import Decoder, LlamaConfig, make_mesh, random_params

    config = LlamaConfig.tiny()
    mesh = make_mesh(tp)
    params = random_params(config, mesh, seed=11)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, config.vocab_size, n) for n in (3, 11, 17)]
    tokens = {}
    for impl in ("xla", "sifar", "sifar_kernel"):
        dec = Decoder(config, mesh, params, attn_impl=impl, batch_size=3)
        assert dec.attn_impl == impl
        tokens[impl] = {loop: dec.generate(prompts, 20, loop=loop, chunk=8)
                        for loop in ("sync", "stream", "on_device")}
    for impl in ("sifar", "sifar_kernel"):
        for loop, t in tokens[impl].items():
            np.testing.assert_array_equal(t, tokens["xla"][loop], err_msg=f"{impl} {loop}")
    with pytest.raises(ValueError, match="attn_impl must be one of"):
        Decoder(config, mesh, params, attn_impl="flash")


def test_decoder_keeps_the_cache_in_place():
    """The kernel's cache outputs alias its inputs: the compiled step and the on-device loop copy
    no cache tensor (the einsums' dynamic_update_slice is in place too: tests/test_decode_loops)."""
    _need(2)
    from models import Decoder, LlamaConfig, hlo, make_mesh, random_params

    config = LlamaConfig.tiny()
    mesh = make_mesh(2)
    params = random_params(config, mesh, seed=11)
    dec = Decoder(config, mesh, params, attn_impl="sifar_kernel", batch_size=2)
    dec.start(np.tile(np.arange(1, 9, dtype=np.int32), (2, 1)), reserve=16)
    a = dec.state["cache"][0]["k"]
    shape = hlo.hlo_shape(a.dtype, a.sharding.shard_shape(a.shape))
    for exe in (dec.compiled_step(), dec.compiled_chunk(8)):
        text = exe.as_text()
        assert "sifar_decode_attention" in text
        assert hlo.cache_copies(text, shape) == {}


# ---- CUDA -----------------------------------------------------------------------------------------

GPU_CASES = [
    # Llama-3.1-8B, TP=1 and TP=2 (per rank): KV 1K bucket, pos near its end
    (1, 8, 4, 128, 2048, 1024, 1000, att.attention_plan(1, 8, 1024), None, False),
    (1, 4, 4, 128, 2048, 1024, 1000, att.attention_plan(1, 4, 1024), None, False),
    # KV 16K
    (1, 8, 4, 128, 16384, 16384, 16000, att.attention_plan(1, 8, 16384), None, False),
    # Qwen3-30B-A3B (4 KV heads, 8 query heads each), a batch with left padding
    (2, 4, 8, 128, 1024, 512, 300, att.attention_plan(2, 4, 512), [0, 123], True),
    (3, 2, 3, 64, 256, 256, 255, 1, [0, 7, 255], False),  # one chunk, odd group
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(att.LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_cuda_kernels_match_float64(case, dtype, layout):
    gpus = gpu_device_list()
    if not gpus or "cuda" not in att._ext.PLATFORMS:
        pytest.skip("needs a CUDA GPU and the CUDA build")
    check_call(case, dtype, layout, "kernel", gpus[0])
    if case is GPU_CASES[0]:
        check_call(case, dtype, layout, "auto", gpus[0])  # auto: the kernels on CUDA


def test_results_start_as_the_caches_where_xla_does_not_alias_them():
    """Caches sliced from a stacked array whose results are stacked again: XLA:GPU gave the
    kernel's cache results buffers of their own (measured on an H200); the call then copies each
    cache into its result first. On every backend the results equal XLA's ops."""
    rng = np.random.default_rng(3)
    layers, b, kv, g, d, s = 3, 1, 2, 4, 64, 96
    qkv = jnp.asarray(rng.standard_normal((layers, b, kv, g + 2, d)), jnp.float32)
    kc = jnp.asarray(rng.standard_normal((layers, b, kv, s, d)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((layers, b, kv, s, d)), jnp.float32)
    cos, sin = jnp.cos(jnp.arange(d) / d), jnp.sin(jnp.arange(d) / d)

    def chain(qkv, kc, vc, impl):
        outs = [att.decode_attention(qkv[i], kc[i], vc[i], 50, cos, sin, length=64, impl=impl,
                                     splits=2) for i in range(layers)]
        return tuple(jnp.stack(x) for x in zip(*outs))

    f = jax.jit(chain, static_argnums=3)
    devices = [jax.devices("cpu")[0]] + gpu_device_list()[:1]
    for dev in devices:
        args = jax.device_put((qkv, kc, vc), dev)
        got, want = f(*args, "kernel"), f(*args, "xla")
        for a, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-5, atol=1e-5)
