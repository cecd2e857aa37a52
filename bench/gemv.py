"""Batch-1 projections with FP8 weights: our kernel beside XLA's and torch's paths.

32 layers of distinct weights, each layer's four projections as the decoder runs them (qkv, o,
gate_up, down), chained in one jit (one call's output feeds the next; a slice where the decoder
has attention or the activation), at Llama-3.1-8B's TP=1 shapes and TP=2's per-rank shapes.
Each row: time per chain, the weight bytes read per second, and the ratio to the bytes' floor
(the weight bytes at the device's copy rate, bench.common.copy_rate, measured in this process
before the paths). Paths: sifar_jax.fp8_matvec (per-channel scales; with and without
programmatic dependent launch and the L2 prefetch), XLA's bf16 dot (1 and 2 rows), XLA's dot
on e4m3 weights converted inside it x per-channel scale (1 and 2 rows), torch._scaled_mm
(e4m3 x e4m3, 16 rows, per-tensor scales, a CUDA graph) when torch is there.

    python -m bench.gemv [--out DIR] [--tp 1 2] [--rows 1] [--torch/--no-torch]

On a CPU (the op's CPU handler) it prints and writes no timing figure: which paths ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

LAYERS = 32
HIDDEN, INTER, QKV = 4096, 14336, 6144  # Llama-3.1-8B


def shapes(tp: int) -> list[tuple[str, int, int]]:
    """(name, K, N) per projection, one rank's share at tensor parallelism tp."""
    return [("qkv", HIDDEN, QKV // tp), ("o", HIDDEN // tp, HIDDEN),
            ("gate_up", HIDDEN, 2 * INTER // tp), ("down", INTER // tp, HIDDEN)]


def chain(project, layers, x, tp):
    """The 32 layers' projections, each feeding the next (slices stand for attention and the
    activation, which the decoder runs between them)."""
    h = x
    for ws in layers:
        for (name, k, _), w in zip(shapes(tp), ws):
            h = project(h[:, :k], w)
    return h


def timed(fn, args, reps=30, inner=5) -> float:
    """Median seconds per call over `reps` batches of `inner` back-to-back calls."""
    import jax

    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        r = None
        for _ in range(inner):
            r = fn(*args)
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t0) / inner)
    return statistics.median(out)


def jax_rows(tp: int, rows: int, copy_tbps: float) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from sifar_jax import fp8_matvec as f8

    key = jax.random.key(tp)
    fp8, bf16 = [], []
    for i in range(LAYERS):
        lw8, lw16 = [], []
        for j, (_, k, n) in enumerate(shapes(tp)):
            kk = jax.random.fold_in(key, i * 4 + j)
            w = jax.random.normal(kk, (n, k), jnp.bfloat16)
            q = (w * 32).astype(jnp.float8_e4m3fn)
            s = jnp.full((n, 1), 1 / (32 * k ** 0.5), jnp.float32)
            lw8.append((q, s))
            lw16.append((w * k ** -0.5).T)  # [K, N]: XLA's x @ w
        fp8.append(lw8)
        bf16.append(lw16)
    jax.block_until_ready((fp8, bf16))
    fp8_bytes = sum(q.size for ws in fp8 for q, _ in ws)
    x = jax.random.normal(key, (rows, max(k for _, k, _ in shapes(tp))), jnp.bfloat16)

    def ours(**kw):
        return lambda h, w: f8.fp8_matvec(h, w[0], w[1], impl="kernel", **kw)

    def widened(dot, r):  # XLA's dot on r copies of one row (docs/performance.md: 2 rows)
        def f(h, w):
            hh = jnp.broadcast_to(h, (max(r, h.shape[0]),) + h.shape[1:]) if r > 1 else h
            return dot(hh, w)[: h.shape[0]]
        return f

    bf16_dot = lambda h, w: jnp.dot(h, w, preferred_element_type=jnp.float32).astype(h.dtype)  # noqa: E731
    fp8_dot = lambda h, w: (jnp.einsum("mk,nk->mn", h, w[0].astype(h.dtype),  # noqa: E731
                                       preferred_element_type=jnp.float32)
                            * w[1][:, 0]).astype(h.dtype)
    paths = [("sifar fp8_matvec, pdl + L2 prefetch", "fp8", ours(prefetch=True), fp8),
             ("sifar fp8_matvec, pdl", "fp8", ours(prefetch=False), fp8),
             ("sifar fp8_matvec, plain launch", "fp8", ours(pdl=False, prefetch=False), fp8),
             ("XLA bf16 dot, 1 row", "bf16", widened(bf16_dot, 1), bf16),
             ("XLA bf16 dot, 2 rows", "bf16", widened(bf16_dot, 2), bf16),
             ("XLA e4m3 converted in the dot x scale, 1 row", "fp8", widened(fp8_dot, 1), fp8),
             ("XLA e4m3 converted in the dot x scale, 2 rows", "fp8", widened(fp8_dot, 2), fp8)]
    out = []
    for name, weights, proj, ws in paths:
        fn = jax.jit(lambda x, ws, proj=proj: chain(proj, ws, x, tp))
        try:
            sec = timed(fn, (x, ws))
        except Exception as e:  # noqa: BLE001 - a path that cannot run is reported, not fatal
            out.append({"path": name, "tp_shapes": tp, "rows": rows, "error": repr(e)[:300]})
            continue
        nbytes = fp8_bytes * (1 if weights == "fp8" else 2)
        out.append(record(name, weights, tp, rows, sec, nbytes, copy_tbps))
    return out


def record(name, weights, tp, rows, sec, nbytes, copy_tbps=None) -> dict:
    """One path's row, with its floor where the copy rate is known (the torch child's rows get
    theirs in the parent: with_floor)."""
    rec = {"path": name, "weights": weights, "shapes": "tp1" if tp == 1 else f"tp{tp}_rank",
           "tp_shapes": tp, "rows": rows, "ms": sec * 1e3, "bytes": nbytes,
           "tbps": nbytes / sec / 1e12}
    return with_floor(rec, copy_tbps) if copy_tbps else rec


def with_floor(rec: dict, copy_tbps: float) -> dict:
    """rec with copy_tb_s, floor_ms (its weight bytes at the copy rate) and x_floor."""
    if "error" in rec:
        return rec
    floor_ms = rec["bytes"] / (copy_tbps * 1e12) * 1e3
    return dict(rec, copy_tb_s=copy_tbps, floor_ms=floor_ms, x_floor=rec["ms"] / floor_ms)


def torch_rows(tp: int) -> list[dict]:
    """torch._scaled_mm chain in a CUDA graph (run in its own process: torch's allocator)."""
    import torch

    dev = torch.device("cuda")
    layers = []
    for _ in range(LAYERS):
        layers.append([(torch.randn(n, k, device=dev).mul_(32).to(torch.float8_e4m3fn).t(),
                        torch.tensor(1 / (32 * k ** 0.5), device=dev))
                       for _, k, n in shapes(tp)])
    one = torch.tensor(1.0, device=dev)
    x = torch.randn(16, HIDDEN, device=dev, dtype=torch.bfloat16)

    def run():
        h = x
        for ws in layers:
            for (_, k, _), (w, s) in zip(shapes(tp), ws):
                a = h[:, :k].contiguous().to(torch.float8_e4m3fn)
                h = torch._scaled_mm(a, w, scale_a=one, scale_b=s, out_dtype=torch.bfloat16)
        return h

    torch.cuda.synchronize()
    run()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    times = []
    for _ in range(30):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / 5)
    nbytes = sum(w.numel() for ws in layers for w, _ in ws)
    return [record("torch._scaled_mm e4m3, 16 rows (CUDA graph)", "fp8", tp, 16,
                   statistics.median(times), nbytes)]


def markdown(records, gpu: bool = True) -> str:
    """The rows; where not gpu without their timings (which paths ran)."""
    from bench import report

    rows = [[r.get("shapes", f"tp{r['tp_shapes']}"), r["path"], r["rows"]]
            + (["error"] if "error" in r else [f"{r['ms']:.3f}", f"{r['tbps']:.2f}",
                                               f"{r['x_floor']:.2f}"] if gpu else ["ran"])
            for r in records]
    return report.markdown_table(["shapes", "path", "rows"]
                                 + (["ms", "TB/s", "x floor"] if gpu else ["result"]), rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="results folder (default bench/results)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, nargs="+", default=[1])
    p.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--torch-only", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    global LAYERS
    LAYERS = args.layers
    if args.torch_only is not None:
        print(json.dumps(torch_rows(args.torch_only)))
        return
    from bench import common, report

    records = []
    for tp in args.tp if args.torch else ():  # first: torch's process before jax takes memory
        r = subprocess.run([sys.executable, "-m", "bench.gemv", "--torch-only", str(tp),
                            "--layers", str(LAYERS)],
                           capture_output=True, text=True, env=common.child_env())
        try:
            records += json.loads(r.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            records.append({"path": "torch._scaled_mm", "tp_shapes": tp, "rows": 16,
                            "error": r.stderr[-300:]})
    import jax

    gpu = jax.devices()[0].platform == "gpu"
    copy_tbps = common.copy_rate(jax.devices()[0]) / 1e12  # before any weights are allocated
    records = [with_floor(r, copy_tbps) for r in records]
    for tp in args.tp:
        for rows in args.rows:
            records += jax_rows(tp, rows, copy_tbps)
    env = report.describe_environment(jax.devices())
    host = env["host"]
    out = report.default_out(env["platform"]) if args.out is None else args.out
    report.write_json(report.results_path(out, "gemv", host, ".json"),
                      {"environment": env, "copy_tb_s": copy_tbps, "records": records,
                       **({} if gpu else {report.CPU_FLAG: True})})
    note = (f"x floor: time / (weight bytes at this device's copy rate, measured here: "
            f"{copy_tbps:.3g} TB/s)" if gpu else "XLA:CPU: which paths ran; no timing is shown.")
    report.write_markdown(report.results_path(out, "gemv", host, ".md"),
                          f"FP8 GEMV: {LAYERS} layers of Llama-8B projections, batch 1", env,
                          [("Results", markdown(records, gpu))], notes=[note])
    print(markdown(records, gpu))


if __name__ == "__main__":
    main()
