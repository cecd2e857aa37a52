"""Decode loops (sync, stream, pipelined, on-device), stop tokens, sampling, attention buckets,
the request-sized cache, the fused all-reduce + add + RMSNorm wiring, and the compiled HLO
(tiny preset, float32, 8 host CPU devices from conftest.py)."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sifar_jax
from models import LLAMA, LOOPS, Decoder, LlamaConfig, make_mesh, random_params
from models.core.sharding import KV_LAYOUTS
from models.core.tp import fused_add_norm_available, unfused_psum_add_rmsnorm
from models.decoder import hlo
from models.decoder.capacity import attention_buckets, bucket_up, prompt_bucket
from models.decoder.options import DecodeOptions
from models.decoder.sampling import Sampling, key_data, next_token

PROMPT = np.array([5, 17, 3, 250, 99, 7, 42, 128], np.int32)
NEW = 24  # tokens per generation; with the prompt and one chunk, one 64-position bucket
CHUNK = 8  # on-device steps per dispatch in these tests


def _need(n):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices, have {len(jax.devices())} (conftest sets XLA_FLAGS)")


@functools.lru_cache(maxsize=None)
def _params(tp):
    config = LlamaConfig.tiny()
    mesh = make_mesh(tp)
    return config, mesh, random_params(config, mesh, seed=11)


def _decoder(tp, allreduce="psum", **kw):
    """A fresh Decoder (sifar: after sifar_clean, one mesh at a time), or for psum a shared one
    per set of options, so its compiled steps serve several tests."""
    _need(tp)
    if allreduce == "psum":
        return _shared_decoder(tp, **kw)
    config, mesh, params = _params(tp)
    return Decoder(config, mesh, params, DecodeOptions(allreduce=allreduce, **kw))


@functools.lru_cache(maxsize=None)
def _shared_decoder(tp, **kw):
    config, mesh, params = _params(tp)
    return Decoder(config, mesh, params, DecodeOptions(**kw))


@pytest.fixture
def sifar_clean():
    """One communicator per device and axis name: start and end each sifar test with none."""
    sifar_jax.shutdown()
    yield
    sifar_jax.shutdown()


@pytest.fixture(scope="module")
def plain_tokens():
    """The plain loop (one step, read its token, repeat) at TP=1 with lax.psum."""
    return _decoder(1).generate(PROMPT, NEW, loop="sync")


def _every_loop(dec, prompt, n, early_exit=False, **kw):
    """{loop name: tokens} for every loop (and the on-device one with early exit)."""
    out = {loop: dec.generate(prompt, n, loop=loop, chunk=CHUNK, **kw) for loop in LOOPS}
    if early_exit:
        out["on_device+early_exit"] = dec.generate(prompt, n, loop="on_device", chunk=CHUNK,
                                                   early_exit=True, **kw)
    return out


# ---- every loop gives the plain loop's tokens ------------------------------------------------

@pytest.mark.parametrize("tp,allreduce", [(1, "psum"), (2, "psum"), (4, "psum"),
                                          (1, "sifar"), (2, "sifar"), (4, "sifar")])
def test_every_loop_gives_the_plain_loops_tokens(plain_tokens, tp, allreduce, sifar_clean):
    dec = _decoder(tp, allreduce)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _every_loop(dec, PROMPT, NEW)
    assert not [w for w in caught if "falling back" in str(w.message)], "sifar fell back to psum"
    for loop, tokens in got.items():
        assert tokens.shape == (1, NEW), loop
        np.testing.assert_array_equal(tokens, got["sync"], err_msg=f"loop {loop}")
    if jax.default_backend() == "cpu":  # (a GPU's float32 matmuls may round otherwise per TP)
        np.testing.assert_array_equal(got["sync"], plain_tokens, err_msg="not TP=1's tokens")
    if allreduce == "sifar":
        sifar_jax.check()


@pytest.mark.parametrize("tp", [1, 2])
def test_each_step_writes_its_token_to_host_memory(tp):
    """The step and the prefill return their token [rows] as a result of its own in pinned host
    memory (reading it costs ~10 us on an H200 host, the state's device token ~250-550 us), and
    token() reads that copy: equal to the state's token, and gone after a seek."""
    dec = _decoder(tp)
    if "pinned_host" not in {m.kind for m in jax.devices()[0].addressable_memories()}:
        pytest.skip("this backend has no pinned_host memory")
    dec.start(PROMPT)
    assert dec.compiled_step().output_shardings[1].memory_kind == "pinned_host"
    for _ in range(3):
        last = dec.seq.last_tok
        assert last is not None and last.sharding.memory_kind == "pinned_host"
        np.testing.assert_array_equal(np.asarray(last), np.asarray(dec.state["tok"])[:, 0])
        np.testing.assert_array_equal(dec.token(), np.asarray(dec.state["tok"])[:1, 0])
        dec.advance()
    dec.seek(dec.seq.pos, np.array([7], np.int32))
    assert dec.seq.last_tok is None and dec.token().tolist() == [7]


def test_stream_runs_ahead_of_the_host():
    """When stream yields the first token, the next in_flight steps are already dispatched."""
    dec = _decoder(2)
    for in_flight in (1, 3):
        it = dec.stream(PROMPT, NEW, in_flight=in_flight)
        first = next(it)
        # host mirror: the padded prompt's slots, then the steps dispatched so far
        assert dec.seq.pos == prompt_bucket(len(PROMPT)) + in_flight
        rest = list(it)
        assert len(rest) == NEW - 1 and first.shape == (1,)


# ---- stop tokens --------------------------------------------------------------------------------

def _first(row, value):
    return int(np.flatnonzero(row == value)[0])


def test_stream_trims_after_eos():
    dec = _decoder(2)
    ref = dec.generate(PROMPT, NEW, loop="sync")
    row = ref[0]
    j = next(i for i in range(3, NEW) if _first(row, row[i]) == i)  # first occurrence at step j
    eos = int(row[j])
    got = _every_loop(dec, PROMPT, NEW, early_exit=True, eos_id=eos)
    for loop, tokens in got.items():
        np.testing.assert_array_equal(tokens, ref[:, :j + 1], err_msg=f"loop {loop}")


def test_batch_stops_when_every_sequence_has_stopped():
    """Two sequences: each stops at its own eos and then repeats it; the generation ends at the
    step where the last one stops."""
    dec = _decoder(2, batch_size=2)
    prompts = np.stack([PROMPT, PROMPT[::-1]])
    ref = dec.generate(prompts, NEW, loop="sync")
    eos = next(int(t) for t in ref[0, 2:] if t in ref[1, 2:] and _first(ref[1], t) != _first(ref[0], t))
    stops = [_first(ref[b], eos) for b in range(2)]
    want = ref[:, :max(stops) + 1].copy()
    for b in range(2):
        want[b, stops[b]:] = eos
    for loop, tokens in _every_loop(dec, prompts, NEW, early_exit=True, eos_id=eos).items():
        np.testing.assert_array_equal(tokens, want, err_msg=f"loop {loop}")


def test_several_stop_ids_each_row_stops_at_its_first(plain_tokens):
    """eos_id as a list (Llama 3 instruct stops at any of 3 ids): each row stops at the first of
    them it produces and repeats that one; ids never produced change nothing."""
    dec = _decoder(2, batch_size=2)
    prompts = np.stack([PROMPT, PROMPT[::-1]])
    ref = dec.generate(prompts, NEW, loop="sync")
    a = int(ref[0, 4])  # row 0 stops here (if row 1 produces it, maybe earlier there)
    b = next(int(t) for t in ref[1, 2:] if t not in ref[0, :5] and t != a)
    never = next(t for t in range(LlamaConfig.tiny().vocab_size) if t not in ref)
    stops = [_first(ref[r], v) if v in ref[r] else NEW for r in range(2) for v in (a, b)]
    stops = [min(stops[0:2]), min(stops[2:4])]
    assert stops[0] <= 4 and stops[1] < NEW
    want = ref[:, :max(stops) + 1].copy()
    for r in range(2):
        want[r, stops[r]:] = ref[r, stops[r]]
    for loop, tokens in _every_loop(dec, prompts, NEW, early_exit=True,
                                    eos_id=[never, a, b]).items():
        np.testing.assert_array_equal(tokens, want, err_msg=f"loop {loop}")
    with pytest.raises(ValueError, match="at most 8 stop ids"):
        dec.generate(prompts, 2, eos_id=list(range(9)))


# ---- sampling -------------------------------------------------------------------------------------

def test_sampling_is_reproducible_with_a_seed():
    dec = _decoder(2)
    kw = dict(temperature=0.9, top_p=0.95, seed=3)
    got = _every_loop(dec, PROMPT, NEW, **kw)
    for loop, tokens in got.items():
        np.testing.assert_array_equal(tokens, got["sync"], err_msg=f"loop {loop}")
    other = dec.generate(PROMPT, NEW, temperature=0.9, top_p=0.95, seed=4)
    assert not np.array_equal(other, got["sync"]), "the seed does not change the tokens"
    greedy = dec.generate(PROMPT, NEW)
    assert not np.array_equal(greedy, got["sync"]), "temperature 0.9 sampled the argmax 24 times"
    # a nucleus so small that only the top token is left: greedy, through the sampling path
    np.testing.assert_array_equal(dec.generate(PROMPT, NEW, temperature=1.0, top_p=1e-6), greedy)


def test_top_p_keeps_the_smallest_nucleus():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.asarray(np.log(probs)[None, :].repeat(4000, 0), jnp.float32)
    for top_p, allowed in ((0.7, 2), (0.85, 3), (1.0, 4)):
        toks, key = next_token(logits, key_data(0), Sampling(1.0, top_p))
        counts = np.bincount(np.asarray(toks), minlength=4) / len(toks)
        assert counts[allowed:].sum() == 0, (top_p, counts)
        want = probs[:allowed] / probs[:allowed].sum()
        np.testing.assert_allclose(counts[:allowed], want, atol=0.03, err_msg=str(top_p))
        assert not np.array_equal(np.asarray(key), np.asarray(key_data(0)))  # the key advanced
    with pytest.raises(ValueError, match="top_p"):
        Sampling(1.0, 0.0)


# ---- the compiled programs --------------------------------------------------------------------------

@pytest.mark.parametrize("allreduce,batch", [("psum", 1), ("psum", 4), ("sifar_buffers", 1)])
def test_no_copy_of_the_cache_per_step_or_per_loop_iteration(allreduce, batch, sifar_clean):
    """With the platform's default cache layout (sharding.default_kv_layout); batch > 1 matters:
    XLA:GPU copied a [B, S, heads, D] cache at B > 1 only."""
    dec = _decoder(2, allreduce, batch_size=batch)
    dec.start(np.tile(PROMPT, (batch, 1)), reserve=2 * CHUNK)
    shapes = hlo.cache_shapes(dec.state["cache"])
    for name, exe in (("step", dec.compiled_step()),
                      ("fori", dec.compiled_chunk(CHUNK)),
                      ("while", dec.compiled_chunk(CHUNK, early_exit=True))):
        text = exe.as_text()
        if name != "step":
            assert "body=" in text, f"{name}: no while loop in the HLO"
        for shape in shapes:
            assert hlo.cache_copies(text, shape) == {}, f"{name}: the KV cache is copied ({shape})"


def test_both_kv_layouts_give_the_same_tokens_and_logits():
    """The cache as [B, S, heads, D] or [B, heads, S, D]: the same tokens at batch 2, TP=2, every
    loop, and the same logits (the same sums in the same order: equal to float32 rounding)."""
    _need(2)
    prompts = np.stack([PROMPT, PROMPT[::-1]])
    got = {}
    for layout in sorted(KV_LAYOUTS):
        dec = _decoder(2, batch_size=2, kv_layout=layout)
        assert dec.kv_layout == layout
        got[layout] = (_every_loop(dec, prompts, NEW), dec.teacher_forced_logits(prompts))
    (toks_a, logits_a), (toks_b, logits_b) = got.values()
    for loop in toks_a:
        np.testing.assert_array_equal(toks_a[loop], toks_b[loop], err_msg=loop)
    np.testing.assert_allclose(logits_a, logits_b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="kv_layout"):
        _decoder(2, kv_layout="sbhd")


def test_the_copy_check_can_fail():
    """The HLO check finds a per-iteration copy and an entry copy where XLA must make them."""
    x = jnp.ones((1, 64, 2, 16), jnp.float32)

    def keeps_old(c):  # the old value stays live beside the updated one: a copy per iteration
        def body(i, carry):
            new, old = carry
            return new.at[0, i].add(1.0), new
        return jax.lax.fori_loop(0, 4, body, (c, c))

    text = jax.jit(keeps_old).lower(x).compile().as_text()
    assert "loop" in hlo.cache_copies(text, hlo.hlo_shape(x.dtype, x.shape))
    text = jax.jit(lambda c: (c.at[0, 3].set(1.0), c)).lower(x).compile().as_text()  # not donated
    assert "entry" in hlo.cache_copies(text, hlo.hlo_shape(x.dtype, x.shape))

    def in_a_branch(c, p):  # copies inside the computations a conditional runs
        return jax.lax.cond(p, lambda c: (c.at[0, 1].set(2.0), c), lambda c: (c, c + 1.0), c)

    text = jax.jit(in_a_branch).lower(x, True).compile().as_text()
    assert "entry" in hlo.cache_copies(text, hlo.hlo_shape(x.dtype, x.shape))


# ---- attention buckets and the request-sized cache ------------------------------------------------

def test_bucketed_attention_equals_attention_over_the_whole_cache():
    """Attending over a 64-position bucket of a 256-position cache full of garbage gives the
    logits and cache of attending over all 256 (the rest is masked)."""
    _need(2)
    config, mesh, params = _params(2)
    dec = Decoder(config, mesh, params, max_seq_len=256)
    dec.reset(256)
    dec.randomize_cache(seed=5)  # stale, never-zero values past the position
    cache = dec.state["cache"]
    tokens, positions = np.array([[9]], np.int32), np.array([40], np.int32)
    out = {}
    for attend in (64, None):
        fwd = jax.jit(LLAMA.make_forward(dec.layout, mesh, dec.options, attend_len=attend))
        logits, new_cache, _ = fwd(params, cache, tokens, positions, {})
        out[attend] = np.asarray(logits), np.asarray(new_cache)[:, 0]  # every layer's keys
    np.testing.assert_allclose(out[64][0], out[None][0], rtol=1e-6, atol=1e-6)
    # The first layer's keys come before any attention: equal. A later layer's inputs went
    # through softmax sums over 64 or 256 slots (the same non-zero terms, other reduction
    # trees): equal to float32 rounding (XLA:CPU measured 7e-7 apart).
    np.testing.assert_array_equal(out[64][1][0], out[None][1][0])
    for a, b in zip(out[64][1][1:], out[None][1][1:]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert attention_buckets(256) == [64, 128, 256] and bucket_up(65) == 128


def test_steps_pick_the_smallest_bucket_and_the_cache_fits_the_request(plain_tokens):
    dec = _decoder(1)
    got = dec.generate(PROMPT, NEW)
    assert dec.capacity == 64  # 8 + 24 positions, rounded up to a bucket (config says 128)
    np.testing.assert_array_equal(got, plain_tokens)
    dec = _decoder(1, max_seq_len=128)
    dec.start(PROMPT, reserve=80)
    dec.advance(60)  # positions 8..67: crosses from the 64 bucket to the 128 one
    assert dec.compiled_step() is dec.seq.step[1] and dec.seq.step[0] == 128
    dec.seek(10, [1])
    dec.compiled_step()
    assert dec.seq.step[0] == 64


def test_the_cache_grows_when_a_sequence_outgrows_it(plain_tokens):
    dec = _decoder(1)
    dec.reset(1)
    assert dec.capacity == 64
    logits = [dec.prefill(PROMPT[None])[:, -1]]
    for t in plain_tokens[0, :-1]:
        logits.append(dec.step([t]))
    for _ in range(40):  # past 64 positions: the cache grows to 128, keeping what it held
        logits.append(dec.step([7]))
    assert dec.capacity == 128
    ref = _decoder(1, max_seq_len=128)
    ref.reset()
    want = [ref.prefill(PROMPT[None])[:, -1]] + [ref.step([t]) for t in plain_tokens[0, :-1]]
    want += [ref.step([7]) for _ in range(40)]
    np.testing.assert_allclose(np.stack(logits), np.stack(want), rtol=1e-5, atol=1e-5)


# ---- the decoder's options -------------------------------------------------------------------------

def test_slot_bytes_reaches_sifar(sifar_clean):
    _decoder(2, "sifar", slot_bytes=1 << 15)
    assert {c.slot_bytes for c in sifar_jax.communicators("tp")} == {1 << 15}


def _stub_fused(calls, prefetched=None):
    """sifar_jax.psum_add_rmsnorm's contract, unfused, counting its traced calls (and the
    shapes of the prefetch operands it is given, None for none)."""
    def psum_add_rmsnorm(x, residual, weight, axis_name, *, eps, algorithm="auto",
                         prefetch=None, prefetch_bytes=None):
        calls.append(x.shape)
        if prefetched is not None:
            prefetched.append((None if prefetch is None else prefetch.shape, prefetch_bytes))
        return unfused_psum_add_rmsnorm(
            x, residual, weight, axis_name, eps=eps,
            allreduce=lambda v, a: sifar_jax.sifar_psum(v, a, algorithm=algorithm))
    return psum_add_rmsnorm


def test_fused_option_calls_psum_add_rmsnorm_after_every_all_reduce(monkeypatch, sifar_clean):
    """The decoder's wiring of fused=True, with a stand-in for the kernel: one call per
    all-reduce (2 per layer), and the tokens of the unfused decoder."""
    calls, prefetched = [], []
    monkeypatch.setattr(sifar_jax, "psum_add_rmsnorm", _stub_fused(calls, prefetched),
                        raising=False)
    # two float32 partials: every all-reduce adds them once, so psum's tokens are sifar's
    want = _decoder(2).generate(PROMPT, NEW, loop="sync")
    dec = _decoder(2, "sifar", fused=True, prefetch_bytes=4096)
    np.testing.assert_array_equal(dec.generate(PROMPT, NEW, loop="sync"), want)
    c = LlamaConfig.tiny()
    layers = c.num_layers
    assert len(calls) == 2 * 2 * layers  # traced twice: the prefill and the step
    # Each call is handed the local shard of the weight the next matmul reads: after
    # attention the MLP's gate_up, after the MLP the next layer's qkv, last the LM head.
    local_kv = c.num_kv_heads // 2
    gate_up = (c.hidden_size, 2, c.intermediate_size // 2)
    qkv = (c.hidden_size, local_kv, c.num_heads // c.num_kv_heads + 2, c.head_dim)
    head = (c.hidden_size, c.vocab_size // 2)
    one_trace = [(gate_up, 4096), (qkv, 4096)] * (layers - 1) + [(gate_up, 4096), (head, 4096)]
    assert prefetched == one_trace * 2, prefetched
    with pytest.raises(ValueError, match="allreduce='sifar'"):
        _decoder(2, "psum", fused=True)
    for bad in ("yes", "matmul"):  # fused="matmul" (the fused call + matmul) was retired
        with pytest.raises(ValueError, match="fused must be one of"):
            _decoder(2, "sifar", fused=bad)


@pytest.mark.skipif(fused_add_norm_available() is not None,
                    reason=str(fused_add_norm_available()))
@pytest.mark.parametrize("tp", [2, 4])
def test_fused_decoder_gives_the_unfused_tokens(tp, sifar_clean):
    unfused = _decoder(tp, "sifar")
    want = _every_loop(unfused, PROMPT, NEW)["sync"]
    ref_logits = unfused.teacher_forced_logits(PROMPT[None])
    fused = _decoder(tp, "sifar", fused=True)
    for loop, tokens in _every_loop(fused, PROMPT, NEW).items():
        np.testing.assert_array_equal(tokens, want, err_msg=f"fused, loop {loop}")
    # GPUs: the fused norm may differ from XLA's unfused one in an ulp (psum_add_rmsnorm's
    # docstring), which XLA:GPU's float32 matmuls (TF32 passes) carry into the logits: measured
    # on 2x H200, up to 2.5e-4. The CPU stays within 1e-5.
    tol = 1e-5 if jax.devices()[0].platform == "cpu" else 2e-3
    np.testing.assert_allclose(fused.teacher_forced_logits(PROMPT[None]), ref_logits,
                               rtol=tol, atol=tol)
    sifar_jax.check()


def test_fused_needs_the_kernel_or_says_so(monkeypatch, sifar_clean):
    monkeypatch.delattr(sifar_jax, "psum_add_rmsnorm", raising=False)
    with pytest.raises(NotImplementedError, match="psum_add_rmsnorm"):
        _decoder(2, "sifar", fused=True)


@pytest.mark.parametrize("extra", [["--allreduce", "psum"], ["--allreduce", "sifar", "--fused"]],
                         ids=["psum", "sifar-fused"])
def test_generate_cli_streams_tokens(capsys, monkeypatch, extra, sifar_clean):
    from models import generate
    from models.decoder import compile_cache

    monkeypatch.setenv(compile_cache.ENV_OFF, "1")  # never the user's cache from the suite
    _need(2)  # the CLI runs --tp 2 (on a 1-GPU host it rightly refuses)
    if "--fused" in extra and fused_add_norm_available() is not None:
        pytest.skip(fused_add_norm_available())
    assert generate.main(["--tp", "2", "--tokens", "12", "--prompt-ids", *map(str, PROMPT),
                          "--seed", "11", *extra]) == 0
    out = capsys.readouterr().out
    want = " ".join(map(str, _decoder(2).generate(PROMPT, 12)[0]))
    assert f"tokens: {want} \n" in out and out.count(want) == 1  # streamed, printed once


# ---- prompt buckets and warm-up: nothing compiles after it ------------------------------------------

def _unpadded_greedy(dec, prompt, n):
    """Greedy tokens through the logits path: the prompt prefilled as it is (no padding), then
    one step per token."""
    dec.reset(len(prompt) + n)
    logits, out = dec.prefill(np.asarray(prompt)[None])[:, -1], []
    for _ in range(n):
        out.append(int(np.argmax(np.asarray(logits)[0])))
        logits = dec.step([out[-1]])
    return np.array(out)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_padded_prompt_gives_the_tokens_of_the_unpadded_one(tp):
    """start() left-pads a prompt to its bucket (16, 32, ...): the greedy tokens are those of
    the prompt prefilled as it is, for lengths at, below and just past a bucket."""
    dec = _decoder(tp)
    rng = np.random.default_rng(tp)
    for length in (1, 7, 16, 17):
        prompt = rng.integers(0, LlamaConfig.tiny().vocab_size, length)
        got = dec.generate(prompt, 12)[0]
        assert dec.seq.pos == prompt_bucket(length) + 11, "the prompt was not padded to its bucket"
        np.testing.assert_array_equal(got, _unpadded_greedy(dec, prompt, 12), err_msg=str(length))
    assert (prompt_bucket(1), prompt_bucket(16), prompt_bucket(17)) == (16, 16, 32)


class _Compiles:
    """Counts XLA compilations through JAX's own monitoring events (independent of Decoder)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __enter__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._seen)
        return self

    def _seen(self, event, duration, **kw):
        if event == self.EVENT:
            self.count += 1

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._seen)


def test_nothing_compiles_after_warmup(caplog):
    """After warmup(40 prompt tokens, 80 new ones, greedy and top-p, stream and on_device), no
    request within those limits compiles anything: prompt lengths across the 16/32/64 buckets,
    steps across the 64/128/256 attention buckets, other temperatures, top-p values and seeds.
    A request past the limits compiles, and says so (logged, counted)."""
    _need(2)
    config, mesh, params = _params(2)
    dec = Decoder(config.replace(max_seq_len=256), mesh, params)
    with _Compiles() as during:
        report = dec.warmup(40, 80, sampling=("greedy", "top_p"), loops=("stream", "on_device"),
                            chunk=CHUNK)
    # prefill per prompt bucket (3), a step and a chunk per attention bucket (3 + 3), per mode
    assert report["executables"] == 2 * (3 + 3 + 3) and during.count >= report["executables"]
    # ... and each ran once (on GPUs its first run records its command buffer)
    assert report["executed"] == report["executables"]
    assert dec.capacity == 256
    rng = np.random.default_rng(0)
    requests = [(1, "stream", {}), (9, "on_device", dict(temperature=0.7, top_p=0.9, seed=1)),
                (16, "stream", dict(temperature=1.3, top_p=0.5, seed=2)), (17, "on_device", {}),
                (33, "stream", {}), (40, "on_device", dict(temperature=0.9, top_p=0.95))]
    with _Compiles() as after:
        for length, loop, kw in requests:
            toks = dec.generate(rng.integers(0, config.vocab_size, length), 80, loop=loop,
                                chunk=CHUNK, **kw)
            assert toks.shape == (1, 80)
    assert after.count == 0 and dec.compiles_after_warmup == 0
    with _Compiles() as outside, caplog.at_level("WARNING", logger="models.decoder.executables"):
        dec.generate(rng.integers(0, config.vocab_size, 65), 4)  # a 128-slot prompt bucket
    assert outside.count >= 1 and dec.compiles_after_warmup == 1
    assert "outside the limits of warmup(max_prompt_len=40" in caplog.text


def test_warmup_refuses_limits_the_cache_cannot_hold():
    dec = _decoder(1)
    with pytest.raises(ValueError, match="exceed max_seq_len=128"):
        dec.warmup(100, 40)  # a 128-slot prompt bucket + 40 tokens
    with pytest.raises(ValueError, match="sampling mode"):
        dec.warmup(8, 8, sampling=("beam",))


# ---- prompts of different lengths in one batch --------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2])
def test_prompts_of_different_lengths_in_one_batch_give_each_ones_tokens(tp):
    """Three prompts of 3, 11 and 17 tokens (the longest in the next bucket) in one batch: each
    row's greedy tokens are those of its prompt run alone, in every loop."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, LlamaConfig.tiny().vocab_size, n) for n in (3, 11, 17)]
    alone = _decoder(tp)
    want = np.concatenate([alone.generate(p, NEW) for p in prompts])
    batch = _decoder(tp, batch_size=3)
    for loop, tokens in _every_loop(batch, prompts, NEW).items():
        np.testing.assert_array_equal(tokens, want, err_msg=f"loop {loop}")
    # each row left-padded to the longest's bucket: its first real slot
    np.testing.assert_array_equal(np.asarray(batch.state["start"]), [32 - 3, 32 - 11, 32 - 17])
    with pytest.raises(ValueError, match="2 prompts for batch_size=3"):
        batch.generate(prompts[:2], 4)
    with pytest.raises(ValueError, match="empty prompt"):
        batch.generate([prompts[0], prompts[1], prompts[2][:0]], 4)


# ---- XLA compile options ----------------------------------------------------------------------------

def test_compiler_options_reach_every_executable():
    """DecodeOptions(compiler_options=...) compiles every executable with them, on first use and in
    warmup's threaded compiles: an option XLA does not know fails both; a valid one keeps the
    tokens (a GPU option, ignored by XLA:CPU)."""
    config, mesh, params = _params(1)
    for run in (lambda d: d.generate(PROMPT, 4), lambda d: d.warmup(8, 8)):
        dec = Decoder(config, mesh, params,
                      DecodeOptions(compiler_options={"xla_sifar_no_such_option": True}))
        with pytest.raises(Exception, match="xla_sifar_no_such_option"):
            run(dec)
    concurrent = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
    dec = Decoder(config, mesh, params, DecodeOptions(compiler_options=concurrent))
    assert dec.compiler_options == concurrent
    np.testing.assert_array_equal(dec.generate(PROMPT, 8), _decoder(1).generate(PROMPT, 8))
    with pytest.raises(TypeError, match="compiler_options must be a dict"):
        DecodeOptions(compiler_options=[("a", 1)])
