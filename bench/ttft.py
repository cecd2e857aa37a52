"""Time to first token (TTFT) per bench.decode variant for prompts of given lengths:
`python -m bench.decode --ttft 128,1024,4096` (on a CPU: 16,64).

TTFT: Decoder.start(prompt) (the prefill and its first sampled token) and that token read on the
host, after an untimed run compiled the prompt's bucket; the median over `samples` runs. Its
floor: the prefill's matmul FLOPs (2 x parameters x prompt / TP) at the device's dense bf16 rate,
or the weights' bytes per rank at the device's copy rate (measured in the run), the larger. Each
record says which all-reduce the prefill ran (a payload past sifar's slot runs lax.psum).
Written as ttft-<host>.{json,md}; a CPU run prints and writes no timing figure.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Optional, Sequence

import jax
import numpy as np

import models
from bench import common, report
from models.decoder.capacity import prompt_bucket
from models.decoder.options import SIFAR_KINDS

DEFAULT_LENGTHS = {"gpu": (128, 1024, 4096), "cpu": (16, 64)}
# Dense bf16 matmul rate per GPU (vendor peak, no sparsity), by device_kind substring.
BF16_FLOPS_PER_S = {"H200": 989e12, "H100": 989e12, "B200": 2250e12, "A100": 312e12}


def parse_lengths(text: Optional[str], platform: str) -> list[int]:
    """'128,1024,4096' (or 'default': DEFAULT_LENGTHS of the platform) -> lengths."""
    if text in (None, "", "default"):
        return list(DEFAULT_LENGTHS["gpu" if platform == "gpu" else "cpu"])
    lengths = [int(v) for v in str(text).replace(",", " ").split()]
    if not lengths or min(lengths) < 1:
        raise SystemExit(f"--ttft {text}: prompt lengths must be >= 1")
    return lengths


def device_flops(device) -> Optional[float]:
    """The device's dense bf16 rate, None where unknown (CPUs)."""
    if device.platform != "gpu":
        return None
    return next((v for k, v in BF16_FLOPS_PER_S.items() if k in device.device_kind), None)


def weight_bytes_per_rank(params) -> int:
    """Every parameter's local shard on one rank (the prefill reads the whole model once)."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
               for a in jax.tree.leaves(params))


def floor(n_params: int, weight_bytes: int, prompt_len: int, tp: int, flops: Optional[float],
          copy_bytes_per_s: float) -> dict:
    """The prefill's lower bound per rank: its matmul FLOPs at `flops`, its weights' bytes at
    `copy_bytes_per_s`; floor_ms is the larger (None where the device's rate is unknown)."""
    compute = None if flops is None else 2 * n_params * prompt_len / tp / flops * 1e3
    weights = weight_bytes / copy_bytes_per_s * 1e3
    known = compute is not None
    return {"compute_floor_ms": round(compute, 4) if known else None,
            "weights_floor_ms": round(weights, 4),
            "floor_ms": round(max(compute, weights), 4) if known else None,
            "floor_bound": None if not known else "compute" if compute >= weights else "weights"}


def time_to_first_token(dec: models.Decoder, prompt: np.ndarray) -> float:
    """Seconds from the request to its first token on the host."""
    t0 = time.perf_counter()
    dec.start(prompt)
    dec.token()
    return time.perf_counter() - t0


def measure_variant(config, mesh, params, label: str, options, lengths: Sequence[int],
                    samples: int, seed: int, kv_layout, copy_bytes_per_s: float) -> list[dict]:
    """One record per prompt length for one bench.decode variant (its label and options)."""
    tp = mesh.shape["tp"]
    base = {"kind": "ttft", "allreduce": label, "tp": tp, "fused": bool(options.fused)}
    try:
        dec = models.Decoder(config, mesh, params, options.replace(kv_layout=kv_layout))
    except (ValueError, NotImplementedError) as e:
        return [dict(base, prompt_len=n, error=str(e)) for n in lengths]
    rng = np.random.default_rng(seed)
    n_params = sum(math.prod(a.shape) for a in jax.tree.leaves(params))
    wbytes = weight_bytes_per_rank(params)
    flops = device_flops(mesh.devices.flat[0])
    out = []
    for n in lengths:
        prompt = rng.integers(0, config.vocab_size, n, dtype=np.int32)
        t0 = time.perf_counter()
        try:
            time_to_first_token(dec, prompt)  # compiles this prompt's bucket
        except ValueError as e:  # a named algorithm whose slot this prefill's payload exceeds
            # (it raises by design where "auto" hands the payload to lax.psum): not measured
            out.append(dict(base, prompt_len=n, prompt_bucket=prompt_bucket(n), skipped=str(e)))
            dec.reset()
            continue
        first_s = time.perf_counter() - t0
        ms = [time_to_first_token(dec, prompt) * 1e3 for _ in range(samples)]
        med = statistics.median(ms)
        rec = dict(base, prompt_len=n, prompt_bucket=prompt_bucket(n),
                   ttft_ms_median=round(med, 4), ttft_ms=[round(x, 4) for x in ms],
                   first_call_s=round(first_s, 3), prefill_allreduce=dec.prefill_allreduce(n),
                   params=n_params, weight_bytes_per_rank=wbytes, device_flops=flops,
                   **floor(n_params, wbytes, n, tp, flops, copy_bytes_per_s))
        rec["floor_ratio"] = round(med / rec["floor_ms"], 2) if rec["floor_ms"] else None
        out.append(rec)
    del dec
    return out


def _said(r: dict, gpu: bool) -> str:
    if "ttft_ms_median" in r:
        return f"{r['prompt_len']} tokens " + (f"{r['ttft_ms_median']:.2f} ms" if gpu else "ran")
    return f"{r['prompt_len']}: {r.get('error') or 'not run: ' + r['skipped']}"


def run(config, devices, tps: Sequence[int], variants: Sequence, lengths: Sequence[int],
        samples: int, seed: int, kv_layout, copy_bytes_per_s: float, gpu: bool = True,
        log=print) -> list[dict]:
    """TTFT records for every TP size (TP=1: lax.psum only) and variant (bench.decode's:
    .label, .options); the log line of each variant without timings where not gpu."""
    config = config.replace(max_seq_len=max(config.max_seq_len, prompt_bucket(max(lengths)) + 64))
    records = []
    for tp in tps:
        mesh = models.make_mesh(tp, devices=devices)
        params = common.block(models.random_params(config, mesh, seed=seed))
        here = ([("psum", models.DecodeOptions(step="xla"))] if tp == 1
                else [(v.label, v.options) for v in variants])
        for label, options in here:
            recs = measure_variant(config, mesh, params, label, options, lengths, samples, seed,
                                   kv_layout, copy_bytes_per_s)
            records += recs
            log(f"TTFT TP={tp} {label:>12}: " + ", ".join(_said(r, gpu) for r in recs))
        del params
        if any(options.allreduce in SIFAR_KINDS for _, options in here):
            import sifar_jax

            sifar_jax.shutdown()
        jax.clear_caches()
        gc.collect()
    return records


def _ms(x) -> str:
    return "-" if x is None else f"{x:.3f}" if x < 10 else f"{x:.1f}"


def table(records: Sequence[dict], gpu: bool = True) -> tuple[list[str], list[list]]:
    """Per TP, variant and prompt; the timing columns on GPUs only."""
    headers = ["TP", "all-reduce", "prompt", "prefill all-reduce"]
    timing = ["TTFT ms", "floor ms", "bound", "TTFT / floor"] if gpu else []
    rows = [[r["tp"], r["allreduce"], r["prompt_len"]]
            + ([_ms(r["ttft_ms_median"]), _ms(r["floor_ms"]), r["floor_bound"] or "-",
                "-" if r["floor_ratio"] is None else f"{r['floor_ratio']:.2f}x"] if gpu else [])
            + [r["prefill_allreduce"]] for r in records if "error" not in r and "skipped" not in r]
    rows += [[r["tp"], r["allreduce"], r["prompt_len"]] + ["-"] * len(timing)
             + ["not run: " + r["skipped"].split(": ", 1)[-1]] for r in records if "skipped" in r]
    return headers[:3] + timing + headers[3:], rows


def write(records: Sequence[dict], out_dir, env: dict, notes: Sequence[str] = (),
          gpu: bool = True) -> tuple:
    """ttft-<host>.json and .md in out_dir (the markdown without timings where not gpu)."""
    host = env["host"]
    json_path = report.write_json(report.results_path(out_dir, "ttft", host, ".json"), records)
    headers, rows = table(records, gpu)
    errors = [f"TP={r['tp']} {r['allreduce']} {r['prompt_len']}: {r['error']}"
              for r in records if "error" in r]
    sections = [("Time to first token (prefill + the first sampled token, read on the host)",
                 report.markdown_table(headers, rows))]
    if errors:
        sections.append(("Not measured", "\n".join(f"- {e}" for e in errors)))
    md_path = report.write_markdown(report.results_path(out_dir, "ttft", host, ".md"),
                                    f"Time to first token on {host}", env, sections,
                                    [__doc__.split("\n\n")[1].replace("\n", " ")] + list(notes))
    return json_path, md_path
