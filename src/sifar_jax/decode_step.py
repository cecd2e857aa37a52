"""`llama_step`: the batch-1 decode step of a Llama-family model with FP8 or bf16 weights as
ONE op.

Every layer's RMSNorm, qkv, RoPE, KV-cache write, attention, o, residual add, RMSNorm,
gate_up, SwiGLU, down and residual add, then the final norm, in one call: on CUDA GPUs one
cooperative launch of a persistent kernel (ffi/step/cuda_llama_step.cu: grid barriers between
the phases, the weights streamed into shared memory by a producer warp per block that runs
ahead of them), on the CPU a reference of the same phases (ffi/step/llama_step.cc). Every
projection and the LM head are one weight type, float8_e4m3fn or bfloat16. With an LM head
(`head=`) the op also returns the logits, the head streamed by the same kernel;
without one it returns the final norm's output for a head outside. What is rounded where, and
why the attention is not bit-equal to XLA's: ffi/step/llama_step.h. models/persistent.py builds
a decoder step on it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import _ext

__all__ = ["LlamaLayer", "llama_step", "workspace_bytes", "StepStatus", "HEAD_DIM", "MAX_GROUP",
           "MAX_LAYERS", "MAX_RANKS"]

# The op's limits, as the extension reports them (ffi/step/llama_step.h): written once, in C++.
_limits = _ext.lib.llama_step_limits()
HEAD_DIM = _limits["head_dim"]  # the kernel's head width
MAX_GROUP = _limits["max_group"]  # query heads per KV head
MAX_SPLITS = _limits["max_splits"]  # key ranges per KV head
MAX_LAYERS = _limits["max_layers"]
MAX_RANKS = _limits["max_ranks"]  # virtual ranks
ALLREDUCE_PHASES = ("sifar", "oneshot")  # the all-reduce inside the kernel, with virtual ranks
DEFAULT_TIMEOUT_S = _limits["default_timeout_ns"] / 1e9  # an all-reduce wait's bound (ranks)
MAX_TIMEOUT_S = _limits["max_timeout_ns"] / 1e9  # half the kernel's trap bound (kMaxTimeoutNs)
STATUS_WORDS = _limits["status_words"]  # uint32 words at the workspace's start (StepStatus)
CHUNK = _limits["chunk"]  # every K a multiple of it (16 e4m3 or 8 bf16 weights: 16 bytes)
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
BF16 = jnp.dtype(jnp.bfloat16)
WEIGHT_DTYPES = (E4M3, BF16)  # the step's weight type: every projection's and the head's


class LlamaLayer(NamedTuple):
    """One layer's operands: the norm scales bf16 [H]; each projection's weight (e4m3 or bf16,
    the step's weight type) in the checkpoint's layout [N, K] (qkv [kv * (group + 2) * 128, H]:
    per KV head its query heads, key, value; o [H, heads * 128]; gate_up [2F, H], gate rows
    then up rows; down [H, F]) and its float32 scale, per output channel [N] or per tensor [1]
    (bf16 weights: ones([1]), or any scale the output is to be multiplied by)."""
    input_norm: jax.Array
    qkv: jax.Array
    qkv_scale: jax.Array
    o: jax.Array
    o_scale: jax.Array
    post_norm: jax.Array
    gate_up: jax.Array
    gate_up_scale: jax.Array
    down: jax.Array
    down_scale: jax.Array


def workspace_bytes(hidden: int, kv_heads: int, group: int, ffn: int, layers: int,
                    ranks: int = 1) -> int:
    """The bytes of the op's workspace, computed by the extension from the layout the op uses
    (ffi/step/llama_step.cc, StepWorkspace; the op checks the size it is given against it).
    ValueError outside the op's limits."""
    return int(_ext.lib.llama_step_workspace_bytes(int(hidden), int(kv_heads), int(group),
                                                   int(ffn), int(layers), int(ranks)))


class StepStatus(NamedTuple):
    """What a step with virtual ranks reports (the workspace's status words): `failed` when an
    all-reduce wait passed the timeout (then the step's outputs are not to be used: NaN spreads
    to h and every logit from any phase but the last), with the phase (layer
    l's o is 2l + 1, its down 2l + 2), the rank waited for and the waiting block; `retried`:
    (block, phase) pairs that read a stale word and read it again (sifar's mis-speculations)."""
    failed: bool
    phase: int
    missing_rank: int
    block: int
    retried: int

    @classmethod
    def from_words(cls, words) -> "StepStatus":
        w = np.asarray(words, dtype=np.uint32)
        return cls(bool(w[0]), int(w[1]), int(w[2]), int(w[3]), int(w[4]))


def _check(x, rope, pos, final_norm, layers, cache, kv_heads, group):
    name = "sifar_jax.llama_step"
    if x.ndim != 1 or jnp.dtype(x.dtype) != BF16:
        raise TypeError(f"{name}: x must be bfloat16 [H], got {x.dtype} {x.shape}")
    h = x.shape[0]
    if h % CHUNK:
        raise ValueError(f"{name}: H={h} must be a multiple of {CHUNK}")
    if rope.shape != (2, HEAD_DIM) or jnp.dtype(rope.dtype) != jnp.float32:
        raise ValueError(f"{name}: rope must be float32 [2, {HEAD_DIM}] (cos, sin), got "
                         f"{rope.dtype} {rope.shape}")
    if pos.shape != (2,) or jnp.dtype(pos.dtype) != jnp.int32:
        raise ValueError(f"{name}: pos must be int32 [2] (the slot written, the first slot "
                         f"attended), got {pos.dtype} {pos.shape}")
    if final_norm.shape != (h,) or jnp.dtype(final_norm.dtype) != BF16:
        raise ValueError(f"{name}: final_norm must be bfloat16 [{h}], got {final_norm.dtype} "
                         f"{final_norm.shape}")
    if not 1 <= len(layers) <= MAX_LAYERS:
        raise ValueError(f"{name}: 1..{MAX_LAYERS} layers, got {len(layers)}")
    if not 1 <= group <= MAX_GROUP or kv_heads < 1:
        raise ValueError(f"{name}: kv_heads >= 1 and 1 <= group <= {MAX_GROUP}, got "
                         f"{kv_heads}, {group}")
    ffn = layers[0].gate_up.shape[0] // 2
    q_dim = kv_heads * group * HEAD_DIM
    want = {"qkv": (kv_heads * (group + 2) * HEAD_DIM, h), "o": (h, q_dim),
            "gate_up": (2 * ffn, h), "down": (h, ffn)}
    wdt = jnp.dtype(layers[0].qkv.dtype)
    if wdt not in WEIGHT_DTYPES:
        raise ValueError(f"{name}: the weights must be float8_e4m3fn or bfloat16 (layer 0 qkv "
                         f"is {wdt})")
    for i, layer in enumerate(layers):
        for norm in ("input_norm", "post_norm"):
            v = getattr(layer, norm)
            if v.shape != (h,) or jnp.dtype(v.dtype) != BF16:
                raise ValueError(f"{name}: layer {i} {norm} must be bfloat16 [{h}], got "
                                 f"{v.dtype} {v.shape}")
        for proj, shape in want.items():
            w, s = getattr(layer, proj), getattr(layer, proj + "_scale")
            if jnp.dtype(w.dtype) != wdt or tuple(w.shape) != shape:
                raise ValueError(f"{name}: layer {i} {proj} must be {wdt} {list(shape)} ([N, "
                                 f"K]; every projection of the step's weight type, layer 0 "
                                 f"qkv's), got {w.dtype} {list(w.shape)}")
            if shape[1] % CHUNK:
                raise ValueError(f"{name}: layer {i} {proj}: K={shape[1]} must be a multiple "
                                 f"of {CHUNK}")
            if jnp.dtype(s.dtype) != jnp.float32 or s.ndim != 1 or s.shape[0] not in (1, shape[0]):
                raise ValueError(f"{name}: layer {i} {proj}_scale must be float32 [1] (per "
                                 f"tensor) or [{shape[0]}] (per channel), got {s.dtype} "
                                 f"{list(s.shape)}")
    n = len(layers)
    if (cache.ndim != 6 or jnp.dtype(cache.dtype) != BF16 or cache.shape[:4] != (n, 2, 1, kv_heads)
            or cache.shape[5] != HEAD_DIM):
        raise ValueError(f"{name}: cache must be bfloat16 [{n}, 2, 1, {kv_heads}, S, {HEAD_DIM}] "
                         f"(bhsd, batch 1), got {cache.dtype} {list(cache.shape)}")
    return ffn, wdt


def llama_step(x: jax.Array, rope: jax.Array, pos: jax.Array, final_norm: jax.Array,
               layers: Sequence[LlamaLayer], cache: jax.Array, *, kv_heads: int, group: int,
               eps: float, head: Optional[tuple[jax.Array, jax.Array]] = None) -> tuple:
    """One decode step of a Llama model with FP8 or bf16 projections on one device: returns
    (h, new cache), or with `head` (h, new cache, logits). (sifar_jax.llama_step is this op,
    or with axis_name= the step across the devices of a mesh axis: decode_step_tp.llama_step.)

    x [H] bfloat16: the token's embedding. rope float32 [2, 128]: cos and sin at the token's
    rotary position (models.attention.rope_cos_sin). pos int32 [2]: the cache slot this
    token's key and value go to, and the first slot attended (left padding before it).
    final_norm [H]: the final RMSNorm's scale. layers: one LlamaLayer per layer. cache
    bfloat16 [layers, 2, 1, kv_heads, S, 128] (bhsd), updated in place (donate it). eps: the
    RMSNorms' epsilon. h [H] bfloat16 = final_norm(the residual stream after the last layer).
    head: (weight [V, H] of the layers' weight type, scale float32 [V] or [1]): logits [V]
    float32 = the head's rows times h in fp8_matvec's order, times the scale (not rounded).
    A slot outside [0, S), or a first slot after it, gives NaN in h (and in the logits) on GPUs
    and an error on the CPU."""
    h, cache, logits, _ = _step(x, rope, pos, final_norm, layers, cache, kv_heads=kv_heads,
                                group=group, eps=eps, head=head)
    return (h, cache) if head is None else (h, cache, logits)


def llama_step_virtual_ranks(x: jax.Array, rope: jax.Array, pos: jax.Array,
                             final_norm: jax.Array, layers: Sequence[LlamaLayer],
                             cache: jax.Array, *, kv_heads: int, group: int, eps: float,
                             ranks: int, allreduce: str = "sifar",
                             head: Optional[tuple[jax.Array, jax.Array]] = None,
                             timeout_s: float = DEFAULT_TIMEOUT_S, skew_ns: int = 0,
                             absent_rank: int = -1) -> tuple:
    """`llama_step` as a TP=`ranks` model whose ranks are sets of blocks of the one launch (on
    the CPU: the same sums in loops), the all-reduce inside the kernel: returns (h, new cache,
    logits ([0] without a head), status words uint32 [8] (StepStatus.from_words)).

    Same operands as llama_step (the TP=1 model's; rank r reads KV heads [r kv/R, (r+1)
    kv/R) and FFN rows [r F/R, (r+1) F/R)). o's and down's per-rank outputs are rounded to
    bf16 and added in rank order in float32, rounded once (sifar_psum's rule), as a TP decoder
    with sifar_psum computes them. allreduce: "sifar" (tagged words, speculative reads, dual
    buffers, no barrier) or "oneshot" (barriers across the ranks). A wait longer than
    timeout_s fails the step: status `failed`, which is what says so (raise with
    `check_step_status`); the missing values are NaN, which spreads to h and every logit from
    any phase but the last. Tests: skew_ns (at most 5 s), a random delay of every block before
    it publishes; absent_rank, a rank that never publishes."""
    if not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
        raise ValueError(f"sifar_jax.llama_step: ranks must be an int in [1, {MAX_RANKS}], got "
                         f"{ranks!r}")
    if allreduce not in ALLREDUCE_PHASES:
        raise ValueError(f"sifar_jax.llama_step: allreduce must be one of {ALLREDUCE_PHASES}, "
                         f"got {allreduce!r}")
    if kv_heads % ranks:
        raise ValueError(f"sifar_jax.llama_step: {kv_heads} KV heads do not split over {ranks} "
                         f"ranks")
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"sifar_jax.llama_step: timeout_s must be in (0, {MAX_TIMEOUT_S}] (the "
                         f"kernel's other waits trap at twice that), got {timeout_s!r}")
    if not -1 <= absent_rank < ranks or not 0 <= skew_ns <= MAX_TIMEOUT_S * 1e9:
        raise ValueError(f"sifar_jax.llama_step: absent_rank in [-1, {ranks}) and skew_ns in "
                         f"[0, {int(MAX_TIMEOUT_S * 1e9)}], got {absent_rank}, {skew_ns}")
    return _step(x, rope, pos, final_norm, layers, cache, kv_heads=kv_heads, group=group,
                 eps=eps, head=head, ranks=ranks, oneshot=allreduce == "oneshot",
                 timeout_ns=max(1, int(timeout_s * 1e9)), skew_ns=int(skew_ns),
                 absent_rank=int(absent_rank))


def check_step_status(words) -> StepStatus:
    """The status of a step with virtual ranks; raises SifarError if it failed."""
    from .errors import SifarError

    st = StepStatus.from_words(words)
    if st.failed:
        raise SifarError(f"llama_step: the all-reduce of phase {st.phase} (layer "
                         f"{(st.phase - 1) // 2}'s {'o' if st.phase % 2 else 'down'}) timed out "
                         f"in block {st.block} waiting for rank {st.missing_rank}; the step's "
                         f"outputs are not valid (NaN from any phase but the last)")
    return st


def _step(x, rope, pos, final_norm, layers, cache, *, kv_heads, group, eps, head, ranks=1,
          oneshot=False, timeout_ns=int(DEFAULT_TIMEOUT_S * 1e9), skew_ns=0, absent_rank=-1):
    ffn, wdt = _check(x, rope, pos, final_norm, layers, cache, kv_heads, group)
    if ffn % (16 * ranks):
        raise ValueError(f"sifar_jax.llama_step: F={ffn} must split over {ranks} ranks in "
                         f"multiples of 16")
    vocab = _check_head(head, x.shape[0], wdt) if head is not None else 0
    ws = workspace_bytes(x.shape[0], kv_heads, group, ffn, len(layers), ranks)
    operands = [x, rope, pos, final_norm]
    for layer in layers:
        operands.extend(layer)
    operands.append(cache)
    cache_at = len(operands) - 1
    if head is not None:
        operands.extend(head)
    call = jax.ffi.ffi_call(
        _ext.TARGETS.llama_step,
        (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(cache.shape, cache.dtype),
         jax.ShapeDtypeStruct((ws,), jnp.uint8), jax.ShapeDtypeStruct((vocab,), jnp.float32)),
        input_output_aliases={cache_at: 1})
    h, new_cache, work, logits = call(
        *operands, layers=np.int64(len(layers)), kv_heads=np.int64(kv_heads),
        group=np.int64(group), eps=np.float32(eps), ranks=np.int64(ranks),
        oneshot=np.int64(oneshot), timeout_ns=np.int64(timeout_ns), skew_ns=np.int64(skew_ns),
        absent_rank=np.int64(absent_rank))
    status = jax.lax.bitcast_convert_type(work[:4 * STATUS_WORDS].reshape(STATUS_WORDS, 4),
                                          jnp.uint32)
    return h, new_cache, logits, status


def _check_head(head, hidden: int, wdt) -> int:
    name = "sifar_jax.llama_step"
    if not isinstance(head, (tuple, list)) or len(head) != 2:
        raise TypeError(f"{name}: head must be (weight, scale), got {type(head).__name__}")
    w, s = head
    if jnp.dtype(w.dtype) != wdt or w.ndim != 2 or w.shape[1] != hidden or w.shape[0] < 1:
        raise ValueError(f"{name}: head must be {wdt} [V, {hidden}] (the layers' weight type), "
                         f"got {w.dtype} {list(w.shape)}")
    if jnp.dtype(s.dtype) != jnp.float32 or s.ndim != 1 or s.shape[0] not in (1, w.shape[0]):
        raise ValueError(f"{name}: head's scale must be float32 [1] (per tensor) or "
                         f"[{w.shape[0]}] (per row), got {s.dtype} {list(s.shape)}")
    return int(w.shape[0])

