"""The command line of models.generate: its arguments, parsed and checked before jax starts
(what needs jax, a device or a checkpoint is checked as the request is built: __init__.py)."""

from __future__ import annotations

import argparse
import os

ALLREDUCE_CHOICES = ("sifar", "psum", "sifar_buffers", "identity")  # = core.tp.ALLREDUCE_KINDS
LOOP_CHOICES = ("stream", "sync", "pipelined", "on_device")  # = models.LOOPS
IDENTITY_NOTE = "(no communication: meaningless tokens, a timing bound)"


class UserError(Exception):
    """A mistake in the arguments or the environment: printed as one `error:` line, exit 2."""


def sifar_status() -> tuple[tuple, str | None]:
    """(sifar_jax's algorithm names, None), or ((), why sifar_jax cannot be used here).
    Importing jax does not start its backend, so XLA_FLAGS can still be set after this."""
    try:
        import sifar_jax
    except Exception as e:  # noqa: BLE001 - extension not built, or a broken install
        return (), f"import sifar_jax failed: {e}"
    return tuple(sifar_jax.ALGORITHMS), None


def make_parser(algorithms: tuple, sifar_why: str | None,
                description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m models.generate", description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # (the names are checked after jax is imported: every family's presets, models.registry)
    p.add_argument("--preset", default="tiny",
                   help="model shapes, random weights: tiny, llama_step_tiny (one the persistent "
                        "step serves), qwen3_moe_tiny, llama3_8b, qwen3_30b_a3b")
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
    p.add_argument("--step", default="auto", choices=("auto", "xla", "persistent"),
                   help="how a one-token step runs. persistent: as one sifar_jax.llama_step call "
                        "(a persistent kernel on CUDA GPUs; Llama, bf16, head_dim 128, batch 1, "
                        "TP 1-8, FP8 weights or bf16 ones held as rows, which both steps read; "
                        "Qwen3-MoE likewise through sifar_jax.qwen3_moe_step at TP 1; "
                        "on CPU host devices the op's C++ reference, slowly; an error where it "
                        "cannot serve the model); xla: XLA's kernels; auto: persistent where it "
                        "serves the model on a GPU, else xla (the device line says which and "
                        "why)")
    p.add_argument("--step-allreduce", default="sifar", choices=("sifar", "oneshot"),
                   help="the all-reduce inside the persistent step at --tp >= 2")
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


def ensure_host_devices(n: int) -> None:
    # Must run before jax creates its backend. The flag only adds CPU devices, so it is harmless
    # where a GPU is the default backend; an explicit count in XLA_FLAGS is respected.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def check_args(args) -> None:
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
