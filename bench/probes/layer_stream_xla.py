"""Probe: XLA's side of bench/probes/layer_stream.cu. The same 32 layers of Llama-8B's TP=1
shapes without attention (RMSNorm -> qkv -> o on q -> residual add -> RMSNorm -> gate_up ->
SwiGLU -> down -> residual add, bf16, batch 1), jitted as one chain with each weight its own
array, as the decoder passes them; and the four dots alone, as gemv_cluster_xla.py's chain.
Device-bound: the chain is called back to back and waited for once.

    python -m bench.probes.layer_stream_xla            # one GPU (14 GB of weights)
    python -m bench.probes.layer_stream_xla --quick    # CPU: shapes / 64, 2 layers
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench.probes.gemv_cluster_xla import chain_args, timeit

HIDDEN, QKV, FFN = 4096, 6144, 14336
EPS = 1e-5


def rms_norm(x, scale):
    """As the kernel rounds it: x * rsqrt(mean(x^2) + eps) to bf16, times the scale, to bf16."""
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)
    return ((xf * inv).astype(jnp.bfloat16).astype(jnp.float32)
            * scale.astype(jnp.float32)).astype(jnp.bfloat16)


def layer(x, w, hidden: int, ffn: int):
    """One layer without attention; q (the first `hidden` of qkv) stands in for its output."""
    qkv = rms_norm(x, w["attn_norm"]) @ w["qkv"]
    x = x + qkv[:, :hidden] @ w["o"]
    gu = rms_norm(x, w["mlp_norm"]) @ w["gate_up"]
    g = gu[:, :ffn].astype(jnp.float32)
    a = (g * jax.nn.sigmoid(g) * gu[:, ffn:].astype(jnp.float32)).astype(jnp.bfloat16)
    return x + a @ w["down"]


def make_weights(layers: int, hidden: int, qkv: int, ffn: int):
    def u(key, shape, scale, offset=0.0):
        return (jax.random.uniform(key, shape, jnp.float32, -1, 1) * scale + offset
                ).astype(jnp.bfloat16)
    out = []
    for i in range(layers):
        k = jax.random.split(jax.random.key(i), 6)
        out.append({"qkv": u(k[0], (hidden, qkv), 0.03), "o": u(k[1], (hidden, hidden), 0.03),
                    "gate_up": u(k[2], (hidden, 2 * ffn), 0.03),
                    "down": u(k[3], (ffn, hidden), 0.03),
                    "attn_norm": u(k[4], (hidden,), 0.2, 1.0),
                    "mlp_norm": u(k[5], (hidden,), 0.2, 1.0)})
    return out


def main(argv=None) -> int:
    layers, calls, div = chain_args("bench.probes.layer_stream_xla", __doc__, argv)
    hidden, qkv, ffn = HIDDEN // div, QKV // div, FFN // div
    ws = make_weights(layers, hidden, qkv, ffn)
    x = jax.random.uniform(jax.random.key(99), (1, hidden), jnp.float32, -1, 1).astype(jnp.bfloat16)
    total = sum(v.size * 2 for w in ws for k, v in w.items() if "norm" not in k)

    def full(ws, x):
        for w in ws:
            x = layer(x, w, hidden, ffn)
        return x

    def dots(ws, x):
        for w in ws:
            y = x @ w["qkv"]
            y = y[:, :hidden] @ w["o"]
            y = y @ w["gate_up"]
            x = y[:, :ffn] @ w["down"]
        return x

    for name, f in (("layers (norms, residuals, SwiGLU)", full), ("the four dots alone", dots)):
        t = timeit(jax.jit(f), (ws, x), calls)
        print(f"XLA {name}: {layers} layers {t * 1e3:.3f} ms, {t / layers * 1e6:.2f} us per layer, "
              f"{total / t / 1e12:.2f} TB/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
