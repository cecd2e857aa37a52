"""`python -m bench.allreduce`: the peers first (before JAX takes the GPUs), ours, then the
report (process 0 of a launched run)."""

from __future__ import annotations

import os
import sys

import jax

import sifar_jax
from bench import common, peers, report
from bench.allreduce.measure import run, run_peers
from bench.allreduce.settings import CPU_NOTE, LEVEL_TEXT, SCHEMA, parse_args
from bench.allreduce.tables import (comparison, peer_tables, print_tables, protocol_rows, tables,
                                    trace_tables)

def _sections(records, meta, peer_out, warnings_out, gpu: bool) -> tuple[list, list[str]]:
    """The markdown's sections and notes: on GPUs the latencies, sifar against the peers and
    the trace; on a CPU what ran and the trace's retries, no timing."""
    cfg, sizes = meta["cfg"], meta["sizes"]
    notes = [] if gpu else [CPU_NOTE]
    if gpu:
        notes.append(f"kernel level: (t(R) - t(1)) / (R - 1), R = {cfg['kernel_r']}; jit level: "
                     f"(t(R2) - t(R1)) / (R2 - R1), chains of {cfg['chain'][0]} and "
                     f"{cfg['chain'][1]}; median (p10-p90) over {cfg['runs']} runs, us, bf16 per "
                     "device; 'not resolved': within its noise bound (docs/reference.md, "
                     "bench.allreduce).")
    notes += [f"**{w}**" for w in warnings_out]
    sections = report.section("What ran: sifar_jax.stats() per algorithm and its results against "
                              "lax.psum", protocol_rows(meta))
    for tp, headers, rows in peer_tables(records, comparison(records), sizes) if gpu else ():
        sections += report.section(f"sifar against every peer, TP={tp} (median us; in brackets "
                                   "peer / sifar at jit level, > 1 means sifar is faster)",
                                   (headers, rows))
    if peer_out["errors"]:
        rows = [[e.get("algorithm", "-"), e.get("tp", "-"),
                 f"{e['bytes'] / 1024:g} KB" if e.get("bytes") else "all", e["error"]]
                for e in peer_out["errors"]]
        sections += report.section("Peers that did not run or were not timed",
                                   (["peer", "TP", "size", "why"], rows))
    for level, tp, headers, rows in tables(records, sizes, with_spread=True) if gpu else ():
        sections += report.section(f"{level} level, TP={tp}", (headers, rows))
    if "records" not in meta["trace"]:
        return sections, notes + [f"Per-call trace: {meta['trace']['skipped']}."]
    mis, tails = trace_tables(meta["trace"]["records"], gpu)
    sections += report.section(
        "Mis-speculation per call (device trace of the jit chain; retried: share of calls in "
        "which block 0 of a rank re-read a stale word" + ("; cost: 1 - mean(clean) / mean(all), "
                                                          "an upper bound)" if gpu else
                                                          "; skew setting: --skew-us)"), mis)
    sections += report.section("Tail latency per call (end - start per call and rank: "
                               "%globaltimer on GPUs)", tails)
    return sections, notes


def write_outputs(out_dir, args, records, meta, env, warnings_out, peer_out):
    """allreduce-<host>.json (everything, flagged CPU_FLAG on a CPU) and .md (the tables)."""
    host, gpu = env["host"], meta["kind"] == "gpu"
    payload = {
        "schema": SCHEMA, "env": env,
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in meta["cfg"].items()},
        "levels": LEVEL_TEXT, "records": records,
        "errors": peer_out["errors"] + [{"error": w} for w in warnings_out],
        "checks": meta["checks"], "stats": {str(k): v for k, v in meta["stats"].items()},
        "comparison": comparison(records), "trace": meta["trace"],
        **({} if gpu else {report.CPU_FLAG: True}),
    }
    json_path = report.write_json(report.results_path(out_dir, "allreduce", host, ".json"),
                                  payload)
    sections, notes = _sections(records, meta, peer_out, warnings_out, gpu)
    md_path = report.write_markdown(report.results_path(out_dir, "allreduce", host, ".md"),
                                    f"All-reduce latency on {host}" if gpu else
                                    f"All-reduce protocol on {host}", env, sections, notes)
    return json_path, md_path


def main(argv=None) -> int:
    args = parse_args(argv)
    launched = sifar_jax.distributed.initialize()  # under sifar_jax.launch: one process per GPU
    # Before anything starts NCCL (lax.psum's too): no NVLink multicast, ever.
    os.environ.update(common.MULTICAST_OFF)
    n_gpus = common.visible_gpu_count()
    if launched and peers.parse(args.peers):
        print("NOTE: one process per GPU: the peers are skipped", flush=True)
        args.peers = "none"
    peer_out = run_peers(args, n_gpus)
    kind, devices = common.bench_devices()
    if (kind == "gpu") != (n_gpus >= 2):
        print(f"NOTE: {n_gpus} GPUs visible to the driver but JAX runs on {kind}: the peers "
              f"and ours ran on different hardware", file=sys.stderr)
    records, meta, warnings_out = run(args, kind, devices)
    records += peer_out["records"]
    if jax.process_index() != 0:
        return 1 if warnings_out else 0  # process 0 reports for all
    env = report.describe_environment(meta["devices"])
    if jax.process_count() > 1:
        env["host"] += f"-{jax.process_count()}proc"
    env.update({k: v for k, v in peer_out["info"].items() if k in ("torch", "nccl")})
    env["peers_info"] = peer_out["info"]
    if kind == "gpu":
        print_tables(records, comparison(records), meta["sizes"], env["host"])
    else:
        print(f"\n[{env['host']}] What ran: {CPU_NOTE}")
        print(report.plain_table(*protocol_rows(meta)))
        print("retries: speculative reads that found a stale word and read it again (SiFAR's "
              "design, not a fault); timeouts are failures.\n")
    out_dir = args.out if args.out else report.default_out(kind)
    for path in write_outputs(out_dir, args, records, meta, env, warnings_out, peer_out):
        print(f"wrote {path}")
    if args.write_auto_table:  # for the platform and the device kind this run had
        devices = (env["device_kind"],) if env.get("device_kind") else ()
        try:
            table = sifar_jax.autotable.from_records(
                records, "cuda" if kind == "gpu" else "cpu", device_kinds=devices,
                source=f"bench.allreduce on {env['host']}, {env['date']} "
                       f"({sifar_jax.autotable.LEVEL} level)")
        except ValueError as e:
            print(f"auto table not written: {e} (run with --levels including jit)", file=sys.stderr)
            return 1
        print(f"wrote {sifar_jax.autotable.write(table, args.write_auto_table)} (auto table)")
    for e in peer_out["errors"]:
        print(f"peer {e.get('algorithm')} tp={e.get('tp')}: {e['error']}", file=sys.stderr)
    if warnings_out:
        print("\n".join(warnings_out), file=sys.stderr)
        return 1
    return 0
