"""Probe: XLA's side of bench/probes/layer_stream.cu. The same 32 layers of Llama-8B's TP=1
shapes without attention (RMSNorm -> qkv -> o on q -> residual add -> RMSNorm -> gate_up ->
SwiGLU -> down -> residual add, bf16, batch 1), jitted as one chain with each weight its own
array, as the decoder passes them; the four dots alone, as gemv_cluster_xla.py's chain; the
layers with the decoder's own attention (models.attention.Attention: RoPE, the cache written in
place, the Pallas decode kernel over KV 1024 in the "bhsd" layout; layer_stream.cu's ATTN); and
the step's head (the final norm, the logits over Llama-3's 128256 tokens, the argmax), which a
whole-step kernel would leave to XLA. Device-bound: the chain is called back to back and waited
for once (the cache donated from call to call). --tp 2: one rank's shapes at TP=2 (half the
heads, qkv, o's K, the MLP and the vocabulary), without the all-reduce (layer_stream.cu built
with -DLS_TP=2).

    python -m bench.probes.layer_stream_xla            # one GPU (14 GB of weights)
    python -m bench.probes.layer_stream_xla --tp 2     # TP=2's per-rank shapes
    python -m bench.probes.layer_stream_xla --quick    # CPU: shapes / 64, 2 layers
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
from flax import nnx

from bench.probes.gemv_cluster_xla import chain_args, timeit
from models.attention import Attention, Step
from models.options import DecodeOptions

HIDDEN, QKV, FFN = 4096, 6144, 14336
HEADS, KV_HEADS, HEAD_DIM, KV_LEN, VOCAB = 32, 8, 128, 1024, 128256
EPS = 1e-5


def rms_norm(x, scale):
    """As the kernel rounds it: x * rsqrt(mean(x^2) + eps) to bf16, times the scale, to bf16."""
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)
    return ((xf * inv).astype(jnp.bfloat16).astype(jnp.float32)
            * scale.astype(jnp.float32)).astype(jnp.bfloat16)


def mlp(x, w, ffn: int):
    """The layer's second half: RMSNorm -> gate_up -> SwiGLU -> down -> residual add."""
    gu = rms_norm(x, w["mlp_norm"]) @ w["gate_up"]
    g = gu[:, :ffn].astype(jnp.float32)
    a = (g * jax.nn.sigmoid(g) * gu[:, ffn:].astype(jnp.float32)).astype(jnp.bfloat16)
    return x + a @ w["down"]


def layer(x, w, hidden: int, ffn: int):
    """One layer without attention; q (the first o-input columns of qkv) stands in for its
    output."""
    qkv = rms_norm(x, w["attn_norm"]) @ w["qkv"]
    return mlp(x + qkv[:, :w["o"].shape[0]] @ w["o"], w, ffn)


def attention_config(hidden: int, div: int, tp: int = 1):
    """What models.attention reads: one rank's Llama-8B heads at tp (div 1), or a small set
    (CPU)."""
    heads, kv, d = (HEADS // tp, KV_HEADS // tp, HEAD_DIM) if div == 1 else (4 // tp, 2 // tp, 16)
    return SimpleNamespace(hidden_size=hidden, num_heads=heads, num_kv_heads=kv, head_dim=d,
                           group_size=heads // kv, dtype="bfloat16", rope_theta=500000.0,
                           rope_scaling=None)


def with_attention(x, ws, attns, cache, pos, ffn: int, cfg, kv_len: int):
    """The layers with the decoder's attention (its qkv and o weights): the new token in slot
    pos of the donated "bhsd" cache [layers, 2, 1, kv heads, kv_len, head_dim]."""
    step = Step.at(cfg, pos[None], attend_len=kv_len,
                   options=DecodeOptions(kv_layout="bhsd", gemm_rows=1, attn_impl="pallas"))
    for i, (w, a) in enumerate(zip(ws, attns)):
        h, cache = a(rms_norm(x, w["attn_norm"])[:, None], cache, i, step)
        x = mlp(x + h[:, 0], w, ffn)
    return x, cache


def head(x, norm, lm_head):
    """The step after the layers: the final norm, the logits, the greedy token."""
    return jnp.argmax(rms_norm(x, norm) @ lm_head, axis=-1)


def make_weights(layers: int, hidden: int, qkv: int, ffn: int, q: int | None = None):
    """Random weights per layer; q: o's input width (the attention's output; hidden at TP=1)."""
    q = hidden if q is None else q

    def u(key, shape, scale, offset=0.0):
        return (jax.random.uniform(key, shape, jnp.float32, -1, 1) * scale + offset
                ).astype(jnp.bfloat16)
    out = []
    for i in range(layers):
        k = jax.random.split(jax.random.key(i), 6)
        out.append({"qkv": u(k[0], (hidden, qkv), 0.03), "o": u(k[1], (q, hidden), 0.03),
                    "gate_up": u(k[2], (hidden, 2 * ffn), 0.03),
                    "down": u(k[3], (ffn, hidden), 0.03),
                    "attn_norm": u(k[4], (hidden,), 0.2, 1.0),
                    "mlp_norm": u(k[5], (hidden,), 0.2, 1.0)})
    return out


def main(argv=None) -> int:
    layers, calls, div, tp = chain_args("bench.probes.layer_stream_xla", __doc__, argv, True)
    hidden, qkv, ffn, q = HIDDEN // div, QKV // div // tp, FFN // div // tp, HIDDEN // div // tp
    ws = make_weights(layers, hidden, qkv, ffn, q)
    print(f"TP={tp}'s per-rank shapes: hidden {hidden}, qkv {qkv}, o {q} x {hidden}, gate_up "
          f"{2 * ffn}, down {ffn}", flush=True)
    x = jax.random.uniform(jax.random.key(99), (1, hidden), jnp.float32, -1, 1).astype(jnp.bfloat16)
    total = sum(v.size * 2 for w in ws for k, v in w.items() if "norm" not in k)

    def full(ws, x):
        for w in ws:
            x = layer(x, w, hidden, ffn)
        return x

    def dots(ws, x):
        for w in ws:
            y = x @ w["qkv"]
            y = y[:, :q] @ w["o"]
            y = y @ w["gate_up"]
            x = y[:, :ffn] @ w["down"]
        return x

    def report(name, t):
        print(f"XLA {name}: {layers} layers {t * 1e3:.3f} ms, {t / layers * 1e6:.2f} us per layer, "
              f"{total / t / 1e12:.2f} TB/s", flush=True)

    for name, f in (("layers (norms, residuals, SwiGLU)", full), ("the four dots alone", dots)):
        report(name, timeit(jax.jit(f), (ws, x), calls))

    # The layers with the decoder's attention; their own qkv and o weights (same shapes).
    cfg = attention_config(hidden, div, tp)
    kv_len = KV_LEN if div == 1 else 64
    graphdef, state = nnx.split(nnx.List([Attention(cfg, rngs=nnx.Rngs(i)) for i in range(layers)]))
    cache = jax.random.uniform(jax.random.key(7), (layers, 2, 1, cfg.num_kv_heads, kv_len,
                                                   cfg.head_dim), jnp.float32, -1, 1
                               ).astype(jnp.bfloat16)
    pos = jnp.int32(kv_len - 1)

    def attend(state, ws, cache, x, pos):  # pos traced, as the decoder's step takes it
        return with_attention(x, ws, nnx.merge(graphdef, state), cache, pos, ffn, cfg, kv_len)

    step = jax.jit(attend, donate_argnums=(2,))
    donated = [cache]

    def call():  # each call takes the cache the one before returned
        y, donated[0] = step(state, ws, donated[0], x, pos)
        return y

    report("layers with the decoder's attention (Pallas, KV %d)" % kv_len, timeit(call, (), calls))

    vocab = (VOCAB if div == 1 else 512) // tp
    lm_head = (jax.random.normal(jax.random.key(5), (hidden, vocab), jnp.float32) * 0.02
               ).astype(jnp.bfloat16)
    t = timeit(jax.jit(head), (x, ws[-1]["mlp_norm"], lm_head), calls)
    print(f"XLA head (final norm, logits [{hidden}, {vocab}], argmax): {t * 1e3:.3f} ms, "
          f"{lm_head.size * 2 / t / 1e12:.2f} TB/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
