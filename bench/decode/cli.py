"""`python -m bench.decode`: the settings, the device's copy rate, then TTFT (--ttft), the decode
cases and the virtual-ranks rows (--virtual-ranks), each written as it finishes; process 0
reports (one process per GPU under sifar_jax.launch)."""

from __future__ import annotations

import sys

import jax

from bench import common, report, ttft
from bench.decode import model_api as api
from bench.decode import output, ranks, records
from bench.decode.settings import Settings, parse_args, settings


def _start_processes() -> bool:
    """jax.distributed under `python -m sifar_jax.launch` (before any computation); False
    otherwise, and where the extension is missing (the benchmark runs without sifar)."""
    try:
        import sifar_jax
    except ImportError:
        return False
    return sifar_jax.distributed.initialize()


def measure_copy_rate(devices, s: Settings) -> float:
    """This process's first device's copy rate (common.copy_rate), said on a GPU only."""
    mine = [d for d in devices if d.process_index == jax.process_index()] or devices
    rate = common.copy_rate(mine[0])
    if s.gpu:
        print(f"device copy rate: {rate / 1e12:.3f} TB/s ({common.COPY_BYTES['gpu'] >> 30} GiB "
              f"device to device, read + write counted): the floors' rate", flush=True)
    return rate


def run_ttft(s: Settings, devices, env: dict, lead: bool, rate: float) -> tuple[list, tuple]:
    recs = ttft.run(s.config, devices, s.tp, s.variants, s.ttft, s.samples, s.seed,
                    s.options.kv_layout, rate, gpu=s.gpu)
    recs = report.cpu_flagged([dict(r, shapes=s.shapes) for r in recs], not s.gpu)
    paths = ()
    if lead:
        paths = ttft.write(recs, output.out_dir(s), env, [] if s.gpu else [output.CPU_NOTE],
                           s.gpu)
        print(report.plain_table(*ttft.table(recs, s.gpu)), flush=True)
    return recs, paths


def run_ranks(s: Settings, devices, env: dict, lead: bool, rate: float) -> tuple:
    recs = ranks.run(s, devices, rate)
    if not lead:
        return ()
    skipped = [r["skipped"] for r in recs if "skipped" in r]
    if skipped:
        print(f"virtual ranks: not run: {skipped[0]}", flush=True)
    else:
        print(report.plain_table(*ranks.table(recs, s.gpu)), flush=True)
    return ranks.write(recs, output.out_dir(s), env, s.gpu)


def _failed(recs) -> set:
    return {(r["tp"], r["allreduce"], r["sifar_check"]) for r in recs
            if r.get("sifar_check", "ok") != "ok"}


def main(argv=None) -> int:
    args = parse_args(argv)
    _start_processes()
    cache_dir = api.compile_cache.enable(off=args.no_compile_cache)
    print(f"compilation cache: {cache_dir or 'off'}", flush=True)
    platform, devices = common.bench_devices(min_gpus=1)
    s = settings(args, platform, len(devices))
    if not s.gpu:
        print(f"NOTE: {output.CPU_NOTE}", flush=True)
    if s.breakdown_asked and not s.breakdown:
        print(f"NOTE: {output.BREAKDOWN_SKIPPED}", flush=True)
    print(f"decode benchmark: {output.describe_run(s)}; TP {list(s.tp)}; variants "
          f"{[v.label for v in s.variants]}", flush=True)
    env = report.describe_environment(devices[: max(s.tp)])
    lead = jax.process_index() == 0  # with one process per GPU, process 0 reports
    if jax.process_count() > 1:
        env["host"] += f"-{jax.process_count()}proc"
    rate = measure_copy_rate(devices, s)
    paths: tuple = ()
    if s.ttft:
        ttft_records, paths = run_ttft(s, devices, env, lead, rate)
        if s.ttft_only:
            for p in paths:
                print(f"wrote {p}")
            return 0 if all("error" not in r for r in ttft_records) else 1
    recs = records.run(s, devices, rate, lambda rs: lead and output.write_outputs(
        s, env, rs, final=False))
    if s.virtual_ranks:
        paths += run_ranks(s, devices, env, lead, rate)
    if not lead:
        return 1 if _failed(recs) else 0
    paths = output.write_outputs(s, env, recs, final=True) + paths
    print(f"\n[{env['host']}] {output.describe_run(s)}")
    output.print_summary(recs, s)
    print()
    for p in paths:
        print(f"wrote {p}")
    for tp, label, why in sorted(_failed(recs)):
        print(f"sifar_jax.check() failed after TP={tp} {label}: {why}", file=sys.stderr)
    return 1 if _failed(recs) else 0
