"""psum_add_rmsnorm (the all-reduce + residual add + RMSNorm in one call), on
the CPU backend and, where two GPUs exist, on the CUDA backend: the cpu_mesh
fixture of test_ordering runs every test on both.

- new_residual is bit-identical to the unfused `residual + sifar_psum(x)`, to
  the model's rounding points (NumPy), and to `residual + lax.psum(x)` on data
  whose sums are exact in any order.
- normed is within an ulp of y (2 of normed, see MAX_ULPS) of a float64 NumPy
  reference of the model's rounding points and of the unfused JAX norm of the
  rounded sum, in at most 0.1% of the elements (float32: within a few ulp,
  counted).
- Hidden sizes 64 and 128 (rows inside one block), rows of 2, 4 and 8
  blocks' lines (clusters of 2, 4 and 8 blocks on GPUs), rows of 16, 32 and 64
  blocks' lines (32-128 KB: clusters of 8 thread blocks each running 2, 4 or 8
  of the protocol's blocks), 1-5 tokens, TP 2/4/8, three dtypes; payloads over
  more than one round of blocks.
- Fused and plain calls interleaved on one communicator (one chain, a scan
  body's chain, across the tag wrap, under skew) stay exact; a timed-out call
  fails both outputs; fallbacks warn once and keep the semantics; the result
  types follow lax.psum's under shard_map(check_vma=True).

On the GPU host: python -m pytest -q tests/sifar_jax/test_fused.py -k gpu
"""

from __future__ import annotations

import re
import time
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sifar_jax
from sifar_jax import fused, plan, testing
from sifar_jax.fused import rms_norm
from test_ordering import cpu_mesh, rng_for  # noqa: F401 - the cpu/gpu mesh fixture

SLOT = 64 * 1024
EPS = 1e-5
DTYPES = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
}
# normed: the most ulps any element may differ from a reference, and the
# largest fraction of elements that may differ at all.  The scale's last fp32
# bits depend on the order of the sum of squares and on the rsqrt, so y (x * s
# rounded to the dtype) may round the other way in rare elements: 1 ulp of y,
# which the weight (|w| up to ~1.3 here) can turn into 2 ulps of normed.
# float32 keeps every bit of the scale, so most elements move by an ulp or
# a few (on GPUs both sides use the approximate rsqrt, ~2 ulp each): a loose
# bound and no count bound there.
MAX_ULPS = {"bfloat16": 2, "float16": 2, "float32": 16}
MAX_DIFFERING = {"bfloat16": 1e-3, "float16": 1e-3, "float32": 1.0}


# ----------------------------------------------------------------- references --
def model_reference(parts: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps=EPS):
    """(normed, new_residual) at the model's rounding points: the rank-order
    float32 all-reduce rounded once, the add rounded once, the statistics in
    float64, y rounded to the dtype, the weight product rounded once."""
    dtype = parts.dtype
    acc = parts[0].astype(np.float32)
    for p in parts[1:]:
        acc = (acc + p.astype(np.float32)).astype(np.float32)
    new_residual = (acc.astype(dtype).astype(np.float32) + residual.astype(np.float32)).astype(dtype)
    xf = new_residual.astype(np.float64)
    scale = 1.0 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = (xf * scale).astype(np.float32).astype(dtype)
    normed = (weight.astype(np.float64) * y.astype(np.float64)).astype(np.float32).astype(dtype)
    return normed, new_residual


def ordered(a: np.ndarray) -> np.ndarray:
    """Each float's bits as an integer that counts ulps (monotonic in value)."""
    a = np.ascontiguousarray(a)
    bits = a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize]).astype(np.int64)
    sign = 1 << (8 * a.dtype.itemsize - 1)
    return np.where(bits & sign, -(bits & (sign - 1)), bits)


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(ordered(a) - ordered(b))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool((ordered(a) == ordered(b)).all())


class UlpCount:
    """Ulp differences of normed against one reference, over many cases."""

    def __init__(self, name: str, dtype: str):
        self.name, self.dtype = name, dtype
        self.total = self.differing = self.worst = 0

    def add(self, got, want):
        d = ulps(got, want)
        self.total += d.size
        self.differing += int((d > 0).sum())
        self.worst = max(self.worst, int(d.max()))

    def check(self):
        print(f"normed vs {self.name} ({self.dtype}): {self.differing} of {self.total} elements "
              f"differ, at most {self.worst} ulp")
        assert self.worst <= MAX_ULPS[self.dtype], f"{self.name}: {self.worst} ulp"
        assert self.differing <= max(1, MAX_DIFFERING[self.dtype] * self.total), (
            f"{self.name}: {self.differing} of {self.total} elements differ")


def make_data(rng, kind: str, n: int, tokens: int, hidden: int, dtype):
    """Partials, residual and weight. "exact": small integers, whose sums are
    exact in every order and every dtype; "normal": random normal data."""
    if kind == "exact":
        x = rng.integers(-16, 17, (n, tokens, hidden)).astype(dtype)
        r = rng.integers(-64, 65, (tokens, hidden)).astype(dtype)
        w = (1 + 0.125 * rng.integers(-4, 5, hidden)).astype(dtype)
    else:
        x = rng.standard_normal((n, tokens, hidden)).astype(dtype)
        r = (2 * rng.standard_normal((tokens, hidden))).astype(dtype)
        w = (1 + 0.1 * rng.standard_normal(hidden)).astype(dtype)
    return x, r, w


def cases(dtype) -> list[tuple[int, int]]:
    """(hidden, tokens): rows inside a block (64, 128: segments of 16 and 32
    lines in 16-bit types) and over 2, 4 and 8 blocks' lines (16-bit: 2048,
    4096, 8192; float32: 1024, 2048, 4096), rows over 16 and 32 blocks' lines
    (16-bit: 16384, 12288 padded to 16 blocks; float32: 8192, 16384, and 5120
    padded to 16 blocks), and rows that are not a power of two of lines,
    padded in the payload (ffi/fused/fused.h): 5120 (10 KB in 16-bit types,
    padded to 8 blocks), 896 (within a block), 96 (within a warp); float32
    3584 (14 KB, 4 blocks' lines padded to 8). Every token count 1-4 at least
    once (one compile per dtype and mesh: keep it small). 64-block rows need a
    larger slot: test_payload_over_more_than_one_round_of_blocks."""
    if np.dtype(dtype).itemsize == 2:
        return [(64, 1), (64, 3), (128, 2), (128, 4), (2048, 3), (4096, 1), (4096, 4),
                (8192, 3), (8192, 2), (5120, 2), (896, 3), (96, 1), (16384, 2), (12288, 1)]
    return [(64, 1), (64, 3), (128, 2), (128, 4), (1024, 2), (2048, 1), (4096, 1),
            (4096, 4), (3584, 1), (96, 3), (8192, 2), (16384, 1), (5120, 1)]


def fused_and_references(mesh, shapes):
    """One jit over several (hidden, tokens) shapes: per shape the fused call
    and, on one chain with it, the unfused sifar and lax.psum compositions.
    Every output comes back from every rank."""
    k = len(shapes)

    def body(*args):
        out = []
        for x, r, w in zip(args[:k], args[k:2 * k], args[2 * k:]):
            x = x[0]
            normed, new_residual = sifar_jax.psum_add_rmsnorm(x, r, w, "tp", eps=EPS)
            sifar_res = r + sifar_jax.sifar_psum(x, "tp")
            psum_res = r + jax.lax.psum(x, "tp")
            # The model's formula on the rounded sum (the barrier keeps XLA
            # from feeding the norm the unrounded float32 sum), and as XLA
            # compiles the model, which may.
            sifar_norm = rms_norm(jax.lax.optimization_barrier(sifar_res), w, EPS)
            psum_norm = rms_norm(jax.lax.optimization_barrier(psum_res), w, EPS)
            xla_norm = rms_norm(sifar_res, w, EPS)
            out += [v[None] for v in (normed, new_residual, sifar_res, sifar_norm, psum_res,
                                      psum_norm, xla_norm)]
        return tuple(out)

    specs = (P("tp"),) * k + (P(),) * (2 * k)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P("tp"),) * (7 * k)))


# ------------------------------------------------------------------ exactness --
# Every dtype at TP=2 (what a 2-GPU host runs), bfloat16 (the models' dtype) at 2/4/8.
@pytest.mark.parametrize("n,dtype", [(2, "bfloat16"), (4, "bfloat16"), (8, "bfloat16"),
                                     (2, "float16"), (2, "float32"), (8, "float16")])
def test_fused_matches_the_unfused_composition(cpu_mesh, n, dtype):
    mesh = cpu_mesh(n, slot_bytes=SLOT)
    dt = DTYPES[dtype]
    shapes = cases(dt)
    f = fused_and_references(mesh, shapes)
    counts = {name: UlpCount(name, dtype) for name in
              ("the float64 model reference", "the unfused sifar norm", "the lax.psum norm")}
    xla = UlpCount("XLA's compiled unfused norm (excess precision allowed)", dtype)
    for kind in ("normal", "exact"):
        rng = rng_for("fused", n, dtype, kind)
        data = [make_data(rng, kind, n, t, h, dt) for h, t in shapes]
        args = [d[0] for d in data] + [d[1] for d in data] + [d[2] for d in data]
        outs = jax.device_get(f(*args))
        for i, ((h, t), (x, r, w)) in enumerate(zip(shapes, data)):
            normed, new_res, sifar_res, sifar_norm, psum_res, psum_norm, xla_norm = outs[7 * i:7 * i + 7]
            what = f"{kind} hidden={h} tokens={t}"
            for name, v in (("normed", normed), ("new_residual", new_res)):
                assert all(same_bits(v[r_], v[0]) for r_ in range(n)), f"{what}: ranks differ in {name}"
            want_norm, want_res = model_reference(x, r, w)
            assert same_bits(new_res[0], sifar_res[0]), f"{what}: new_residual != residual + sifar_psum"
            assert same_bits(new_res[0], want_res), f"{what}: new_residual != the rank-order reference"
            if kind == "exact":
                assert same_bits(new_res[0], psum_res[0]), f"{what}: new_residual != residual + lax.psum"
                counts["the lax.psum norm"].add(normed[0], psum_norm[0])
            counts["the float64 model reference"].add(normed[0], want_norm)
            counts["the unfused sifar norm"].add(normed[0], sifar_norm[0])
            xla.add(normed[0], xla_norm[0])
    for c in counts.values():
        c.check()
    # Reported, bounded loosely: XLA may normalise the unrounded sum.
    print(f"normed vs {xla.name}: {xla.differing} of {xla.total} differ, at most {xla.worst} ulp")
    assert xla.worst <= 4 * MAX_ULPS[dtype]


# The hidden sizes of models whose rows are not a power of two of lines
# (Qwen2.5-14B/32B and Llama-2-13B: 5120; Qwen2.5-7B: 3584; Qwen2.5-0.5B:
# 896), the large models' rows over 16 KB (Llama-3-70B's 8192 in float32,
# 12288 of 175B-class models, Llama-3.1-405B's 16384), and float32 rows: all
# fused, none falls back.
MODEL_ROWS = [("bfloat16", 5120, 2), ("bfloat16", 3584, 1), ("bfloat16", 896, 4),
              ("float16", 3584, 3), ("float32", 3584, 2), ("float32", 896, 1),
              ("float32", 8192, 1), ("bfloat16", 12288, 1), ("bfloat16", 16384, 2),
              ("float16", 12288, 2), ("float32", 16384, 1), ("float32", 5120, 2)]


@pytest.mark.parametrize("dtype,hidden,tokens", MODEL_ROWS,
                         ids=[f"{d}-{h}x{t}" for d, h, t in MODEL_ROWS])
def test_model_hidden_sizes_are_fused(cpu_mesh, dtype, hidden, tokens, monkeypatch):
    """The fused call itself runs (no fallback warning; the lowered program
    calls the fused target) and matches the unfused composition and the
    model's reference as every other row does."""
    monkeypatch.setattr(plan, "warned", set())
    n = 2
    mesh = cpu_mesh(n, slot_bytes=SLOT)
    dt = DTYPES[dtype]
    f = fused_and_references(mesh, [(hidden, tokens)])
    x, r, w = make_data(rng_for("model rows", dtype, hidden), "normal", n, tokens, hidden, dt)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="sifar_jax")
        text = f.lower(x, r, w).as_text()
    assert text.count(sifar_jax._ext.TARGETS.psum_add_rmsnorm) == 1
    normed, new_res, sifar_res, sifar_norm = jax.device_get(f(x, r, w))[:4]
    want_norm, want_res = model_reference(x, r, w)
    assert same_bits(new_res[0], want_res) and same_bits(new_res[0], sifar_res[0])
    assert same_bits(new_res[1], new_res[0]) and same_bits(normed[1], normed[0])
    for ref in (want_norm, sifar_norm[0]):
        assert ulps(normed[0], ref).max() <= MAX_ULPS[dtype]


def test_payload_over_more_than_one_round_of_blocks(cpu_mesh):
    """Payloads past 64 blocks x 256 lines: every block runs two rounds (a
    partial last block for the short rows), clusters included; rows of 16
    blocks (16384: 4 rows a round, the second round partial) and of 64 blocks
    (40960, 80 KB padded to 128 KB: a row a round, 8 of the protocol's blocks
    per thread block)."""
    n = 2
    mesh = cpu_mesh(n, slot_bytes=256 * 1024)
    dt = DTYPES["bfloat16"]
    shapes = [(4096, 20), (64, 1100), (16384, 5), (40960, 2)]
    f = fused_and_references(mesh, shapes)
    rng = rng_for("rounds")
    data = [make_data(rng, "normal", n, t, h, dt) for h, t in shapes]
    outs = jax.device_get(f(*([d[0] for d in data] + [d[1] for d in data] + [d[2] for d in data])))
    count = UlpCount("the float64 model reference", "bfloat16")
    for i, (x, r, w) in enumerate(data):
        normed, new_res, sifar_res = outs[7 * i:7 * i + 3]
        want_norm, want_res = model_reference(x, r, w)
        assert same_bits(new_res[0], want_res) and same_bits(new_res[0], sifar_res[0])
        assert same_bits(new_res[1], new_res[0]) and same_bits(normed[1], normed[0])
        count.add(normed[0], want_norm)
    count.check()


# ------------------------------------------------------------------- ordering --
def chain_reference(xs, zs, r0, w):
    """The interleaved chain of test_fused_and_plain_calls_interleave: per
    step, the fused call carrying the residual, then a plain all-reduce."""
    r, outs = r0, []
    for k in range(xs.shape[1]):
        normed, r = model_reference(xs[:, k], r, w)
        plain = model_reference(zs[:, k], np.zeros_like(r0), w)[1]  # the sum alone
        outs.append((normed, r, plain))
    return outs


@pytest.mark.parametrize("n,hidden", [(2, 4096), (4, 4096), (2, 16384)])
def test_fused_and_plain_calls_interleave_on_one_communicator(cpu_mesh, n, hidden):
    """Fused and plain calls alternate on one chain, and a scan body's fused
    chain (another lane) runs beside them; under skew and across the tag wrap
    (4 epoch bits: a wrap every 14 calls) every result stays exact. A small
    plain call (one block) between them moves the first block's epoch ahead of
    the other blocks of its row, so a row's blocks wrap at different calls
    (hidden 16384: also the two protocol blocks that one thread block runs)."""
    tokens, steps = 2, 6  # 16 KB and more: past XLA:CPU's in-order threshold for small thunks
    mesh = cpu_mesh(n, slot_bytes=SLOT)
    dt = DTYPES["bfloat16"]

    def body(xs, zs, r0, w):
        xs, zs = xs[0], zs[0]
        r, outs = r0, []
        for k in range(steps):
            normed, r = sifar_jax.psum_add_rmsnorm(xs[k], r, w, "tp", eps=EPS)
            outs += [normed, r, sifar_jax.sifar_psum(zs[k], "tp"),
                     sifar_jax.sifar_psum(zs[k][:, :64], "tp")]

        def step(c, x):
            normed, c = sifar_jax.psum_add_rmsnorm(x, c, w, "tp", eps=EPS)
            return c, (normed, c)

        _, (scan_normed, scan_res) = jax.lax.scan(step, r0, xs)
        return tuple(v[None] for v in outs + [scan_normed, scan_res])

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp"), P(), P()),
                              out_specs=(P("tp"),) * (4 * steps + 2)))
    count = UlpCount("the float64 model reference", "bfloat16")
    before = sifar_jax.stats()["sifar"]["calls"]
    runs = 4
    with testing.epoch_bits("tp", 4), testing.inject_skew(200, seed=13):
        for it in range(runs):
            rng = rng_for("interleave", it)
            xs = rng.standard_normal((n, steps, tokens, hidden)).astype(dt)
            zs = rng.standard_normal((n, steps, tokens, hidden)).astype(dt)
            r0 = (2 * rng.standard_normal((tokens, hidden))).astype(dt)
            w = (1 + 0.1 * rng.standard_normal(hidden)).astype(dt)
            got = jax.device_get(f(xs, zs, r0, w))
            want = chain_reference(xs, zs, r0, w)
            for k, (normed, res, plain) in enumerate(want):
                assert same_bits(got[4 * k + 1][0], res), f"run {it} step {k}: new_residual"
                assert same_bits(got[4 * k + 2][0], plain), f"run {it} step {k}: plain sum"
                assert same_bits(got[4 * k + 3][0], plain[:, :64]), f"run {it} step {k}: small sum"
                count.add(got[4 * k][0], normed)
                # The scan's chain computes the same recurrence.
                assert same_bits(got[-1][0][k], res), f"run {it} scan step {k}: new_residual"
                count.add(got[-2][0][k], normed)
                for v in got[4 * k:4 * k + 4] + (got[-2], got[-1]):
                    assert all(same_bits(v[q], v[0]) for q in range(n)), "ranks differ"
    sifar_jax.check()
    count.check()
    # A fused call is one all-reduce of the communicator: counted with sifar's.
    calls = sifar_jax.stats()["sifar"]["calls"] - before
    if mesh.devices.flat[0].platform == "cpu":
        assert calls == runs * n * 4 * steps
    else:
        # XLA:GPU may execute a side-effect-free custom call more than once
        # (measured on 2x H200: one extra call per step); every execution is
        # a whole all-reduce on every rank, so results stay exact (checked above).
        assert calls >= runs * n * 4 * steps, calls


# -------------------------------------------------------------------- failure --
@pytest.mark.parametrize("hidden,tokens,from_block", [(4096, 2, 1), (4096, 2, 4), (64, 3, 0),
                                                      (16384, 2, 9), (16384, 2, 16)])
def test_a_timed_out_fused_call_fails_both_outputs(cpu_mesh, hidden, tokens, from_block):
    """Rank 1's blocks from `from_block` on never arrive. On GPUs every element
    of both of rank 0's outputs must be NaN, also where a whole cluster (a
    row) succeeded (from_block 4: the first row's cluster; 16: the first
    32 KB row's); from_block 9 drops one of the two protocol blocks a thread
    block runs. The CPU backend raises. Either way check() then reports the
    timeout."""
    n = 2
    mesh = cpu_mesh(n, slot_bytes=SLOT)
    dt = DTYPES["bfloat16"]
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    if on_cpu:  # a CPU rank is one block: it drops all of it or nothing
        if from_block > 1:
            pytest.skip("the same CPU test as from_block=1")
        from_block = 0

    def body(x, r, w):
        normed, new_residual = sifar_jax.psum_add_rmsnorm(x[0], r, w, "tp", eps=EPS)
        return normed[None], new_residual[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()),
                              out_specs=(P("tp"), P("tp"))))
    x, r, w = make_data(rng_for("timeout", hidden), "normal", n, tokens, hidden, dt)
    jax.block_until_ready(f(x, r, w))  # compiled; the buffer pool holds plausible numbers
    t0 = time.perf_counter()
    with testing.timeout(0.3), testing.drop_rank("tp", 1, from_block=from_block):
        if on_cpu:
            with pytest.raises(Exception, match="timed out"):
                jax.block_until_ready(f(x, r, w))
        else:
            normed, new_residual = jax.device_get(f(x, r, w))
            for name, v in (("normed", normed[0]), ("new_residual", new_residual[0])):
                v = v.astype(np.float32)
                assert np.isnan(v).all(), f"{name}: {np.count_nonzero(~np.isnan(v))} of {v.size} not NaN"
    assert time.perf_counter() - t0 < 30
    with pytest.raises(sifar_jax.SifarError, match="timed out") as failure:
        sifar_jax.check()
    # The record names a protocol block that waited for a dropped one (a thread block running
    # several protocol blocks names the one it waited for, not its own index).
    named = int(re.search(r"block (\d+)", str(failure.value)).group(1))
    assert named >= from_block, str(failure.value)


# ------------------------------------------------------------------ fallbacks --
FALLBACKS = {
    # case: (dtype, hidden, tokens, algorithm, slot_bytes, warnings expected)
    "row_not_whole_lines": ("bfloat16", 12, 2, "auto", SLOT, ["not a layout"]),
    # 160 KB: over one round of blocks (128 KB), in a slot sifar_psum serves it from.
    "row_over_a_round_of_blocks": ("float32", 40960, 1, "auto", 256 * 1024, ["not a layout"]),
    # 30 KB fits a 32 KB slot (sifar_psum serves it), its padded rows (48 KB) do not:
    # under "auto" a payload past the slot is quiet (sifar_jax.plan, the rule).
    "padded_payload_over_the_slot": ("bfloat16", 5120, 3, "auto", 32 * 1024, []),
    # 72 KB fits an 80 KB slot, its rows padded to 16 blocks (96 KB) do not.
    "wide_padded_payload_over_the_slot": ("bfloat16", 12288, 3, "auto", 80 * 1024, []),
    "another_algorithm": ("bfloat16", 128, 2, "oneshot", SLOT, ["runs the sifar algorithm"]),
    "payload_over_the_slot": ("bfloat16", 4096, 1, "auto", 4096, []),  # lax.psum's, quietly
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_fallbacks_warn_once_and_keep_the_semantics(cpu_mesh, case, monkeypatch):
    """Where the fused kernel cannot run, the unfused composition runs (sifar_psum,
    which itself may fall back to lax.psum), with a warning once per reason (none
    for a payload past the slot under "auto": large payloads are lax.psum's);
    the results keep the fused call's rounding points."""
    monkeypatch.setattr(plan, "warned", set())
    dtype, hidden, tokens, algorithm, slot, expected = FALLBACKS[case]
    n = 2
    mesh = cpu_mesh(n, slot_bytes=slot)
    dt = DTYPES[dtype]

    def make():
        def body(x, r, w):
            normed, new_residual = sifar_jax.psum_add_rmsnorm(x[0], r, w, "tp", eps=EPS,
                                                               algorithm=algorithm)
            return normed[None], new_residual[None]

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()),
                                     out_specs=(P("tp"), P("tp"))))

    # Exact data: lax.psum (the slot case) sums in its own order.
    x, r, w = make_data(rng_for("fallback", case), "exact", n, tokens, hidden, dt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        normed, new_residual = jax.device_get(make()(x, r, w))
        again = jax.device_get(make()(x, r, w))  # a second trace: no second warning
    ours = [str(c.message) for c in caught if "sifar_jax" in str(c.message)]
    assert len(ours) == len(expected), ours
    for msg, part in zip(ours, expected):
        assert part in msg, (msg, part)
    want_norm, want_res = model_reference(x, r, w)
    assert same_bits(new_residual[0], want_res) and same_bits(again[1][0], want_res)
    assert ulps(normed[0], want_norm).max() <= MAX_ULPS[dtype]


# ---------------------------------------------------------------------- types --
@pytest.mark.parametrize("check_vma", [True, False])
def test_result_types_follow_lax_psum(cpu_mesh, check_vma):
    """On a (dp, tp) mesh, x varies over both axes; the results are typed as
    `residual + lax.psum(x, "tp")` and its norm: varying over dp, and over tp
    only where the residual is. The residual-invariant case also runs."""
    mesh = cpu_mesh(shape=(2, 4), axis_names=("dp", "tp"), slot_bytes=SLOT)
    dt = DTYPES["bfloat16"]
    hidden, tokens = 128, 2
    rng = rng_for("types")
    x = rng.standard_normal((8, tokens, hidden)).astype(dt)
    w = (1 + 0.1 * rng.standard_normal(hidden)).astype(dt)
    seen = {}
    for r_spec in (P(), P("dp"), P("tp")):
        copies = {P(): 1, P("dp"): 2, P("tp"): 4}[r_spec]  # one [tokens, hidden] block per device
        r = (2 * rng.standard_normal((tokens * copies, hidden))).astype(dt)

        def body(x, r, w):
            normed, new_residual = sifar_jax.psum_add_rmsnorm(x[0], r, w, "tp", eps=EPS)
            ref_res = r + jax.lax.psum(x[0], "tp")
            seen[r_spec] = [(jax.typeof(a), jax.typeof(b)) for a, b in
                            ((normed, rms_norm(ref_res, w, EPS)), (new_residual, ref_res))]
            return normed[None], new_residual[None]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(("dp", "tp")), r_spec, P()),
                                  out_specs=(P(("dp", "tp")),) * 2, check_vma=check_vma))
        if r_spec == P():
            normed, new_residual = jax.device_get(f(x, r, w))
            for g in range(2):  # each dp group all-reduces its own 4 partials
                want_norm, want_res = model_reference(x[4 * g:4 * g + 4], r, w)
                for q in range(4 * g, 4 * g + 4):
                    assert same_bits(new_residual[q], want_res)
                    assert ulps(normed[q], want_norm).max() <= MAX_ULPS["bfloat16"]
        else:
            f.lower(x, r, w)
    for r_spec, pairs in seen.items():
        for got, want in pairs:
            assert got == want, (r_spec, got, want)
            if check_vma:
                assert "dp" in want.mat.varying
                assert ("tp" in want.mat.varying) == (r_spec == P("tp"))


def test_operand_errors_are_clear_at_trace_time(cpu_mesh):
    mesh = cpu_mesh(2, slot_bytes=SLOT)

    def run(x, r, w):
        f = jax.shard_map(lambda x, r, w: sifar_jax.psum_add_rmsnorm(x, r, w, "tp", eps=EPS)[1],
                          mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=P())
        return jax.jit(f).lower(x, r, w)

    bf = DTYPES["bfloat16"]
    x = np.ones((4, 64), bf)
    with pytest.raises(ValueError, match="residual has shape"):
        run(x, np.ones((2, 32), bf), np.ones(64, bf))
    with pytest.raises(ValueError, match="weight must have shape"):
        run(x, np.ones((2, 64), bf), np.ones(32, bf))
    with pytest.raises(TypeError, match="one dtype"):
        run(x, np.ones((2, 64), np.float32), np.ones(64, bf))
    with pytest.raises(TypeError, match="not supported"):
        run(np.ones((4, 64), np.int32), np.ones((2, 64), np.int32), np.ones(64, np.int32))
    with pytest.raises(ValueError, match="unknown algorithm"):
        jax.jit(jax.shard_map(
            lambda x, r, w: sifar_jax.psum_add_rmsnorm(x, r, w, "tp", eps=EPS, algorithm="nope")[1],
            mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=P())).lower(
                x, np.ones((2, 64), bf), np.ones(64, bf))


# ------------------------------------------------------------------- prefetch --
def test_prefetch_changes_no_result_and_reaches_the_call(cpu_mesh):
    """The next matmul's weight as `prefetch` (its shard varies over tp, as a
    column-parallel weight's does): the results are bit-identical to the call
    without it, for the default size, a size past the operand's (clamped), a
    size not a multiple of 16 (rounded down) and zero (off). The lowered call
    carries the operand and the clamped size (so a dropped prefetch fails
    here), and a run of every kind stays exact."""
    n = 2
    mesh = cpu_mesh(n, slot_bytes=SLOT)
    dt = DTYPES["bfloat16"]
    hidden, tokens = 4096, 2
    w_rows = 5000  # 5000 x 4096 bf16 per rank: 40 MB, past the default 16 MiB
    sizes = [None, 1 << 40, 1000, 0]

    def body(x, r, w, next_weight):
        x, nw = x[0], next_weight
        outs = list(sifar_jax.psum_add_rmsnorm(x, r, w, "tp", eps=EPS))
        for size in sizes:
            outs += sifar_jax.psum_add_rmsnorm(x, r, w, "tp", eps=EPS, prefetch=nw,
                                               prefetch_bytes=size)
        return tuple(v[None] for v in outs)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P(), P("tp")),
                              out_specs=(P("tp"),) * (2 + 2 * len(sizes))))
    rng = rng_for("prefetch")
    x, r, w = make_data(rng, "normal", n, tokens, hidden, dt)
    nw = rng.standard_normal((n * w_rows, hidden)).astype(dt)
    text = f.lower(x, r, w, nw).as_text()
    shard_bytes = w_rows * hidden * 2
    got = sorted(int(v) for v in re.findall(r"prefetch_bytes = (\d+)", text))
    assert got == sorted([0, 0, fused.DEFAULT_PREFETCH_BYTES, shard_bytes, 992]), got
    outs = jax.device_get(f(x, r, w, nw))
    want_norm, want_res = model_reference(x, r, w)
    for q in range(n):
        assert same_bits(outs[1][q], want_res)
        assert ulps(outs[0][q], want_norm).max() <= MAX_ULPS["bfloat16"]
        for k in range(len(sizes)):
            assert same_bits(outs[2 + 2 * k][q], outs[0][q]), f"size {sizes[k]}: normed"
            assert same_bits(outs[3 + 2 * k][q], outs[1][q]), f"size {sizes[k]}: new_residual"
    sifar_jax.check()


def test_prefetch_errors(cpu_mesh, monkeypatch):
    """Clear errors for a bad prefetch at trace time; the handlers' own checks
    (operand missing, size past it) as run-time errors, never a kernel that
    reads past a buffer. A prefetch varying over an axis the call does not
    (dp here) is left out with a warning: it would change the results' type."""
    mesh = cpu_mesh(2, slot_bytes=SLOT)
    bf = DTYPES["bfloat16"]
    x, r, w = np.ones((4, 64), bf), np.ones((2, 64), bf), np.ones(64, bf)

    def make(**kw):
        f = jax.shard_map(lambda x, r, w: sifar_jax.psum_add_rmsnorm(x, r, w, "tp", eps=EPS,
                                                                     **kw)[1],
                          mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=P())
        return jax.jit(f)

    with pytest.raises(ValueError, match="prefetch_bytes must be a non-negative int"):
        make(prefetch=w, prefetch_bytes=-16).lower(x, r, w)
    with pytest.raises(ValueError, match="prefetch_bytes must be a non-negative int"):
        make(prefetch=w, prefetch_bytes=1.5).lower(x, r, w)
    with pytest.raises(TypeError, match="prefetch must be an array"):
        make(prefetch="weights").lower(x, r, w)
    for fake, match in ((lambda p, b, like: ([], 1024), "prefetch operand is missing"),
                        (lambda p, b, like: ([jnp.asarray(p)], 1 << 20), "exceeds the prefetch")):
        monkeypatch.setattr(fused, "prefetch_operand", fake)
        with pytest.raises(Exception, match=match):
            jax.block_until_ready(make(prefetch=w).__call__(x, r, w))
        sifar_jax.check()  # a refused call is no failed all-reduce
    monkeypatch.undo()

    mesh2 = cpu_mesh(shape=(2, 2), axis_names=("dp", "tp"), slot_bytes=SLOT)
    plan.warned.clear()

    def body(x, r, w, nw):
        return sifar_jax.psum_add_rmsnorm(x[0], r, w, "tp", eps=EPS, prefetch=nw)[1][None]

    f = jax.jit(jax.shard_map(body, mesh=mesh2, in_specs=(P("tp"), P(), P(), P("dp")),
                              out_specs=P("tp")))
    with pytest.warns(UserWarning, match=r"prefetch varies over \['dp'\]"):
        text = f.lower(np.ones((2, 2, 64), bf), r, w, np.ones((2, 64), bf)).as_text()
    assert "prefetch_bytes = 0" in text
