"""Greedy generation from the command line, with time per output token.

    python -m models.generate --preset tiny --tp 2 --tokens 32 [--allreduce psum|sifar|identity]
        [--algorithm auto] [--checkpoint DIR]

Without --checkpoint the weights are random (the timing is what matters). On a CPU-only
machine, XLA_FLAGS is given enough host devices for --tp before jax is imported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m models.generate", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", choices=["tiny", "llama3_8b"])
    p.add_argument("--checkpoint", help="Hugging Face checkpoint dir (config.json + safetensors); "
                                        "overrides --preset")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tokens", type=int, default=32, help="tokens to generate")
    p.add_argument("--prompt-len", type=int, default=8, help="random prompt length")
    p.add_argument("--prompt", type=int, nargs="*", help="explicit prompt token ids")
    p.add_argument("--allreduce", default="psum", choices=["psum", "sifar", "identity"])
    p.add_argument("--algorithm", default="auto", help="sifar algorithm (with --allreduce sifar)")
    p.add_argument("--dtype", help="override parameter/activation dtype (e.g. bfloat16)")
    p.add_argument("--max-seq-len", type=int, help="KV cache length (default: prompt + tokens)")
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from the timing")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _ensure_host_devices(n: int) -> None:
    # Must run before jax is imported. The flag only adds CPU devices, so it is harmless where a
    # GPU is the default backend; an explicit count in XLA_FLAGS is respected.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def main(argv=None) -> int:
    args = _parse(argv)
    _ensure_host_devices(max(args.tp, 1))

    import jax
    import numpy as np

    from .config import LlamaConfig
    from .decode import Decoder, make_mesh
    from .weights import load_hf_checkpoint, random_params

    if len(jax.devices()) < args.tp:
        print(f"error: --tp {args.tp} but only {len(jax.devices())} {jax.default_backend()} "
              f"devices", file=sys.stderr)
        return 2
    mesh = make_mesh(args.tp)
    rng = np.random.default_rng(args.seed)
    prompt_len = len(args.prompt) if args.prompt else args.prompt_len
    max_seq = args.max_seq_len or prompt_len + args.tokens

    if args.checkpoint:
        config, params = load_hf_checkpoint(args.checkpoint, mesh, dtype=args.dtype,
                                            max_seq_len=max_seq)
    else:
        config = getattr(LlamaConfig, args.preset)(max_seq_len=max_seq)
        if args.dtype:
            config = config.replace(dtype=args.dtype)
        params = random_params(config, mesh, seed=args.seed)
    prompt = (np.array(args.prompt, np.int32) if args.prompt
              else rng.integers(0, config.vocab_size, prompt_len, dtype=np.int32))[None, :]

    dec = Decoder(config, mesh, params, allreduce=args.allreduce, algorithm=args.algorithm,
                  max_seq_len=max_seq)
    # one untimed pass compiles the prefill and the step
    t0 = time.perf_counter()
    dec.generate(prompt, 2)
    compile_s = time.perf_counter() - t0

    dec.reset()
    t0 = time.perf_counter()
    tok = dec.greedy(prompt).block_until_ready()
    prefill_s = time.perf_counter() - t0
    out, times = [tok], []
    for _ in range(args.tokens - 1):
        t0 = time.perf_counter()
        tok = dec.greedy(tok).block_until_ready()
        times.append(time.perf_counter() - t0)
        out.append(tok)
    tokens = np.concatenate(jax.device_get(out), axis=1)[0]

    timed = times[args.warmup:] or times
    print(f"device: {jax.devices()[0].device_kind} x{args.tp} ({jax.default_backend()}), "
          f"layers={config.num_layers} hidden={config.hidden_size} dtype={config.dtype}, "
          f"allreduce={args.allreduce}" + (f"/{args.algorithm}" if args.allreduce == "sifar" else ""))
    print("prompt:", " ".join(map(str, prompt[0])))
    print("tokens:", " ".join(map(str, tokens)))
    print(f"compile + first run: {compile_s:.1f} s; prefill ({prompt_len} tokens): "
          f"{prefill_s * 1e3:.3f} ms")
    if timed:
        print(f"time per output token: median {statistics.median(timed) * 1e3:.3f} ms "
              f"over {len(timed)} steps (min {min(timed) * 1e3:.3f}, max {max(timed) * 1e3:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
