"""Generation from the command line: tokens printed as they come, then the time to the first token
and the time per output token.

    python -m models.generate --preset tiny --tp 2 --tokens 32
        [--allreduce sifar|psum|sifar_buffers|identity] [--algorithm auto] [--fused]
        [--slot-bytes N] [--loop stream|sync|pipelined|on_device] [--eos ID ...]
        [--temperature T --top-p P --seed S] [--prompt-ids ID ...]
    python -m models.generate --checkpoint DIR --prompt "text" [--chat] --tokens 200

Without --checkpoint the weights are random (the timing is what matters). With a Hugging Face
checkpoint that has a tokenizer.json, --prompt is text (--chat: as a user message in the
checkpoint's chat template), the answer is printed as text while it is generated, and it stops
at the checkpoint's stop ids (generation_config.json; --ignore-eos: never). On a CPU-only
machine, XLA_FLAGS is given enough host devices for --tp before jax starts its backend. Every
mistake in the arguments is one line `error: ...` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ALLREDUCE_CHOICES = ("sifar", "psum", "sifar_buffers", "identity")  # = models.core.tp.ALLREDUCE_KINDS
LOOP_CHOICES = ("stream", "sync", "pipelined", "on_device")  # = models.LOOPS
IDENTITY_NOTE = "(no communication: meaningless tokens, a timing bound)"
TEXT_RULE = "-" * 40  # frames the generated text


class UserError(Exception):
    """A mistake in the arguments or the environment: printed as one `error:` line, exit 2."""


def _sifar_status() -> tuple[tuple, str | None]:
    """(sifar_jax's algorithm names, None), or ((), why sifar_jax cannot be used here).
    Importing jax does not start its backend, so XLA_FLAGS can still be set after this."""
    try:
        import sifar_jax
    except Exception as e:  # noqa: BLE001 - extension not built, or a broken install
        return (), f"import sifar_jax failed: {e}"
    return tuple(sifar_jax.ALGORITHMS), None


def _parser(algorithms: tuple, sifar_why: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m models.generate",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # (the names are checked after jax is imported: every family's presets, models.registry)
    p.add_argument("--preset", default="tiny",
                   help="model shapes, random weights: tiny, qwen3_moe_tiny, llama3_8b, qwen3_30b_a3b")
    p.add_argument("--checkpoint", help="Hugging Face checkpoint dir (config.json + safetensors; "
                                        "its model_type picks the family); overrides --preset")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices")
    p.add_argument("--tokens", type=int, default=32, help="tokens to generate")
    p.add_argument("--prompt-len", type=int, default=8,
                   help="random prompt length (without --prompt or --prompt-ids)")
    p.add_argument("--prompt", help="prompt text (needs --checkpoint with a tokenizer.json)")
    p.add_argument("--chat", action="store_true",
                   help="--prompt as a user message in the checkpoint's chat template")
    p.add_argument("--prompt-ids", type=int, nargs="+", metavar="ID", help="prompt token ids")
    default_ar = "psum" if sifar_why else "sifar"
    p.add_argument("--allreduce", default=default_ar, choices=ALLREDUCE_CHOICES,
                   help="sifar: sifar_jax's all-reduce; psum: lax.psum (XLA's); sifar_buffers: "
                        "sifar with explicit dual buffers; identity " + IDENTITY_NOTE
                        + (f". The default is psum here: {sifar_why}" if sifar_why else ""))
    p.add_argument("--algorithm", default="auto", choices=("auto", *algorithms),
                   help="sifar's algorithm (with --allreduce sifar*)")
    p.add_argument("--fused", action="store_true",
                   help="fused all-reduce + residual add + RMSNorm (with --allreduce sifar)")
    p.add_argument("--slot-bytes", type=int, help="sifar's slot size (largest payload served)")
    p.add_argument("--loop", default="stream", choices=LOOP_CHOICES,
                   help="stream: steps run ahead of the host, tokens yielded as ready; sync: one "
                        "step then its token; pipelined: tokens read at the end; on_device: 16 "
                        "steps per dispatch in a device loop (all give the same tokens)")
    p.add_argument("--eos", type=int, nargs="+", metavar="ID",
                   help="stop token id(s) (default: the checkpoint's, none for random weights)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the checkpoint's stop ids (generate --tokens)")
    p.add_argument("--show-ids", action="store_true",
                   help="print token ids, not text, even with a tokenizer")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1]")
    p.add_argument("--dtype", help="override parameter/activation dtype (a float dtype, e.g. "
                                   "bfloat16)")
    p.add_argument("--quantize", choices=("fp8",),
                   help="fp8: the projections (attention, MLP or experts, LM head) quantized to "
                        "e4m3 per output channel after the weights are made or loaded "
                        "(models/weights/transforms.py); norms, embedding and router stay in "
                        "--dtype")
    p.add_argument("--step", default="xla", choices=("xla", "persistent"),
                   help="persistent: each one-token step as one sifar_jax.llama_step call (a "
                        "persistent kernel; Llama, TP=1, on a GPU, FP8 weights or bf16 ones "
                        "held as rows, which both steps read; elsewhere the XLA step runs and "
                        "says why)")
    p.add_argument("--max-seq-len", type=int, help="KV cache length (default: the request, "
                                                   "rounded up to a power of two)")
    p.add_argument("--seed", type=int, default=0, help="random weights, prompt and sampling")
    p.add_argument("--compile-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="JAX's persistent compilation cache in $SIFAR_JAX_COMPILE_CACHE, else "
                        "$XDG_CACHE_HOME/sifar-jax/jax-cache or ~/.cache/sifar-jax/jax-cache "
                        "(models/decoder/compile_cache.py), so a second start reads what the first "
                        "compiled; also off with SIFAR_JAX_NO_COMPILE_CACHE=1")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="compile every executable the request can need before it starts "
                        "(Decoder.warmup); --no-warmup: compile as the request goes, stalls "
                        "included")
    return p


def _ensure_host_devices(n: int) -> None:
    # Must run before jax creates its backend. The flag only adds CPU devices, so it is harmless
    # where a GPU is the default backend; an explicit count in XLA_FLAGS is respected.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _check_args(args) -> None:
    """What can be checked before jax starts."""
    if args.tp <= 0:
        raise UserError(f"--tp must be >= 1, got {args.tp}")
    if args.tokens <= 0:
        raise UserError(f"--tokens must be >= 1, got {args.tokens}")
    if args.prompt is None and args.prompt_ids is None and args.prompt_len <= 0:
        raise UserError(f"--prompt-len must be >= 1, got {args.prompt_len}")
    if args.prompt is not None and args.prompt_ids is not None:
        raise UserError("give --prompt (text) or --prompt-ids, not both")
    if args.prompt is not None and not args.checkpoint:
        raise UserError("--prompt is text: it needs --checkpoint DIR with a tokenizer.json "
                        "(token ids: --prompt-ids)")
    if args.chat and args.prompt is None:
        raise UserError("--chat applies the chat template to --prompt TEXT")
    if args.eos is not None and args.ignore_eos:
        raise UserError("--eos and --ignore-eos contradict each other")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.slot_bytes is not None and args.slot_bytes <= 0:
        raise UserError(f"--slot-bytes must be positive, got {args.slot_bytes}")
    if args.max_seq_len is not None and args.max_seq_len <= 0:
        raise UserError(f"--max-seq-len must be positive, got {args.max_seq_len}")
    if args.checkpoint is not None:
        if not os.path.isdir(args.checkpoint):
            raise UserError(f"--checkpoint {args.checkpoint}: no such directory")
        if not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
            raise UserError(f"--checkpoint {args.checkpoint}: no config.json in it")
    if args.fused and args.allreduce != "sifar":
        raise UserError(f"--fused needs --allreduce sifar, got --allreduce {args.allreduce}")
    if args.algorithm != "auto" and "sifar" not in args.allreduce:
        raise UserError(f"--algorithm {args.algorithm} is sifar's; --allreduce is "
                        f"{args.allreduce}")


def _float_dtype(name: str) -> str:
    import jax.numpy as jnp

    try:
        dt = jnp.dtype(name)
    except TypeError:
        raise UserError(f"--dtype {name!r} is not a dtype") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise UserError(f"--dtype must be a float dtype (bfloat16, float16, float32), got {name}")
    return dt.name


def _model(args):
    """(family, config) from --checkpoint or --preset, checked against --tp; nothing allocated."""
    from .weights.checkpoint import read_hf_config
    from .registry import family_for_checkpoint, presets

    dtype = _float_dtype(args.dtype) if args.dtype else None
    if args.checkpoint:
        try:
            family = family_for_checkpoint(args.checkpoint)
            config = family.config_from_hf(read_hf_config(args.checkpoint), dtype=dtype)
        except (ValueError, NotImplementedError, KeyError, OSError) as e:
            raise UserError(f"--checkpoint {args.checkpoint}: {e}") from None
    else:
        if args.preset not in presets():
            raise UserError(f"unknown --preset {args.preset!r}; choose from {sorted(presets())}")
        family = presets()[args.preset]
        config = family.preset(args.preset)
        if dtype:
            config = config.replace(dtype=dtype)
    try:
        family.layout(config, args.tp)  # the model's own tp check
    except ValueError as e:
        raise UserError(f"--tp {args.tp}: {e}") from None
    return family, config


def _tokenizer(args):
    """The checkpoint's TextTokenizer, or None (no checkpoint, or no tokenizer.json in it)."""
    from . import tokenizer

    if not args.checkpoint or not tokenizer.has_tokenizer(args.checkpoint):
        if args.prompt is not None:
            raise UserError(f"--prompt is text, but {args.checkpoint} has no "
                            f"{tokenizer.TOKENIZER_FILE} (token ids: --prompt-ids)")
        return None
    try:
        return tokenizer.TextTokenizer(args.checkpoint)
    except (ImportError, OSError, ValueError) as e:
        raise UserError(f"--checkpoint {args.checkpoint}: tokenizer: {e}") from None


def _prompt(args, config, rng, tok):
    import numpy as np

    if args.prompt is not None:
        try:
            ids = tok.encode(args.prompt, chat=args.chat)
        except (ImportError, ValueError) as e:
            raise UserError(str(e)) from None
        if not ids:
            raise UserError("--prompt encodes to no tokens")
        what = "--prompt"
    elif args.prompt_ids is not None:
        ids, what = args.prompt_ids, "--prompt-ids"
    else:
        return rng.integers(0, config.vocab_size, args.prompt_len, dtype=np.int32)
    bad = [t for t in ids if not 0 <= t < config.vocab_size]
    if bad:
        raise UserError(f"{what}: token id {bad[0]} is outside the vocabulary "
                        f"[0, {config.vocab_size})")
    return np.array(ids, np.int32)


def _stop_ids(args, config):
    """--eos, else the checkpoint's stop ids (unless --ignore-eos), else none."""
    from .tokenizer import checkpoint_eos_ids

    ids = args.eos if args.eos is not None else (
        checkpoint_eos_ids(args.checkpoint) if args.checkpoint and not args.ignore_eos else [])
    for e in ids:
        if not 0 <= e < config.vocab_size:
            raise UserError(f"stop id {e} (--eos or the checkpoint's) is outside the vocabulary "
                            f"[0, {config.vocab_size})")
    return ids or None


def main(argv=None) -> int:
    started = time.perf_counter()
    algorithms, sifar_why = _sifar_status()
    args = _parser(algorithms, sifar_why).parse_args(argv)
    try:
        return _run(args, sifar_why, started)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args, sifar_why, started: float) -> int:
    _check_args(args)
    if "sifar" in args.allreduce and sifar_why:
        raise UserError(f"--allreduce {args.allreduce}: {sifar_why}")
    _ensure_host_devices(args.tp)

    import jax

    if len(jax.devices()) < args.tp:
        raise UserError(f"--tp {args.tp} but only {len(jax.devices())} {jax.default_backend()} "
                        f"devices")
    family, config = _model(args)
    tok = _tokenizer(args)
    stops = _stop_ids(args, config)
    prompt = _prompt(args, config, _rng(args.seed), tok)
    config = _checked_fit(args, family, config, prompt)
    dec, weights_s, cache_dir = _decoder(args, family, config)
    from .decoder.capacity import cache_reserve

    # A request's start (Decoder.start): its stop ids, sampling, seed and cache positions.
    request = dict(eos_id=stops, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                   reserve=cache_reserve(args.tokens, args.loop))
    warmup, cache_use = _warmup(args, dec, prompt)
    _print_setup(args, sifar_why, family, dec, cache_dir, warmup, cache_use, stops, prompt)
    ttft = _time_to_first_token(dec, prompt, request)
    print(f"process start to first token: {time.perf_counter() - started - weights_s:.1f} s "
          f"(+ {weights_s:.1f} s making or loading the weights)")
    first_token_at, stamps = _decode_request(args, dec, prompt, request, stops, tok)
    _report_times(ttft, first_token_at, stamps, prompt.size, args.loop,
                  dec.prefill_allreduce(prompt.size))
    return 0


def _rng(seed: int):
    import numpy as np

    return np.random.default_rng(seed)


def _checked_fit(args, family, config, prompt):
    """The config with a max_seq_len that admits this request, after checking that the model,
    its KV cache and the transient fit the devices (footprint.py: on a CPU, every host device
    shares the host's memory): else one error line, before any weight is allocated."""
    import jax

    from .decoder import footprint
    from .decoder.capacity import ON_DEVICE_CHUNK, bucket_up, prompt_bucket

    # The decoder sizes the KV cache to each request (the prompt padded to its bucket, rounded
    # up to a power of two); let the limit admit this one (+ the on-device loop's last chunk).
    need = max(prompt_bucket(prompt.size) + args.tokens + ON_DEVICE_CHUNK, args.max_seq_len or 0)
    config = config.replace(max_seq_len=max(config.max_seq_len, need))
    capacity = args.max_seq_len or bucket_up(need)
    if args.max_seq_len is not None and args.max_seq_len < prompt.size + args.tokens:
        raise UserError(f"--max-seq-len {args.max_seq_len} cannot hold the prompt "
                        f"({prompt.size}) + --tokens {args.tokens}")
    try:
        footprint.check_fits(footprint.estimate(family, config, args.tp, 1, capacity,
                                                prompt.size, args.quantize),
                             jax.devices()[:args.tp])
    except MemoryError as e:
        raise UserError(str(e)) from None
    return config


def _decoder(args, family, config):
    """(the Decoder, seconds making or loading the weights, the compilation cache's dir)."""
    import jax

    from .decoder import compile_cache, step_choice
    from .decoder.decoder import Decoder, make_mesh
    from .decoder.options import DecodeOptions

    try:
        cache_dir = compile_cache.enable(off=not args.compile_cache)
    except OSError as e:
        raise UserError(f"compilation cache: {e} (--no-compile-cache turns it off)") from None
    mesh = make_mesh(args.tp)
    t_weights = time.perf_counter()
    if args.checkpoint:
        try:  # a bf16 checkpoint is quantized shard by shard as it loads
            config, params = family.load_hf_checkpoint(args.checkpoint, mesh, config=config,
                                                       quantize=args.quantize)
        except (ValueError, OSError) as e:  # a bad checkpoint (Fp8CheckpointError among them)
            raise UserError(f"--checkpoint {args.checkpoint}: {e}") from None
        if args.quantize:  # an FP8 checkpoint's dense leftovers (a bf16 LM head)
            from .weights.transforms import quantize_params

            params = quantize_params(params, family, donate=True)
    else:
        params = family.random_params(config, mesh, seed=args.seed, quantize=args.quantize)
    jax.block_until_ready(params)
    weights_s = time.perf_counter() - t_weights
    try:
        options = DecodeOptions(allreduce=args.allreduce, algorithm=args.algorithm,
                                fused=args.fused, slot_bytes=args.slot_bytes,
                                max_seq_len=args.max_seq_len, step=args.step)
        # --step persistent on dense bf16 weights: the projections as rows, read by both steps
        params = step_choice.params_for_step(family, config, mesh, options, params)
        return Decoder(config, mesh, params, options), weights_s, cache_dir
    except (ValueError, NotImplementedError) as e:
        raise UserError(str(e)) from None


def _warmup(args, dec, prompt):
    """(Decoder.warmup's result, the compilation cache's use during it), or (None, None)."""
    if not args.warmup:
        return None, None
    from .decoder import compile_cache
    from .decoder.sampling import Sampling

    with compile_cache.CacheUse() as cache_use:
        try:
            return dec.warmup(prompt.size, args.tokens, loops=(args.loop,),
                              sampling=(Sampling(args.temperature, args.top_p),)), cache_use
        except ValueError as e:  # e.g. a named sifar algorithm refusing the prefill's payload
            raise UserError(str(e)) from None


def _print_setup(args, sifar_why, family, dec, cache_dir, warmup, cache_use, stops, prompt):
    import jax

    config = dec.config
    choice = dec.step_choice  # the step its one-token calls run (decoder/step_choice.py)
    step = f"xla ({args.step} asked: {choice.reason})" if choice.reason else choice.kind
    fp8_checkpoint = getattr(config, "quantization", None) is not None  # an FP8 checkpoint's
    ar = args.allreduce + (f"/{args.algorithm}" if "sifar" in args.allreduce else "")
    if args.allreduce == "identity":
        ar += " " + IDENTITY_NOTE
    elif args.allreduce == "psum" and sifar_why:
        ar += f" (sifar_jax unusable here: {sifar_why})"
    print(f"device: {jax.devices()[0].device_kind} x{args.tp} ({jax.default_backend()}), "
          f"{family.name}: layers={config.num_layers} hidden={config.hidden_size} "
          f"dtype={config.dtype}" + (" weights=fp8" if args.quantize or fp8_checkpoint else "")
          + f", allreduce={ar}" + (" fused" if args.fused else "")
          + f", loop={args.loop}, step={step}")
    print("compilation cache: " + (cache_dir or "off"))
    if warmup:
        print(f"warm-up: {warmup['seconds']:.1f} s, {cache_use.describe()} ({warmup['executables']}"
              f" executables for prompts up to {prompt.size} tokens and {args.tokens} new ones)")
    else:
        print("warm-up: off (--no-warmup): the request compiles as it goes, stalls included")
    if stops:
        print("stop ids:", " ".join(map(str, stops)))


def _decode_request(args, dec, prompt, request: dict, stops, tok) -> tuple[float, list]:
    """The request as Decoder.stream runs it, its tokens printed as they come, but with its
    first token read before any step is dispatched: the time per output token counts from this
    request's own first token (it once subtracted the median time to first token of other
    requests, and went negative on busy cores when those were slower than this whole request).
    Returns (when the first token reached the host, each later token's time)."""
    text = tok is not None and not args.show_ids
    if text:
        print(f"prompt ({prompt.size} tokens): {tok.decode(prompt)}")
        print(TEXT_RULE)
        stream = tok.stream(context=prompt)
    else:
        print("prompt:", " ".join(map(str, prompt)))
        print("tokens:", end=" ", flush=True)
    dec.start(prompt, **request)
    dec.token()
    first_token_at = time.perf_counter()
    stamps = []
    for ids in dec.decode(args.tokens, loop=args.loop, eos_id=stops):
        stamps.append(time.perf_counter())
        piece = stream.push(int(ids[0])) if text else f"{int(ids[0])} "
        print(piece, end="", flush=True)
    if text:
        print(stream.flush())
        print(TEXT_RULE)
    else:
        print()
    return first_token_at, stamps


TTFT_REQUESTS = 3  # the time to first token is the median of this many requests


def _time_to_first_token(dec, prompt, request: dict) -> float:
    """Seconds from the request to its first token on the host: the prefill and the first
    sampled token (the same for every loop: they differ only after it); the median of
    TTFT_REQUESTS requests of the same cache size, since one request on busy cores can take
    several times as long as the others."""
    import statistics

    times = []
    for _ in range(TTFT_REQUESTS):
        t0 = time.perf_counter()
        dec.start(prompt, **request)
        dec.token()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _report_times(ttft: float, first_token_at: float, stamps: list, prompt_len: int, loop: str,
                  prefill_allreduce: str) -> None:
    """The time to first token, and the time per output token: the whole decode after the
    request's first token reached the host (first_token_at) divided by the tokens after it
    (true for every loop: pipelined and on_device deliver their tokens late or a chunk at a
    time, so the gaps between them say nothing)."""
    import statistics

    from .decoder.capacity import prompt_bucket

    print(f"time to first token: {ttft * 1e3:.3f} ms (median of {TTFT_REQUESTS} requests; "
          f"prefill of {prompt_len} tokens, padded to "
          f"{prompt_bucket(prompt_len)}, all-reduce {prefill_allreduce}; then the first sampled "
          f"token)")
    n = len(stamps) - 1
    if n < 1:
        return
    per_token = (stamps[-1] - first_token_at) / n
    line = f"time per output token: {per_token * 1e3:.3f} ms over {n} tokens"
    if loop in ("sync", "stream"):  # the gaps are the tokens' own times
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        line += (f" (gaps between tokens: median {statistics.median(gaps) * 1e3:.3f}, "
                 f"max {max(gaps) * 1e3:.3f})")
    print(line)


if __name__ == "__main__":
    sys.exit(main())
