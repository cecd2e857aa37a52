"""Probe: is a batch-1 decode step slower than a batch-2 one at TP=2's per-rank shapes, and does
running only its projections as two rows (Decoder(gemm_rows=2)) recover the difference?

At TP=2 (bench/results/decode-sweep-2xH200.md) a batch-1 step took 4.28 ms (lax.psum) and a
batch-2 step 3.66 ms; at TP=1 both took 4.26 ms. This runs TP=2's per-rank shapes (16 query
heads, 4 KV heads, MLP 7168, vocab 64128: half of Llama-3.1-8B) as a 1-GPU model, so one GPU
shows whether the shapes alone make batch 1 slow, and lists the matmul kernels XLA chose.

    python -m bench.probes.batch1_dots            # on a GPU host; XLA_FLAGS for variants
"""

from __future__ import annotations

import collections
import os
import re

from bench import decode as bd
from models import make_mesh, random_params
from models.config import LlamaConfig

SHAPES = {"tp2_rank": dict(num_heads=16, num_kv_heads=4, head_dim=128, intermediate_size=7168,
                           vocab_size=64128),
          "full": {}}


def dots(text: str) -> dict:
    """Matmul-like instructions of the optimised HLO by kind, with one example each."""
    out = collections.Counter()
    for line in text.splitlines():
        m = re.search(r'custom_call_target="([^"]+)"', line)
        if m and ("gemm" in m.group(1) or "cublas" in m.group(1)):
            out[f"custom-call {m.group(1)}"] += 1
        m = re.search(r'"kind":"(__triton[^"]*)"', line) or re.search(r"kind=(kCustom)", line)
        if m and "fusion(" in line:
            out[f"fusion {m.group(1)}"] += 1
        if re.search(r"= \S+ dot\(", line.strip()):
            out["plain dot"] += 1
    return dict(out)


def main() -> None:
    s = {"warmup": 2, "samples": 6, "tokens": 0, "chunk": 16}
    mesh = make_mesh(1)
    print("XLA_FLAGS:", os.environ.get("XLA_FLAGS", "<unset>"), flush=True)
    for name, kw in SHAPES.items():
        config = LlamaConfig.llama3_8b().replace(dtype="bfloat16", max_seq_len=1024, **kw)
        params = random_params(config, mesh, seed=0)
        for batch, gemm_rows in ((1, 1), (1, 2), (2, 1)):
            dec = bd.make_decoder(config, mesh, params, ("psum", "psum", "auto", False), batch,
                                  1024, 0, gemm_rows=gemm_rows)
            bd._seek(dec, "pipelined", s, 1024, bd.start_tokens(config, batch, 0))
            found = dots(dec.compiled_step().as_text())
            times, _ = bd.time_pipelined(dec, s)
            ms = sorted(t * 1e3 for t in times)
            print(f"{name:9s} batch {batch} gemm_rows {gemm_rows}: {ms[len(ms) // 2]:.3f} ms/step "
                  f"(min {ms[0]:.3f}); matmuls: {found}", flush=True)
            del dec


if __name__ == "__main__":
    main()
