"""Probe: does any XLA:GPU compile option make a batch-1 decode step faster?

A TP=1 step (Llama-3.1-8B shapes, lax.psum) runs 0.65 ms over its 3.52 ms weight-streaming floor:
~190 us of it in the matmuls (qkv and o stream at 3.4-3.6 TB/s, gate_up at 4.25) and the rest in
~14 small fusions per layer (docs/performance.md). XLA has options that change exactly those:
how GEMM tilings are searched, which producers fuse into Triton GEMMs, programmatic dependent
launch between kernels, how command buffers schedule. Each is passed to the step's compile alone
(`Lowered.compile(compiler_options=...)`), so one process times every option set on the same
weights with bench.decode's own pipelined timer. An option this XLA does not know is reported,
not fatal.

    python -m bench.probes.xla_options                       # one GPU
    python -m bench.probes.xla_options --shapes full,tp2_rank --context 1024,16384
    python -m bench.probes.xla_options --options 'xla_gpu_enable_pdl=true;xla_gpu_exhaustive_tiling_search=true'
    python -m bench.probes.xla_options --quick               # the code path on a CPU
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench import decode as bd
from bench.probes.batch1_dots import SHAPES
from models import make_mesh, random_params
from models.config import LlamaConfig

# One option set per entry: "name=value,name=value"; "" is XLA's defaults.
DEFAULT_OPTIONS = (
    "",
    "xla_gpu_enable_pdl=true",
    "xla_gpu_triton_gemm_any=true",
    "xla_gpu_experimental_enable_fusion_block_level_rewriter=true",
    "xla_gpu_experimental_enable_triton_heroless_priority_fusion=true",
    "xla_gpu_command_buffer_scheduling_mode=LHS",
    "xla_gpu_exhaustive_tiling_search=true",
)


def parse_options(text: str) -> dict:
    """'a=true,b=3' -> {'a': True, 'b': 3}: the types compiler_options takes."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, value = item.partition("=")
        low = value.lower()
        out[name] = (low == "true") if low in ("true", "false") else (
            int(value) if value.lstrip("-").isdigit() else value)
    return out


def with_options(dec, options: dict) -> None:
    """Make every executable `dec` compiles from now on use `options`."""
    lower = dec.exes.lower

    class _Lowered:
        def __init__(self, lowered):
            self._lowered = lowered

        def compile(self, compiler_options=None):  # the decoder passes its own (Decoder)
            return self._lowered.compile(
                compiler_options={**(compiler_options or {}), **options} or None)

    dec.exes.lower = lambda *a, **k: _Lowered(lower(*a, **k))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--options", default=";".join(DEFAULT_OPTIONS),
                   help="option sets separated by ';', each 'name=value,...' ('' = defaults)")
    p.add_argument("--shapes", default="full", help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--context", default="1024", help="comma list of KV lengths")
    p.add_argument("--samples", type=int, default=6)
    p.add_argument("--repeat", type=int, default=1, help="time each option set this many times, "
                   "interleaved (a paired comparison)")
    p.add_argument("--quick", action="store_true", help="a tiny model (the CPU tests' path)")
    args = p.parse_args(argv)
    s = {"warmup": 2, "samples": args.samples, "tokens": 0, "chunk": 16}
    mesh = make_mesh(1)
    sets = [o.strip() for o in args.options.split(";")]
    for shape in args.shapes.split(","):
        for context in map(int, args.context.split(",")):
            base = LlamaConfig.tiny() if args.quick else LlamaConfig.llama3_8b()
            config = base.replace(dtype="bfloat16", max_seq_len=context,
                                  **({} if args.quick else SHAPES[shape]))
            params = random_params(config, mesh, seed=0)
            decoders = {}
            for text in sets:
                dec = bd.make_decoder(config, mesh, params, ("psum", "psum", "auto", False), 1,
                                      context, 0)
                with_options(dec, parse_options(text))
                bd._seek(dec, "pipelined", s, context, bd.start_tokens(config, 1, 0))
                t0 = time.perf_counter()
                try:
                    dec.compiled_step()
                except Exception as e:  # noqa: BLE001 - an option this XLA rejects
                    print(f"{shape} KV {context} [{text or 'defaults'}]: not compiled: "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                    continue
                decoders[text] = (dec, time.perf_counter() - t0)
            results = {text: [] for text in decoders}
            for _ in range(args.repeat):
                for text, (dec, _) in decoders.items():
                    bd._seek(dec, "pipelined", s, context, bd.start_tokens(config, 1, 0))
                    times, _ = bd.time_pipelined(dec, s)
                    results[text].append(float(np.median(times)) * 1e3)
            for text, ms in results.items():
                print(f"{shape} KV {context} [{text or 'defaults'}]: "
                      f"{' / '.join(f'{m:.3f}' for m in ms)} ms/step pipelined "
                      f"(compile {decoders[text][1]:.1f} s)", flush=True)
            del decoders
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
