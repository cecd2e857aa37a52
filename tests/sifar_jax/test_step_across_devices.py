"""llama_step across devices (sifar_jax.llama_step(..., axis_name="tp")) on XLA:CPU host
devices: each device runs the step on its shard, the all-reduce after o and down a phase that
reads the peers' tagged words (sifar) or plain partials between barriers (oneshot) through the
communicator's shared workspace (ffi/step/llama_step_tp.h).

Every result is checked bit for bit against the same model's step as virtual ranks
(llama_step_virtual_ranks, ranks=R, on one device): the same shards, the same rank-order sums.
Then: many steps in one jit loop under random skew and across the tag wrap, interleaved with
plain sifar_psum calls of the same lane (exact); steps between plain psums of other sizes,
which on GPUs leave the plain all-reduce's protocol blocks lagging behind block 0 (the seam:
ffi/step/lane_start.h, whose rule a host-compiled test checks); a rank that never arrives (NaN
in h and every logit, SifarError naming the rank and the phase, within the timeout; exact
after re-init); the trace-time errors. The GPU tests at the end need GPUs in this process;
test_step_multiprocess.py runs the same scenarios with one process per rank, also two sharing
one GPU.
"""

from __future__ import annotations

import contextlib
import functools
import faulthandler
import shutil
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import sifar_jax
from sifar_jax import decode_step_tp as tpm
from sifar_jax import testing

D = 128
KV, GROUP, HIDDEN, FFN, LAYERS, VOCAB, SLOTS = 4, 2, 256, 512, 2, 512, 16
E4M3, BF16 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.bfloat16)
KW = dict(kv_heads=KV, group=GROUP, eps=1e-5)


@contextlib.contextmanager
def hang_guard(seconds: float):
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def step_operands(wdt=E4M3, layers=LAYERS, seed=0, hidden=HIDDEN):
    """A random TP=1 model's step operands: (x, rope, final_norm, layers, cache, head), every
    projection of weight type wdt (per-channel scales on qkv, o, gate_up and the head, a
    per-tensor one on down); `hidden` rows in the residual stream."""
    r = np.random.default_rng(seed)
    spread = 0.5 if wdt == E4M3 else 0.05

    def w(n, k):
        return jnp.asarray(r.normal(size=(n, k)).astype(np.float32) * spread).astype(wdt)

    def sc(n):
        return jnp.asarray(r.uniform(0.02, 0.05, n) if wdt == E4M3 else r.uniform(0.5, 1.0, n),
                           jnp.float32)

    def norm():
        return jnp.asarray(r.uniform(0.5, 1.5, hidden), jnp.bfloat16)

    out = []
    for _ in range(layers):
        out.append(sifar_jax.LlamaLayer(norm(), w(KV * (GROUP + 2) * D, hidden),
                                        sc(KV * (GROUP + 2) * D), w(hidden, KV * GROUP * D),
                                        sc(hidden), norm(), w(2 * FFN, hidden), sc(2 * FFN),
                                        w(hidden, FFN), sc(1)))
    x = jnp.asarray(r.normal(size=hidden), jnp.bfloat16)
    rope = jnp.asarray(r.uniform(-1, 1, (2, D)), jnp.float32)
    cache = jnp.asarray(r.normal(size=(layers, 2, 1, KV, SLOTS, D)), jnp.bfloat16)
    return x, rope, norm(), out, cache, (w(VOCAB, hidden), sc(VOCAB))


def tp_step_fn(mesh, allreduce="sifar", head=True, axis="tp"):
    """jit(shard_map(llama_step(axis_name=axis))) over `mesh`, taking the TP=1 model's operands
    in tp_layout's order."""
    def f(x, rope, pos, fnorm, layers, cache, hd):
        return sifar_jax.llama_step(x, rope, pos, fnorm, layers, cache, head=hd, axis_name=axis,
                                    allreduce=allreduce, **KW)

    def run(x, rope, pos, fnorm, layers, cache, hd):
        specs = tpm.tp_in_specs(layers, axis, hd)
        if hd is None:
            specs = specs + (None,)
        g = jax.shard_map(f, mesh=mesh, in_specs=specs,
                          out_specs=tpm.tp_out_specs(axis, hd is not None))
        return g(x, rope, pos, fnorm, layers, cache, hd)

    return jax.jit(run)


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def assert_same_bits(got, want, what=""):
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = bits(g), bits(w)
        assert g.shape == w.shape, (what, i, g.shape, w.shape)
        bad = np.count_nonzero(g != w)
        assert bad == 0, f"{what}: result {i}: {bad} of {g.size} elements differ"


def make_mesh(n, **init):
    if len(jax.devices("cpu")) < n:
        pytest.skip(f"needs {n} CPU devices")
    mesh = Mesh(np.array(jax.devices("cpu")[:n]), ("tp",))
    sifar_jax.init(mesh, **init)
    return mesh


@pytest.fixture
def clean():
    sifar_jax.shutdown()
    yield
    try:
        sifar_jax.shutdown()
    except Exception:  # noqa: BLE001 - a test provoked a failure: start clean
        sifar_jax.comm.wait_for_effects()
        sifar_jax.shutdown()


@pytest.mark.parametrize("allreduce", ["sifar", "oneshot"])
@pytest.mark.parametrize("wdt", [E4M3, BF16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_equals_the_virtual_ranks_bit_for_bit(clean, ranks, wdt, allreduce):
    x, rope, fnorm, layers, cache, head = step_operands(wdt, seed=ranks)
    pos = jnp.array([9, 2], jnp.int32)
    want = sifar_jax.llama_step_virtual_ranks(x, rope, pos, fnorm, layers, cache, head=head,
                                              ranks=ranks, allreduce=allreduce, **KW)
    assert not sifar_jax.check_step_status(want[3]).failed
    mesh = make_mesh(ranks)
    before = sifar_jax.stats()[allreduce]["calls"]
    with hang_guard(300):
        got = tp_step_fn(mesh, allreduce)(x, rope, pos, fnorm, tpm.tp_layout(layers, ranks),
                                          cache, head)
        jax.block_until_ready(got)
    sifar_jax.check()
    assert_same_bits(got, want[:3], f"{ranks} ranks {wdt} {allreduce}")
    assert np.isfinite(np.asarray(got[2])).all()
    # Every rank ran 2 phases a layer, counted as calls of the algorithm.
    assert sifar_jax.stats()[allreduce]["calls"] - before == ranks * 2 * LAYERS


def test_without_head_and_per_tensor_scales(clean):
    x, rope, fnorm, layers, cache, _ = step_operands(BF16, layers=3, seed=7)
    layers = [l._replace(qkv_scale=l.qkv_scale[:1], o_scale=l.o_scale[:1],
                         gate_up_scale=l.gate_up_scale[:1]) for l in layers]
    pos = jnp.array([SLOTS - 1, 0], jnp.int32)
    want = sifar_jax.llama_step_virtual_ranks(x, rope, pos, fnorm, layers, cache, ranks=2, **KW)
    mesh = make_mesh(2)
    got = tp_step_fn(mesh, head=False)(x, rope, pos, fnorm, tpm.tp_layout(layers, 2), cache,
                                       None)
    assert len(got) == 2
    sifar_jax.check()
    assert_same_bits(got, want[:2], "no head")


def _loop_fn(mesh, allreduce, steps, with_psum):
    """`steps` decode steps in one jit (fori_loop), the slot advancing (from 4, round the
    cache again); with_psum: a plain sifar_psum of the same axis after every step (the same
    chain: the same lane's epochs)."""
    def body_all(x, rope, fnorm, layers, cache, hd, extra):
        def body(i, carry):
            cache, hs, lgs, sums = carry
            pos = jnp.stack([4 + i % (SLOTS - 4), jnp.int32(0)])
            h, cache, lg = sifar_jax.llama_step(x, rope, pos, fnorm, layers, cache, head=hd,
                                                axis_name="tp", allreduce=allreduce, **KW)
            if with_psum:
                s = sifar_jax.sifar_psum(extra[0] * (i + 1).astype(jnp.float32), "tp",
                                         algorithm="sifar")
                sums = sums.at[i].set(s)
            return cache, hs.at[i].set(h), lgs.at[i].set(lg), sums

        hs = jnp.zeros((steps, HIDDEN), jnp.bfloat16)
        lgs = jax.lax.pcast(jnp.zeros((steps, VOCAB // mesh.size), jnp.float32), ("tp",),
                            to="varying")
        sums = jnp.zeros((steps, extra.shape[1]), jnp.float32)
        return jax.lax.fori_loop(0, steps, body, (cache, hs, lgs, sums))

    def run(x, rope, fnorm, layers, cache, hd, extra):
        specs = tpm.tp_in_specs(layers, "tp", hd)
        specs = (specs[0], specs[1], specs[3], specs[4], specs[5], specs[6], P("tp"))
        g = jax.shard_map(body_all, mesh=mesh, in_specs=specs,
                          out_specs=(P(None, None, None, "tp"), P(), P(None, "tp"), P()))
        return g(x, rope, fnorm, layers, cache, hd, extra)

    return jax.jit(run)


def _virtual_loop(x, rope, fnorm, layers, cache, head, ranks, allreduce, steps):
    hs, lgs = [], []
    for i in range(steps):
        pos = jnp.array([4 + i % (SLOTS - 4), 0], jnp.int32)
        h, cache, lg, st = sifar_jax.llama_step_virtual_ranks(
            x, rope, pos, fnorm, layers, cache, head=head, ranks=ranks, allreduce=allreduce, **KW)
        hs.append(h)
        lgs.append(lg)
    return cache, jnp.stack(hs), jnp.stack(lgs)


@pytest.mark.parametrize("allreduce", ["sifar", "oneshot"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_many_steps_under_skew_and_across_the_tag_wrap(clean, ranks, allreduce):
    """Steps in one jit loop with a plain sifar_psum of the same lane after each, every phase's
    publication delayed by up to 300 us per rank (testing.inject_skew), tags of 3 epoch bits
    (the wrap's clearing every 6 epochs): every step's h, logits and the cache bit for bit
    the virtual ranks'; every psum exact; sifar re-read stale words (the skew reached the
    speculation)."""
    steps = 10
    x, rope, fnorm, layers, cache, head = step_operands(E4M3, seed=11)
    want = _virtual_loop(x, rope, fnorm, layers, cache, head, ranks, allreduce, steps)
    mesh = make_mesh(ranks)
    f = _loop_fn(mesh, allreduce, steps, with_psum=True)
    extra = np.arange(1, ranks * 8 + 1, dtype=np.float32).reshape(ranks, 8) / 7
    lt = tpm.tp_layout(layers, ranks)
    before = sifar_jax.stats()
    with hang_guard(600), testing.inject_skew(300, seed=ranks), testing.epoch_bits("tp", 3):
        got = jax.block_until_ready(f(x, rope, fnorm, lt, cache, head, extra))
    sifar_jax.check()
    after = sifar_jax.stats()
    assert_same_bits(got[:3], want, f"{ranks} ranks {allreduce}")
    sums = np.asarray(got[3])
    for i in range(steps):  # the plain all-reduce's rank-order float32 sum
        parts = [extra[r] * np.float32(i + 1) for r in range(ranks)]
        expect = parts[0]
        for p in parts[1:]:
            expect = expect + p
        np.testing.assert_array_equal(sums[i], expect)
    phases = steps * 2 * LAYERS
    assert after[allreduce]["calls"] - before[allreduce]["calls"] >= ranks * phases
    if allreduce == "sifar":
        assert after["sifar"]["retries"] > before["sifar"]["retries"], \
            "no stale word was ever read: the skew did not reach the reads"


@pytest.mark.parametrize("allreduce", ["sifar", "oneshot"])
def test_absent_rank_fails_clearly_and_the_next_step_after_reinit_is_exact(clean, allreduce):
    ranks = 2
    x, rope, fnorm, layers, cache, head = step_operands(E4M3, seed=3)
    pos = jnp.array([6, 0], jnp.int32)
    lt = tpm.tp_layout(layers, ranks)
    mesh = make_mesh(ranks, timeout_s=0.5)
    f = tp_step_fn(mesh, allreduce)
    good = jax.block_until_ready(f(x, rope, pos, fnorm, lt, cache, head))
    sifar_jax.check()
    t0 = time.perf_counter()
    with hang_guard(120), testing.drop_rank("tp", 1):
        h, _, logits = jax.block_until_ready(f(x, rope, pos, fnorm, lt, cache, head))
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0, f"the timeout took {elapsed:.1f} s"
    assert np.isnan(np.asarray(h, np.float32)).all()
    assert np.isnan(np.asarray(logits)).all()
    with pytest.raises(sifar_jax.SifarError) as e:
        sifar_jax.check()
    msg = str(e.value)
    assert "llama_step's all-reduce of phase 1 (layer 0's o)" in msg, msg
    assert "rank 0" in msg and "rank 1 never arrived" in msg and allreduce in msg, msg
    assert sifar_jax.stats()[allreduce]["timeouts"] > 0
    # The communicator is failed: the next call says so at once.
    with hang_guard(120), pytest.raises(Exception, match="timed out"):
        jax.block_until_ready(f(x, rope, pos, fnorm, lt, cache, head))
    sifar_jax.comm.wait_for_effects()
    sifar_jax.shutdown()
    sifar_jax.init(mesh, timeout_s=0.5)
    sifar_jax.check()
    with hang_guard(120):
        again = jax.block_until_ready(f(x, rope, pos, fnorm, lt, cache, head))
    sifar_jax.check()
    assert_same_bits(again, good, "after re-init")


def test_tp1_axis_runs_the_plain_step(clean):
    x, rope, fnorm, layers, cache, head = step_operands(E4M3, seed=5)
    pos = jnp.array([3, 0], jnp.int32)
    want = sifar_jax.llama_step(x, rope, pos, fnorm, layers, cache, head=head, **KW)
    mesh = make_mesh(1)
    got = tp_step_fn(mesh)(x, rope, pos, fnorm, layers, cache, head)
    assert_same_bits(got, want, "tp=1")


def test_two_axes_one_group_per_line(clean):
    """A ("dp", "tp") mesh of 2 x 2: the step over "tp" runs in both lines of "dp" at once, each
    its own group (the same model here), each bit for bit the virtual ranks'."""
    if len(jax.devices("cpu")) < 4:
        pytest.skip("needs 4 CPU devices")
    mesh = Mesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("dp", "tp"))
    sifar_jax.init(mesh)
    x, rope, fnorm, layers, cache, head = step_operands(E4M3, seed=9)
    pos = jnp.array([5, 1], jnp.int32)
    want = sifar_jax.llama_step_virtual_ranks(x, rope, pos, fnorm, layers, cache, head=head,
                                              ranks=2, **KW)
    got = tp_step_fn(mesh)(x, rope, pos, fnorm, tpm.tp_layout(layers, 2), cache, head)
    sifar_jax.check()
    assert_same_bits(got, want[:3], "dp x tp")


def test_trace_time_errors(clean):
    x, rope, fnorm, layers, cache, head = step_operands(E4M3)
    pos = jnp.array([3, 0], jnp.int32)
    lt = tpm.tp_layout(layers, 2)
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))

    def call(axis="tp", allreduce="sifar", lay=lt, c=cache, specs=None, **kw):
        def f(x, rope, pos, fnorm, layers, cache, hd):
            return sifar_jax.llama_step(x, rope, pos, fnorm, layers, cache, head=hd,
                                        axis_name=axis, allreduce=allreduce, **{**KW, **kw})
        specs = specs or tpm.tp_in_specs(lay, "tp", head)
        g = jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=tpm.tp_out_specs("tp", True))
        return jax.jit(g).lower(x, rope, pos, fnorm, lay, c, head)

    with pytest.raises(sifar_jax.NotInitializedError, match="no communicator for axis 'tp'"):
        call()
    sifar_jax.init(mesh)
    call()  # traces
    with pytest.raises(sifar_jax.UnboundAxisError, match="'model'"):
        call(axis="model")
    with pytest.raises(ValueError, match="allreduce must be one of"):
        call(allreduce="twoshot")
    with pytest.raises(ValueError, match="kv_heads=3 .* do not split over the 2 devices"):
        call(kv_heads=3)
    # Replicated weights: each device sees the whole model, not a shard.
    rep = tpm.tp_in_specs(lt, "tp", head)
    rep = rep[:4] + ([sifar_jax.LlamaLayer(*(P() for _ in s)) for s in rep[4]],) + rep[5:]
    with pytest.raises(ValueError, match=r"layer 0 qkv is \[2048, 256\] here; a shard of "
                                         r"kv_heads=4 over 2 devices has 2 KV heads, 1024 rows"):
        call(specs=rep)
    rep = tpm.tp_in_specs(lt, "tp", head)
    rep = rep[:5] + (P(),) + rep[6:]
    with pytest.raises(ValueError, match=r"the cache is \[2, 2, 1, 4, 16, 128\] here"):
        call(specs=rep)
    sifar_jax.shutdown()
    sifar_jax.init(mesh, slot_bytes=512)
    with pytest.raises(ValueError, match=r"need a slot of 1024 bytes.*slot_bytes=1024"):
        call()


def _skew_ns(max_ns: int, seed: int, rank: int, epoch: int) -> int:
    """protocol.h's SkewNs: the wait testing.inject_skew gives (rank, epoch)."""
    m = (1 << 64) - 1
    z = ((seed << 40) ^ (rank << 32) ^ epoch) & m
    z = (z + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    z ^= z >> 31
    return z % (max_ns + 1)


@pytest.mark.parametrize("allreduce", ["sifar", "oneshot"])
def test_the_step_clears_the_lane_at_the_tag_wrap(clean, allreduce):
    """With 3 epoch bits a lane's epochs run 1..7, 10..15, ...: the wrap falls on the step's
    second phase (epoch 10). A large sifar_psum at epoch 3 leaves tagged words past the step's
    rows in slot 1; the large sifar_psum at epoch 11 (slot 1, the same tag bits) must not accept
    them: rank 1 publishes late (its injected skew at epoch 11 is 90+ ms longer than rank
    0's), so rank 0 reads its words first, and only the step's clearing at the wrap makes them
    stale. Both sums exact."""
    max_ns = 100_000_000
    seed = next(s for s in range(1000)
                if _skew_ns(max_ns, s, 1, 11) - _skew_ns(max_ns, s, 0, 11) > 90_000_000)
    x, rope, fnorm, layers, cache, head = step_operands(E4M3, layers=1, seed=2)
    lt = tpm.tp_layout(layers, 2)
    mesh = make_mesh(2)
    big = 4096  # float32 elements: 16 KB, tagged words far past the step's 256 rows

    def body(x, rope, fnorm, layers, cache, hd, small, b1, b2):
        psum = functools.partial(sifar_jax.sifar_psum, axis_name="tp", algorithm="sifar")
        s = [psum(small[0]), psum(small[0] * 2)]  # epochs 1, 2
        p1 = psum(b1[0])  # epoch 3
        s += [psum(small[0] * k) for k in (3, 4, 5)]  # epochs 4, 5, 6
        h, _, lg = sifar_jax.llama_step(x, rope, jnp.array([3, 0], jnp.int32), fnorm, layers,
                                        cache, head=hd, axis_name="tp", allreduce=allreduce,
                                        **KW)  # epochs 7 and 10: the wrap
        p2 = psum(b2[0])  # epoch 11
        return h, lg, p1, p2, jnp.stack(s)

    specs = tpm.tp_in_specs(lt, "tp", head)
    specs = (specs[0], specs[1], specs[3], specs[4], specs[5], specs[6], P("tp"), P("tp"),
             P("tp"))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs,
                              out_specs=(P(), P("tp"), P(), P(), P())))
    r = np.random.default_rng(0)
    small = r.uniform(1, 2, (2, 4)).astype(np.float32)
    b1 = r.uniform(1, 2, (2, big)).astype(np.float32)
    b2 = r.uniform(-2, -1, (2, big)).astype(np.float32)
    pos = jnp.array([3, 0], jnp.int32)
    want = sifar_jax.llama_step_virtual_ranks(x, rope, pos, fnorm, layers, cache, head=head,
                                              ranks=2, allreduce=allreduce, **KW)
    with hang_guard(300), testing.epoch_bits("tp", 3), testing.inject_skew(max_ns / 1000, seed):
        h, lg, p1, p2, s = jax.block_until_ready(f(x, rope, fnorm, lt, cache, head, small, b1,
                                                   b2))
    sifar_jax.check()
    assert_same_bits((h, lg), want[:3:2], "the step")
    np.testing.assert_array_equal(np.asarray(p1), b1[0] + b1[1])
    np.testing.assert_array_equal(np.asarray(p2), b2[0] + b2[1])


# ------------------------------------------------ the seam with plain calls ----
# On GPUs the plain all-reduce keeps an epoch per protocol block and a call advances only the
# blocks it launches (one per 256 lines of its payload); a step continues from block 0's
# epoch and stores its last one into all 64 (ffi/step/lane_start.h: a barrier across the ranks
# first where a block whose lines the step writes lags block 0 by an odd count, the tagged
# words cleared where a block lags into an earlier tag cycle). These scenarios make the other
# blocks lag between steps: a small psum (block 0 alone), then larger ones, the last one of an
# algorithm that reads the region the step writes (sifar: the tagged words; oneshot: the plain
# partials), over a model whose rows reach protocol block 1 (H = 4096: sifar's rows 512..1023,
# oneshot's 2048..4095). On the CPU (one epoch a lane) they check the same results.

SEAM_HIDDEN = 4096
# The plain calls between two steps: (algorithm, float32 elements).
SEAM_PSUMS = {
    # 32 B (block 0), 8 KB oneshot_db (blocks 0-1), 4 KB sifar (blocks 0-1): block 1 lags
    # block 0 by one, and its last call read the tagged words the sifar step writes.
    "sifar": (("sifar", 8), ("oneshot_db", 2048), ("sifar", 1024)),
    # 32 B, 8 KB sifar (blocks 0-3), 8 KB oneshot_db and sifar_flag (blocks 0-1): block 1 lags
    # by one, and its last call read the plain partials the oneshot step writes.
    "oneshot": (("sifar", 8), ("sifar", 2048), ("oneshot_db", 2048), ("sifar_flag", 2048)),
}


def seam_operands(wdt=E4M3, seed=31):
    """A 1-layer model of SEAM_HIDDEN rows (step_operands)."""
    return step_operands(wdt, layers=1, seed=seed, hidden=SEAM_HIDDEN)


def seam_inputs(ranks, total, seed=0):
    """[ranks, total] integer-valued float32 psum inputs and their sum over the ranks: any
    order of the additions gives the same float32 sum, also times a small integer."""
    r = np.random.default_rng(seed)
    extra = r.integers(-500, 500, (ranks, total)).astype(np.float32)
    return extra, extra.sum(axis=0, dtype=np.float32)


def _u(a):
    return jax.lax.bitcast_convert_type(a, jnp.uint16 if a.dtype.itemsize == 2 else jnp.uint32)


def seam_loop_fn(mesh, allreduce, steps, head):
    """jit(shard_map) of `steps` iterations of [the step at pos, SEAM_PSUMS[allreduce] of the
    same lane] in one fori_loop. Operands: tp_layout's (x, rope, pos, fnorm, layers, cache,
    head), then h0 and lg0 (the step's expected h and logits), extra (P("tp"): each rank's
    psum inputs, [1, total]) and their sum (replicated). Psum j of iteration i sums its slice of
    extra times i + 1. Returns [ranks, 2]: per rank the steps whose h or logits differ from
    (h0, lg0) in any bit, and the psums whose sum is not exact."""
    psums = SEAM_PSUMS[allreduce]

    def body_all(x, rope, pos, fnorm, layers, cache, hd, h0, lg0, extra, total):
        def body(i, carry):
            cache, bad_steps, bad_sums = carry
            h, cache, lg = sifar_jax.llama_step(x, rope, pos, fnorm, layers, cache, head=hd,
                                                axis_name="tp", allreduce=allreduce, **KW)
            same = jnp.all(_u(h) == _u(h0)) & jnp.all(_u(lg) == _u(lg0))
            bad_steps = bad_steps + (~same).astype(jnp.int32)
            k = (i + 1).astype(jnp.float32)
            at = 0
            for alg, n in psums:
                s = sifar_jax.sifar_psum(extra[0, at:at + n] * k, "tp", algorithm=alg)
                bad_sums = bad_sums + jnp.any(s != total[at:at + n] * k).astype(jnp.int32)
                at += n
            return cache, bad_steps, bad_sums

        zero = jax.lax.pcast(jnp.int32(0), ("tp",), to="varying")
        _, bad_steps, bad_sums = jax.lax.fori_loop(0, steps, body, (cache, zero, zero))
        return jnp.stack([bad_steps, bad_sums])[None]

    def specs(lt):
        return tpm.tp_in_specs(lt, "tp", head) + (P(), P("tp"), P("tp"), P())

    def run(x, rope, pos, fnorm, layers, cache, hd, h0, lg0, extra, total):
        g = jax.shard_map(body_all, mesh=mesh, in_specs=specs(layers), out_specs=P("tp"))
        return g(x, rope, pos, fnorm, layers, cache, hd, h0, lg0, extra, total)

    return jax.jit(run), specs


def seam_total(allreduce):
    return sum(n for _, n in SEAM_PSUMS[allreduce])


# Review F2's interleaving, from a fresh communicator with 3 epoch bits (epochs 1..7, 10..15):
# the step (1 layer) at epochs 1 and 2; a 4 KB sifar psum at 3 (blocks 0 and 1: tag-3 words in
# block 1's lines, rows 512..1023, of slot 1); five 32-byte psums at 4, 5, 6, 7 and 10 (block 0
# alone crosses the wrap and clears its own lines only); the step again. Its first phase would
# be epoch 11: slot 1, tag 3 again, so a reader that gets there before the peer has published
# would take the psum's words as the peer's partials of rows 512..1023; the step clears first.
SEAM_WRAP_SMALL = 5


def seam_wrap_fn(mesh, allreduce, head):
    """jit(shard_map) of the sequence above. Operands: tp_layout's (x, rope, pos, fnorm,
    layers, cache, head), then big (P("tp"): [1, 1024] each rank's) and small (P("tp"): [1, 8]).
    Returns (h1, lg1, h2, lg2, the big psum, the small ones [5, 8])."""
    def body(x, rope, pos, fnorm, layers, cache, hd, big, small):
        step = functools.partial(sifar_jax.llama_step, head=hd, axis_name="tp",
                                 allreduce=allreduce, **KW)
        psum = functools.partial(sifar_jax.sifar_psum, axis_name="tp", algorithm="sifar")
        h1, cache, lg1 = step(x, rope, pos, fnorm, layers, cache)
        b = psum(big[0])
        s = [psum(small[0] * k) for k in range(1, SEAM_WRAP_SMALL + 1)]
        h2, _, lg2 = step(x, rope, pos, fnorm, layers, cache)
        return h1, lg1, h2, lg2, b, jnp.stack(s)

    def specs(lt):
        return tpm.tp_in_specs(lt, "tp", head) + (P("tp"), P("tp"))

    def run(x, rope, pos, fnorm, layers, cache, hd, big, small):
        g = jax.shard_map(body, mesh=mesh, in_specs=specs(layers),
                          out_specs=(P(), P("tp"), P(), P("tp"), P(), P()))
        return g(x, rope, pos, fnorm, layers, cache, hd, big, small)

    return jax.jit(run), specs


SEAM_POS = (9, 2)  # 8 keys: one key range of the attention whatever the grid


@pytest.mark.parametrize("allreduce", ["sifar", "oneshot"])
def test_steps_between_plain_calls_of_other_sizes(clean, allreduce):
    """Steps with plain psums of several sizes and algorithms between them (SEAM_PSUMS), under
    skew and 3 epoch bits (wraps in the steps and in the plain calls): every step's h and
    logits the virtual ranks' bits, every psum exact."""
    ranks, steps = 2, 8
    x, rope, fnorm, layers, cache, head = seam_operands()
    pos = jnp.array(SEAM_POS, jnp.int32)
    want = sifar_jax.llama_step_virtual_ranks(x, rope, pos, fnorm, layers, cache, head=head,
                                              ranks=ranks, allreduce=allreduce, **KW)
    mesh = make_mesh(ranks)
    f, _ = seam_loop_fn(mesh, allreduce, steps, head)
    extra, total = seam_inputs(ranks, seam_total(allreduce))
    with hang_guard(600), testing.inject_skew(300, seed=5), testing.epoch_bits("tp", 3):
        bad = jax.block_until_ready(f(x, rope, pos, fnorm, tpm.tp_layout(layers, ranks), cache,
                                      head, want[0], want[2], extra, total))
    sifar_jax.check()
    np.testing.assert_array_equal(np.asarray(bad), 0, err_msg="[mismatching steps, psums]")


@pytest.mark.parametrize("allreduce", ["sifar", "oneshot"])
def test_the_step_after_block_0_wrapped_in_a_plain_call(clean, allreduce):
    """SEAM_WRAP's sequence: both steps the virtual ranks' bits, every psum exact (rank 1
    publishes the second step's first phase well after rank 0 reads it)."""
    ranks = 2
    x, rope, fnorm, layers, cache, head = seam_operands(seed=32)
    pos = jnp.array(SEAM_POS, jnp.int32)
    want = sifar_jax.llama_step_virtual_ranks(x, rope, pos, fnorm, layers, cache, head=head,
                                              ranks=ranks, allreduce=allreduce, **KW)
    mesh = make_mesh(ranks)
    f, _ = seam_wrap_fn(mesh, allreduce, head)
    big, big_sum = seam_inputs(ranks, 1024, seed=1)
    small, small_sum = seam_inputs(ranks, 8, seed=2)
    max_ns = 50_000_000
    seed = next(s for s in range(1000)
                if _skew_ns(max_ns, s, 1, 11) - _skew_ns(max_ns, s, 0, 11) > 40_000_000)
    with hang_guard(300), testing.epoch_bits("tp", 3), testing.inject_skew(max_ns / 1000, seed):
        h1, lg1, h2, lg2, b, s = jax.block_until_ready(
            f(x, rope, pos, fnorm, tpm.tp_layout(layers, ranks), cache, head, big, small))
    sifar_jax.check()
    assert_same_bits((h1, lg1), want[:3:2], "the first step")
    assert_same_bits((h2, lg2), want[:3:2], "the step after the plain wrap")
    np.testing.assert_array_equal(np.asarray(b), big_sum)
    np.testing.assert_array_equal(
        np.asarray(s), small_sum * np.arange(1, SEAM_WRAP_SMALL + 1, dtype=np.float32)[:, None])


# ------------------------------------------------------ the lane's start ----
# ffi/step/lane_start.h: where a step begins on its lane when the plain all-reduce's protocol
# blocks lag behind block 0 (GPUs), compiled alone with the host's C++ compiler.

def _compile_lane_start(tmp_path):
    """The C++ test program of ffi/step/lane_start.h (the lane's start rule both backends
    share), built with the host's C++ compiler."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    ffi = Path(__file__).resolve().parents[2] / "ffi"
    src = tmp_path / "lane_start_test.cc"
    src.write_text(r'''
#include <cstdio>
#include "step/lane_start.h"
using namespace sifar;
int main() {
  unsigned mask, n, written, e[kMaxBlocks];
  while (std::scanf("%u %u %u", &mask, &n, &written) == 3) {
    for (unsigned b = 0; b < n; ++b) std::scanf("%u", &e[b]);
    const step::LaneStart s = step::StepLaneStart(e, static_cast<int>(n), static_cast<int>(written), mask);
    std::printf("%u %d %d %u %u\n", s.epoch, s.barrier, s.clear, s.barrier_value, s.clear_value);
  }
  const int hs[] = {256, 512, 1024, 2048, 4096, 8192, 32768, 65536};
  for (int hh : hs) std::printf("W %d %d %d\n", hh, step::StepBlocksWritten(hh, kSifar),
                                step::StepBlocksWritten(hh, kOneshot));
  return 0;
}
''')
    exe = tmp_path / "lane_start_test"
    p = subprocess.run([cxx, "-std=c++17", "-O1", "-I", str(ffi), str(src), "-o", str(exe)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return exe


def test_the_lane_start_rule(tmp_path):
    """lane_start.h on the host: where a step begins from the lane's per-block epochs, and
    the protocol blocks one phase writes (sifar: 512 rows a block, oneshot: 2048)."""
    exe = _compile_lane_start(tmp_path)
    M24, M3 = (1 << 24) - 1, 7

    def bv(e):  # BarrierValue(e, top)
        return (4 * e + 1) & 0xFFFFFFFF

    E = 1000
    rest = [E] * 62
    cases = [
        # (mask, epochs, written) -> (epoch, barrier, clear, barrier value, clear value)
        ((M24, [E] * 64, 8), (E, 0, 0, 0, 0)),  # no lag: no barrier
        # block 1 lags by one (a small psum, then a 4 KB one), its lines written: barrier,
        # two epochs skipped
        ((M24, [E + 2, E + 1] + rest, 2), (E + 4, 1, 0, bv(E + 3), 0)),
        # ... by two (the other slot): nothing
        ((M24, [E + 2, E] + rest, 2), (E + 2, 0, 0, 0, 0)),
        # ... by one, its lines not written by the step (H = 256): nothing
        ((M24, [E + 1, E] + rest, 1), (E + 1, 0, 0, 0, 0)),
        # a block lags into the previous cycle (block 0 wrapped in a plain call: 7 -> 10; block
        # 1 at 3, the same parity as 10): the clearing, between barriers at 11 and 12
        ((M3, [10, 3] + [2] * 62, 2), (12, 1, 1, bv(11), bv(12))),
        # ... even where no block the step writes lags (block 5 only)
        ((M3, [10] * 5 + [6] + [10] * 58, 2), (12, 1, 1, bv(11), bv(12))),
        # the two skipped epochs cross the wrap (6 -> 7 -> 10): the clearing too
        ((M3, [6, 5] + [6] * 62, 2), (10, 1, 1, bv(7), bv(10))),
        # the 32-bit counter wraps with the tag (0xffffffff -> 2): another cycle
        ((M24, [2, 0xFFFFFFFE] + [2] * 62, 1), (4, 1, 1, bv(3), bv(4))),
        # the CPU: one block, never a lag
        ((M24, [E], 1), (E, 0, 0, 0, 0)),
    ]
    text = "".join(f"{m} {len(e)} {w} {' '.join(map(str, e))}\n" for (m, e, w), _ in cases)
    out = subprocess.run([str(exe)], input=text, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    got = [tuple(int(v) for v in ln.split()) for ln in lines if not ln.startswith("W")]
    for (args, want), g in zip(cases, got, strict=True):
        assert g == want, (args[0], args[1][:2], args[2], g, want)
    written = {int(ln.split()[1]): tuple(int(v) for v in ln.split()[2:])
               for ln in lines if ln.startswith("W")}
    assert written == {256: (1, 1), 512: (1, 1), 1024: (2, 1), 2048: (4, 1), 4096: (8, 2),
                       8192: (16, 4), 32768: (64, 16), 65536: (64, 32)}


# ---------------------------------------------------------------- GPUs ----
# Ranks on the GPUs of this process (peer access); the two-process ways (one GPU per process,
# two processes sharing one GPU) are test_step_multiprocess.py's.

def _gpus(n):
    try:
        gpus = [d for d in jax.devices("gpu") if d.platform == "gpu"]
    except RuntimeError:
        gpus = []
    if len(gpus) < n:
        pytest.skip(f"needs {n} GPUs in this process")
    return gpus[:n]


def _gpu_mesh(n, **init):
    mesh = Mesh(np.array(_gpus(n)), ("tp",))
    sifar_jax.init(mesh, **init)
    return mesh


@pytest.mark.parametrize("allreduce", ["sifar", "oneshot"])
@pytest.mark.parametrize("wdt", [E4M3, BF16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_gpu_equals_the_virtual_rank_kernel(clean, ranks, wdt, allreduce):
    """The kernel across R GPUs against the virtual-rank kernel on GPU 0, bit for bit: h, the
    cache and the logits (slot 9 < 64 keys: each KV head's attention is one key range whatever
    the grid, so the two kernels compute the same sums)."""
    mesh = _gpu_mesh(ranks)
    x, rope, fnorm, layers, cache, head = step_operands(wdt, seed=ranks)
    pos = jnp.array([9, 2], jnp.int32)
    ops = jax.device_put((x, rope, pos, fnorm, layers, cache, head), mesh.devices.flat[0])
    want = sifar_jax.llama_step_virtual_ranks(*ops[:6], head=ops[6], ranks=ranks,
                                              allreduce=allreduce, **KW)
    assert not sifar_jax.check_step_status(want[3]).failed
    got = tp_step_fn(mesh, allreduce)(x, rope, pos, fnorm, tpm.tp_layout(layers, ranks), cache,
                                      head)
    jax.block_until_ready(got)
    sifar_jax.check()
    assert_same_bits(got, want[:3], f"GPUs: {ranks} ranks {wdt} {allreduce}")


@pytest.mark.parametrize("allreduce", ["sifar", "oneshot"])
def test_gpu_skewed_steps_change_no_bit(clean, allreduce):
    """SIFAR_STEP_STRESS_STEPS steps (default 500) in one jit loop, every block's publication
    delayed by up to 20 us (testing.inject_skew), tags of 3 epoch bits (a wrap every 6
    epochs): every step's h and logits the virtual ranks' bits; sifar re-read stale words."""
    import os

    steps = int(os.environ.get("SIFAR_STEP_STRESS_STEPS", "500"))
    mesh = _gpu_mesh(2)
    x, rope, fnorm, layers, cache, head = step_operands(E4M3, seed=13)
    f = _loop_fn(mesh, allreduce, steps, with_psum=True)
    ops = jax.device_put((x, rope, fnorm, layers, cache, head), mesh.devices.flat[0])
    want = _virtual_loop(*ops, 2, allreduce, steps)
    extra = np.arange(1, 17, dtype=np.float32).reshape(2, 8) / 7
    before = sifar_jax.stats()
    with testing.inject_skew(20, seed=1), testing.epoch_bits("tp", 3):
        got = jax.block_until_ready(f(x, rope, fnorm, tpm.tp_layout(layers, 2), cache, head,
                                      extra))
    sifar_jax.check()
    assert_same_bits(got[:3], want, f"GPUs: skewed {allreduce}")
    if allreduce == "sifar":
        assert sifar_jax.stats()["sifar"]["retries"] > before["sifar"]["retries"]


@pytest.mark.parametrize("allreduce", ["sifar", "oneshot"])
def test_gpu_absent_rank_fails_within_the_timeout(clean, allreduce):
    mesh = _gpu_mesh(2, timeout_s=0.2)
    x, rope, fnorm, layers, cache, head = step_operands(E4M3, seed=3)
    pos = jnp.array([6, 0], jnp.int32)
    lt = tpm.tp_layout(layers, 2)
    f = tp_step_fn(mesh, allreduce)
    good = jax.block_until_ready(f(x, rope, pos, fnorm, lt, cache, head))
    t0 = time.perf_counter()
    with testing.drop_rank("tp", 1):
        h, _, logits = jax.block_until_ready(f(x, rope, pos, fnorm, lt, cache, head))
    assert time.perf_counter() - t0 < 3.0
    assert np.isnan(np.asarray(h, np.float32)).all() and np.isnan(np.asarray(logits)).all()
    with pytest.raises(sifar_jax.SifarError, match=r"phase 1 \(layer 0's o\) failed.*rank 1 "
                                                   r"never arrived"):
        sifar_jax.check()
    sifar_jax.shutdown()
    sifar_jax.init(mesh, timeout_s=0.2)
    again = jax.block_until_ready(f(x, rope, pos, fnorm, lt, cache, head))
    sifar_jax.check()
    assert_same_bits(again, good, "GPUs: after re-init")

def _gpu_seam_want(mesh, allreduce, seed):
    x, rope, fnorm, layers, cache, head = seam_operands(seed=seed)
    pos = jnp.array(SEAM_POS, jnp.int32)
    ops = jax.device_put((x, rope, pos, fnorm, layers, cache, head), mesh.devices.flat[0])
    want = sifar_jax.llama_step_virtual_ranks(*ops[:6], head=ops[6], ranks=2,
                                              allreduce=allreduce, **KW)
    assert not sifar_jax.check_step_status(want[3]).failed
    return (x, rope, pos, fnorm, tpm.tp_layout(layers, 2), cache, head), want


@pytest.mark.parametrize("allreduce", ["sifar", "oneshot"])
def test_gpu_steps_between_plain_calls_of_other_sizes(clean, allreduce):
    """The seam between the plain all-reduce's per-block epochs and the step (review F1, F2)
    on 2 GPUs: SIFAR_STEP_STRESS_STEPS iterations (default 500) of [the step, SEAM_PSUMS]
    under 20 us of skew and 3 epoch bits: no timeout, every step the virtual-rank kernel's
    bits, every psum exact (before the fix: the sifar step timed out now and then, the
    oneshot step's last psum could be wrong)."""
    import os

    steps = int(os.environ.get("SIFAR_STEP_STRESS_STEPS", "500"))
    mesh = _gpu_mesh(2)
    ops, want = _gpu_seam_want(mesh, allreduce, seed=31)
    f, _ = seam_loop_fn(mesh, allreduce, steps, ops[6])
    extra, total = seam_inputs(2, seam_total(allreduce))
    with testing.inject_skew(20, seed=3), testing.epoch_bits("tp", 3):
        bad = jax.block_until_ready(f(*ops, want[0], want[2], extra, total))
    sifar_jax.check()
    np.testing.assert_array_equal(np.asarray(bad), 0, err_msg="[mismatching steps, psums]")


@pytest.mark.parametrize("allreduce", ["sifar", "oneshot"])
def test_gpu_the_step_after_block_0_wrapped_in_a_plain_call(clean, allreduce):
    """SEAM_WRAP's sequence on 2 GPUs from a fresh communicator, up to 5 ms of skew per (rank,
    epoch, block): both steps the virtual-rank kernel's bits, every psum exact (before the
    fix the second step could take the 4 KB psum's words of protocol block 1 for the peer's
    partials: a wrong h without an error)."""
    mesh = _gpu_mesh(2)
    ops, want = _gpu_seam_want(mesh, allreduce, seed=32)
    f, _ = seam_wrap_fn(mesh, allreduce, ops[6])
    big, big_sum = seam_inputs(2, 1024, seed=1)
    small, small_sum = seam_inputs(2, 8, seed=2)
    for seed in range(3):  # the skew draws differ: three chances for a reader to come early
        sifar_jax.shutdown()
        sifar_jax.init(mesh)
        with testing.epoch_bits("tp", 3), testing.inject_skew(5000, seed):
            h1, lg1, h2, lg2, b, s = jax.block_until_ready(f(*ops, big, small))
        sifar_jax.check()
        assert_same_bits((h1, lg1), want[:3:2], f"the first step (seed {seed})")
        assert_same_bits((h2, lg2), want[:3:2], f"the step after the plain wrap (seed {seed})")
        np.testing.assert_array_equal(np.asarray(b), big_sum)
        np.testing.assert_array_equal(np.asarray(s), small_sum * np.arange(
            1, SEAM_WRAP_SMALL + 1, dtype=np.float32)[:, None])
