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

    __init__.py   main: the model, the request and the decoder built, warmed up, run and timed
    __main__.py   `python -m models.generate`
    cli.py        the arguments, parsed and checked before jax starts
    tokenizer.py  text in and out for a checkpoint (its tokenizer, chat template, stop ids)

Nothing here imports jax at import time: XLA_FLAGS is set first.
"""

from __future__ import annotations

import contextlib
import sys
import time

from .cli import (ALLREDUCE_CHOICES, IDENTITY_NOTE, LOOP_CHOICES, UserError, check_args,
                  ensure_host_devices, make_parser, sifar_status)

__all__ = ["main", "ALLREDUCE_CHOICES", "IDENTITY_NOTE", "LOOP_CHOICES", "TEXT_RULE", "UserError"]

TEXT_RULE = "-" * 40  # frames the generated text


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
    from ..weights.checkpoint import read_hf_config
    from ..registry import family_for_checkpoint, presets

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
    algorithms, sifar_why = sifar_status()
    args = make_parser(algorithms, sifar_why, __doc__.split("\n")[0]).parse_args(argv)
    try:
        return _run(args, sifar_why, started)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args, sifar_why, started: float) -> int:
    check_args(args)
    if "sifar" in args.allreduce and sifar_why:
        raise UserError(f"--allreduce {args.allreduce}: {sifar_why}")
    if args.algorithm == "multicast":  # opt-in, by the environment (sifar_jax.multicast's guard)
        from sifar_jax import multicast

        if multicast.refusal():
            raise UserError(f"--algorithm multicast: {multicast.refusal()}")
    ensure_host_devices(args.tp)

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
    from ..decoder.capacity import cache_reserve

    # A request's start (Decoder.start): its stop ids, sampling, seed and cache positions.
    request = dict(eos_id=stops, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                   reserve=cache_reserve(args.tokens, args.loop))
    warmup, cache_use = _warmup(args, dec, prompt)
    _print_setup(args, sifar_why, family, dec, cache_dir, warmup, cache_use, stops, prompt)
    with _compiling(args):
        ttft = _time_to_first_token(dec, prompt, request)
    print(f"process start to first token: {time.perf_counter() - started - weights_s:.1f} s "
          f"(+ {weights_s:.1f} s making or loading the weights)")
    with _compiling(args):
        first_token_at, stamps = _decode_request(args, dec, prompt, request, stops, tok)
    _report_times(ttft, first_token_at, stamps, prompt.size, args.loop,
                  dec.prefill_allreduce(prompt.size))
    return 0


@contextlib.contextmanager
def _compiling(args):
    """With --no-warmup the request compiles its executables as it goes, and a ValueError raised
    as one is traced is a combination of arguments the model refuses (e.g. a named sifar
    algorithm and the prefill's payload): one error line, as _warmup makes it when the warm-up
    compiles them. After a warm-up nothing compiles here: whatever is raised stays a
    traceback."""
    try:
        yield
    except ValueError as e:
        if args.warmup:
            raise
        raise UserError(str(e)) from None


def _rng(seed: int):
    import numpy as np

    return np.random.default_rng(seed)


def _checked_fit(args, family, config, prompt):
    """The config with a max_seq_len that admits this request, after checking that the model,
    its KV cache and the transient fit the devices (footprint.py: on a CPU, every host device
    shares the host's memory): else one error line, before any weight is allocated."""
    import jax

    from ..decoder import footprint
    from ..decoder.capacity import ON_DEVICE_CHUNK, bucket_up, prompt_bucket

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

    from ..decoder import compile_cache, step_choice
    from ..decoder.decoder import Decoder, make_mesh
    from ..decoder.options import DecodeOptions

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
            if args.quantize:  # an FP8 checkpoint's dense leftovers (a bf16 LM head)
                from ..weights.transforms import quantize_params

                params = quantize_params(params, family, donate=True)
        # a bad checkpoint (CheckpointError, Fp8CheckpointError), or one the arguments cannot
        # run (FP8 weights at a TP that leaves a rank too few columns)
        except (ValueError, OSError) as e:
            raise UserError(f"--checkpoint {args.checkpoint}: {e}") from None
    else:
        try:
            params = family.random_params(config, mesh, seed=args.seed, quantize=args.quantize)
        except ValueError as e:  # e.g. --quantize fp8 at a TP the FP8 GEMV cannot take
            raise UserError(str(e)) from None
    jax.block_until_ready(params)
    weights_s = time.perf_counter() - t_weights
    try:
        options = DecodeOptions(allreduce=args.allreduce, algorithm=args.algorithm,
                                fused=args.fused, slot_bytes=args.slot_bytes,
                                max_seq_len=args.max_seq_len, step=args.step,
                                step_allreduce=args.step_allreduce)
        # the persistent step (asked, or "auto" where it serves) on dense bf16 weights: the
        # projections as rows, read by both steps
        params = step_choice.params_for_step(family, config, mesh, options, params)
        return Decoder(config, mesh, params, options), weights_s, cache_dir
    except (ValueError, NotImplementedError) as e:
        raise UserError(str(e)) from None


def _warmup(args, dec, prompt):
    """(Decoder.warmup's result, the compilation cache's use during it), or (None, None)."""
    if not args.warmup:
        return None, None
    from ..decoder import compile_cache
    from ..decoder.sampling import Sampling

    with compile_cache.CacheUse() as cache_use:
        try:
            return dec.warmup(prompt.size, args.tokens, loops=(args.loop,),
                              sampling=(Sampling(args.temperature, args.top_p),)), cache_use
        except ValueError as e:  # e.g. a named sifar algorithm refusing the prefill's payload
            raise UserError(str(e)) from None


def _print_setup(args, sifar_why, family, dec, cache_dir, warmup, cache_use, stops, prompt):
    import jax

    config = dec.config
    step = dec.step_choice.describe()  # the step its one-token calls run, how and why
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

    from ..decoder.capacity import prompt_bucket

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
