"""Generation from the command line: tokens printed as they come, then the time per output token.

    python -m models.generate --preset tiny --tp 2 --tokens 32
        [--allreduce psum|sifar|sifar_buffers|identity] [--algorithm auto] [--fused]
        [--slot-bytes N] [--loop stream|sync|pipelined|on_device] [--eos ID]
        [--temperature T --top-p P --seed S] [--checkpoint DIR]

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
    # (the names are checked after jax is imported: every family's presets, models.families)
    p.add_argument("--preset", default="tiny",
                   help="model shapes, random weights (tiny, llama3_8b, ...)")
    p.add_argument("--checkpoint", help="Hugging Face checkpoint dir (config.json + safetensors; "
                                        "its model_type picks the family); overrides --preset")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tokens", type=int, default=32, help="tokens to generate")
    p.add_argument("--prompt-len", type=int, default=8, help="random prompt length")
    p.add_argument("--prompt", type=int, nargs="*", help="explicit prompt token ids")
    p.add_argument("--allreduce", default="psum",
                   choices=["psum", "sifar", "sifar_buffers", "identity"])
    p.add_argument("--algorithm", default="auto", help="sifar algorithm (with --allreduce sifar)")
    p.add_argument("--fused", action="store_true",
                   help="fused all-reduce + residual add + RMSNorm (with --allreduce sifar)")
    p.add_argument("--slot-bytes", type=int, help="sifar's slot size (largest payload served)")
    p.add_argument("--loop", default="stream", choices=["stream", "sync", "pipelined", "on_device"])
    p.add_argument("--eos", type=int, help="stop token id")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--dtype", help="override parameter/activation dtype (e.g. bfloat16)")
    p.add_argument("--max-seq-len", type=int, help="KV cache length (default: the request, "
                                                   "rounded up to a power of two)")
    p.add_argument("--warmup", type=int, default=3, help="tokens excluded from the timing")
    p.add_argument("--seed", type=int, default=0, help="random weights, prompt and sampling")
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

    from .decode import Decoder, make_mesh
    from .families import family_for_checkpoint, preset, presets

    if len(jax.devices()) < args.tp:
        print(f"error: --tp {args.tp} but only {len(jax.devices())} {jax.default_backend()} "
              f"devices", file=sys.stderr)
        return 2
    mesh = make_mesh(args.tp)
    rng = np.random.default_rng(args.seed)
    prompt_len = len(args.prompt) if args.prompt else args.prompt_len
    if args.checkpoint:
        family = family_for_checkpoint(args.checkpoint)
        config, params = family.load_hf_checkpoint(args.checkpoint, mesh, dtype=args.dtype)
    else:
        if args.preset not in presets():
            print(f"error: unknown --preset {args.preset!r}; choose from {sorted(presets())}",
                  file=sys.stderr)
            return 2
        family = presets()[args.preset]
        config = preset(args.preset)
        if args.dtype:
            config = config.replace(dtype=args.dtype)
        params = family.random_params(config, mesh, seed=args.seed)
    # The decoder sizes the KV cache to each request (rounded up to a power of two); let the
    # limit admit this one (+ the on-device loop's last chunk).
    need = max(prompt_len + args.tokens + 16, args.max_seq_len or 0)
    config = config.replace(max_seq_len=max(config.max_seq_len, need))
    prompt = (np.array(args.prompt, np.int32) if args.prompt
              else rng.integers(0, config.vocab_size, prompt_len, dtype=np.int32))

    try:
        dec = Decoder(config, mesh, params, family=family, allreduce=args.allreduce, algorithm=args.algorithm,
                      fused=args.fused,
                      slot_bytes=args.slot_bytes, max_seq_len=args.max_seq_len)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kw = dict(eos_id=args.eos, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
              loop=args.loop)
    t0 = time.perf_counter()
    dec.generate(prompt, min(args.tokens, 20), **kw)  # compiles the prefill and the steps
    compile_s = time.perf_counter() - t0

    print(f"device: {jax.devices()[0].device_kind} x{args.tp} ({jax.default_backend()}), "
          f"{family.name}: layers={config.num_layers} hidden={config.hidden_size} dtype={config.dtype}, "
          f"allreduce={args.allreduce}" + (f"/{args.algorithm}" if "sifar" in args.allreduce else "")
          + (" fused" if args.fused else "") + f", loop={args.loop}")
    print("prompt:", " ".join(map(str, prompt)))
    print("stream:", end=" ", flush=True)
    tokens, stamps = [], []
    t0 = time.perf_counter()
    for tok in dec.stream(prompt, args.tokens, **kw):
        stamps.append(time.perf_counter())
        tokens.append(int(tok[0]))
        print(tokens[-1], end=" ", flush=True)
    print()
    print("tokens:", " ".join(map(str, tokens)))
    gaps = [b - a for a, b in zip(stamps, stamps[1:])][args.warmup:]
    print(f"compile + first run: {compile_s:.1f} s; prefill + first token: "
          f"{(stamps[0] - t0) * 1e3:.3f} ms")
    if gaps:  # the mean: on_device delivers its tokens a chunk at a time
        print(f"time per output token: mean {(stamps[-1] - stamps[args.warmup]) / len(gaps) * 1e3:.3f}"
              f" ms over {len(gaps)} tokens (gaps between tokens: median "
              f"{statistics.median(gaps) * 1e3:.3f}, max {max(gaps) * 1e3:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
