"""The all-reduce benchmark on the CPU: the quick run end to end (its JSON, its
default output directory, a clean checkout afterwards), the peers' failure
handling, the reference check every peer must pass, the per-call trace
summary, and sifar-against-peers comparison and target verdict.

The torch peer's own code path runs here only where torch is installed (CPU
mode over gloo); its GPU path runs on the GPU host (bench/gpu_host_run.sh).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import sifar_jax
from bench import calltrace, common, peers, report

REPO = common.REPO_ROOT
RECORD_KEYS = {"algorithm", "level", "tp", "bytes", "us_median", "us_median_raw", "us_noise",
               "us_p10", "us_p90"}
TAIL_KEYS = {"us_p50", "us_p90", "us_p99", "us_p99_9"}


def _git(*args) -> str | None:
    if shutil.which("git") is None:
        return None
    r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else None


def synthetic_trace(latency_us, retried, ranks: int = 2) -> np.ndarray:
    """Records shaped like sifar_jax.stats.call_trace's: calls dealt round-robin
    to `ranks`, back to back from t = 1 s."""
    lat_ns = np.round(np.asarray(latency_us, dtype=np.float64) * 1e3).astype(np.int64)
    retried = np.asarray(retried)
    dtype = [("group", "i4"), ("rank", "i4"), ("epoch", "u8"), ("algorithm", "i4"),
             ("start_ns", "u8"), ("end_ns", "u8"), ("retried", retried.dtype)]
    rec = np.zeros(lat_ns.size, dtype=dtype)
    rec["rank"] = np.arange(lat_ns.size) % ranks
    rec["epoch"] = np.arange(lat_ns.size) // ranks
    rec["algorithm"] = sifar_jax.algorithms.IDS["sifar"]
    start = 1_000_000_000 + np.concatenate([[0], np.cumsum(lat_ns)[:-1]])
    rec["start_ns"] = start
    rec["end_ns"] = start + lat_ns
    rec["retried"] = retried
    return rec


# ------------------------------------------------------------- the quick run --
def test_quick_run_json_and_clean_checkout(tmp_path, timing_figures):
    status_before = _git("status", "--porcelain", "--untracked-files=all")
    cmd = [sys.executable, "-m", "bench.allreduce", "--quick", "--sizes", "4,8",
           "--skew-us", "0,5", "--out", str(tmp_path)]
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert time.monotonic() - t0 < 120

    (json_path,) = tmp_path.glob("allreduce-cpu-*core.json")
    data = json.loads(json_path.read_text())
    assert data["schema"] == "sifar-jax/bench.allreduce/3"
    for key in ("host", "date", "jax", "jaxlib", "multicast_env"):
        assert data["env"].get(key), key
    for rec in data["records"]:
        assert RECORD_KEYS <= rec.keys(), rec
        assert rec["us_p10"] <= rec["us_median_raw"] <= rec["us_p90"], rec
        assert rec["us_median"] in (None, rec["us_median_raw"]), rec
    have = {(r["algorithm"], r["level"], r["bytes"]) for r in data["records"]}
    for b in (4096, 8192):
        assert ("sifar", "kernel", b) in have and ("sifar", "jit", b) in have
        assert ("lax.psum", "jit", b) in have
        assert ("sifar", "jit_device", b) in have
    # Every peer shows up: measured, or with the reason it was not.
    failed = {e["algorithm"] for e in data["errors"] if "algorithm" in e}
    measured = {r["algorithm"] for r in data["records"]}
    for name in peers.ALL:
        assert name in measured or name in failed, name
    assert peers.XLA_ONE_SHOT in measured, data["errors"]  # its child runs on CPU too
    for e in data["errors"]:
        assert e["error"], e
    # The comparison: sifar (jit) against lax.psum and xla.one_shot at each size.
    comp = {(c["peer"], c["bytes"]): c for c in data["comparison"]}
    for b in (4096, 8192):
        for peer in ("lax.psum", peers.XLA_ONE_SHOT):
            c = comp[(peer, b)]
            if c["peer_us"] is None or c["sifar_us"] is None:  # a median within its noise
                assert c["ratio"] is None, c
            else:
                assert c["ratio"] == pytest.approx(c["peer_us"] / c["sifar_us"], rel=1e-2)
    # The demo's point on a CPU: every algorithm ran (sifar_jax.stats()) and gave lax.psum's bits.
    checked = {(c["algorithm"], c["level"], c["bytes"]) for c in data["checks"]}
    assert checked == {(a, lv, b) for a in sifar_jax.algorithms.PORTABLE for lv in ("kernel", "jit")
                       for b in (4096, 8192)}
    assert all(c["identical"] and c["within_rounding"] for c in data["checks"]), data["checks"]
    assert all(data["stats"]["2"][a]["calls"] > 0 for a in sifar_jax.algorithms.PORTABLE)
    entries = data["trace"]["records"]
    assert {(t["bytes"], t["skew_us"]) for t in entries} == {
        (b, s) for b in (4096, 8192) for s in (0.0, 5.0)}
    for t in entries:
        assert "error" not in t, t
        assert TAIL_KEYS <= t.keys() and t["calls"] > 0, t
    md = json_path.with_suffix(".md").read_text()
    assert "What ran" in md and "bit-identical in all 4 checks" in md
    # no GPU verdicts from CPU timings: no speed-up rows, no peer ratios, no target, and no
    # timing figure at all (the JSON keeps the raw numbers, flagged)
    assert "latency saved" not in md and "against every peer" not in md and "Target" not in md
    assert timing_figures(md) == [] and timing_figures(r.stdout) == [], r.stdout[-3000:]
    assert timing_figures(r.stderr) == [], r.stderr[-3000:]
    assert data[report.CPU_FLAG] is True and "Mis-speculation per call" in md
    assert "docs/performance.md" in r.stdout and "latency saved" not in r.stdout
    assert re.search(r"2\s+sifar\s+[1-9]\d*\s+\d+\s+0\s+bit-identical in all 4 checks", r.stdout)
    # The GPU report of the same records (its code runs nowhere else before a GPU host).
    from bench.allreduce import cli

    meta = {"kind": "gpu", "cfg": data["settings"], "sizes": [4096, 8192], "checks": data["checks"],
            "stats": {2: data["stats"]["2"]}, "trace": data["trace"]}
    args = cli.parse_args(["--peers", "none"])
    cli.write_outputs(tmp_path / "gpu", args, data["records"], meta, {"host": "test-gpu"},
                            [], {"errors": data["errors"]})
    md = (tmp_path / "gpu" / "allreduce-test-gpu.md").read_text()
    assert "sifar against every peer, TP=2" in md and "sifar: latency saved vs lax.psum" in md
    assert "(XLA:CPU timings)" not in md and "What ran" in md

    assert _git("status", "--porcelain", "--untracked-files=all") == status_before


def test_gpu_host_suite_script_runs_its_steps_on_the_cpu(tmp_path):
    """bench/gpu_host_run.sh --quick with the decode and one-process-per-device steps:
    every step starts, none fails, each writes where the suite says (a broken step would
    otherwise show only on a GPU host, in its scarce time)."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    r = subprocess.run(["bash", "bench/gpu_host_run.sh", "--quick", "decode", "mp"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    log = (tmp_path / "run.log").read_text()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for step in ("bench.decode (", "bench.allreduce, 2 processes", "bench.decode, 2 processes"):
        assert step in log, step
    assert "exit code" not in log and "TIMED OUT" not in log and "SKIPPED" not in log, log[-3000:]
    for pattern in ("decode/decode-*.json", "mp/allreduce-*-2proc.json", "mp/decode-*-2proc.json"):
        assert list(tmp_path.glob(pattern)), pattern
    sweep = json.loads(next(tmp_path.glob("decode/decode-*core.json")).read_text())
    assert {(r["batch"], r["context"]) for r in sweep} == {(b, c) for b in (1, 2) for c in (256, 512)}
    assert all(r["batch"] == 1 for r in sweep if r["fused"])  # fused: the loops' point only
    baseline_rows = [r for r in sweep if r["allreduce"] in ("sifar:oneshot", "sifar:twoshot")]
    assert baseline_rows and all(r["batch"] == 1 for r in baseline_rows)  # so are the baselines


def test_gpu_host_suite_steptp_runs_the_persistent_rows_on_the_cpu(tmp_path):
    """bench/gpu_host_run.sh --quick steptp steptp-rows: the multi-GPU evaluation's command on
    host devices (llama_step_tiny at TP=2, the op's CPU reference): FP8 and bf16 rows, the
    persistent step with sifar and oneshot inside beside psum / sifar (/ sifar+fused where the
    library has it), each row the step it says."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    r = subprocess.run(["bash", "bench/gpu_host_run.sh", "--quick", "steptp", "steptp-rows"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    log = (tmp_path / "run.log").read_text()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "exit code" not in log and "TIMED OUT" not in log and "SKIPPED" not in log, log[-3000:]
    for name, stem, weights in (("steptp", "decode-fp8", "fp8"),
                                ("steptp-rows", "decode-rows", "bfloat16")):
        (path,) = (tmp_path / name).glob(f"{stem}-*.json")
        recs = json.loads(path.read_text())
        by = {rec["allreduce"]: rec for rec in recs}
        assert {"psum", "sifar", "persistent", "persistent:oneshot"} <= set(by), set(by)
        assert {rec["tp"] for rec in recs} == {2} and all(rec["weights"] == weights for rec in recs)
        assert by["persistent"]["step"] == by["persistent:oneshot"]["step"] == "persistent"
        assert by["psum"]["step"] == by["sifar"]["step"] == "xla"
        assert by["persistent:oneshot"]["step_allreduce"] == "oneshot"


def test_cpu_results_default_to_an_ignored_directory():
    assert report.default_out("gpu") == REPO / "bench" / "results"
    local = report.default_out("cpu")
    assert local != report.default_out("gpu")
    if _git("rev-parse", "--git-dir") is None:
        pytest.skip("not a git checkout")
    path = (local / "allreduce-cpu-2core.json").relative_to(REPO)
    assert _git("check-ignore", "-q", str(path)) is not None, f"{path} is not git-ignored"


def test_multicast_switches_match_the_library_guard():
    assert common.MULTICAST_OFF == sifar_jax.multicast.DISABLING
    env = common.child_env(FOO="1")
    assert env["FOO"] == "1"
    assert all(env[k] == v for k, v in sifar_jax.multicast.DISABLING.items())
    assert sifar_jax.multicast.refusal(dict(env, **{sifar_jax.multicast.ENABLE_VAR: "1"}))


# ----------------------------------------------------------- peer processes --
def _child(code: str) -> list[str]:
    """A stand-in peer: `code` runs with sys.argv[2] = the JSON path run_child adds."""
    return [sys.executable, "-c", code]


def test_failing_peer_is_recorded_with_its_message():
    out = peers.run_child(_child("import sys; print('boom: no such op'); sys.exit(3)"),
                          common.child_env(), 30, "torch.nccl", 2, log=lambda s: None)
    assert out["records"] == []
    (err,) = out["errors"]
    assert err["algorithm"] == "torch.nccl" and err["tp"] == 2
    assert "exit code 3" in err["error"] and "boom: no such op" in err["error"]


def test_peer_that_hangs_is_killed_and_keeps_what_it_wrote():
    code = ("import json, sys, time\n"
            "json.dump({'records': [{'algorithm': 'torch.nccl', 'bytes': 4096}], 'errors': []},"
            " open(sys.argv[2], 'w'))\n"
            "time.sleep(60)\n")
    t0 = time.monotonic()
    out = peers.run_child(_child(code), common.child_env(), 3, "torch.nccl", 2,
                          log=lambda s: None)
    assert time.monotonic() - t0 < 30
    assert out["records"] == [{"algorithm": "torch.nccl", "bytes": 4096}]
    assert "timed out after 3 s" in out["errors"][-1]["error"]


def test_peer_children_run_with_multicast_off(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # as if this host had it on: child_env must win
    code = ("import json, os, sys\n"
            f"keys = {sorted(common.MULTICAST_OFF)!r}\n"
            "json.dump({'info': {k: os.environ.get(k) for k in keys}}, open(sys.argv[2], 'w'))\n")
    out = peers.run_child(_child(code), common.child_env(), 30, "x", None, log=lambda s: None)
    assert out["info"] == common.MULTICAST_OFF
    assert out["errors"] == []


def test_torch_peer_refuses_to_start_with_multicast_on(tmp_path, monkeypatch):
    from bench.peers import torch_allreduce

    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    with pytest.raises(SystemExit, match="multicast must be off"):
        torch_allreduce.refuse_multicast()


def test_torch_peer_code_path_on_cpu(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "peer.json"
    cmd = [sys.executable, "-m", "bench.peers.torch_allreduce", "--algorithm", "torch.nccl",
           "--tp", "2", "--sizes", "4096,8192", "--chain", "2,6", "--runs", "3", "--warmup", "1",
           "--device", "cpu", "--json", str(path)]
    env = common.child_env(GLOO_SOCKET_IFNAME="lo")
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads(path.read_text())
    assert data["errors"] == []
    assert [rec["bytes"] for rec in data["records"]] == [4096, 8192]
    for rec in data["records"]:
        assert RECORD_KEYS <= rec.keys() and rec["level"] == peers.LEVEL_EAGER


# ------------------------------------------------------------ the reference --
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_allreduce_mismatch_accepts_any_bf16_summation_order(ranks):
    import ml_dtypes

    x = common.random_payload(ranks, ranks, 4096)
    assert np.all(np.abs(x) >= 0.5)
    assert np.array_equal(x, x.astype(ml_dtypes.bfloat16).astype(np.float32))
    # Summed in bf16, rounding after every add, in a different order on each rank.
    got = np.empty_like(x)
    for r in range(ranks):
        acc = np.zeros(x.shape[1], dtype=ml_dtypes.bfloat16)
        for i in range(ranks):
            acc = (acc.astype(np.float32) + x[(r + i) % ranks]).astype(ml_dtypes.bfloat16)
        got[r] = acc.astype(np.float32)
    assert common.allreduce_mismatch(got, x) is None


def test_allreduce_mismatch_rejects_a_missing_partial_and_nan():
    x = common.random_payload(1, 2, 1024)
    right = np.broadcast_to(x.sum(0), x.shape).copy()
    assert common.allreduce_mismatch(right, x) is None
    stale = right.copy()
    stale[1, 100] -= x[1, 100]  # one element missed rank 1's partial
    msg = common.allreduce_mismatch(stale, x)
    assert msg is not None and "1 of 2048" in msg and "rank 1 element 100" in msg
    nan = right.copy()
    nan[0, 5] = np.nan
    assert common.allreduce_mismatch(nan, x) is not None


# --------------------------------------------------------------- the trace --
def test_trace_summary_counts_retries_and_tails():
    lat = [2.0] * 7 + [5.0, 6.0, 7.0]
    retried = np.array([0] * 7 + [1, 3, 2], dtype=np.uint32)
    s = calltrace.summarize(synthetic_trace(lat, retried))
    assert s["calls"] == 10 and s["ranks"] == 2 and s["invalid_records"] == 0
    assert s["retried_share"] == pytest.approx(0.3)
    assert s["us_median_clean"] == pytest.approx(2.0)
    assert s["us_median_retried"] == pytest.approx(6.0)
    assert s["us_mean"] == pytest.approx(3.2)
    assert s["cost_share"] == pytest.approx(1 - 2.0 / 3.2, abs=1e-4)
    assert s["retries_per_call_trace"] == pytest.approx(0.6)
    assert s["us_p50"] == pytest.approx(2.0) and s["us_p99_9"] == pytest.approx(6.991, abs=1e-3)
    # A flag instead of a count, and an unwritten record (start 0) left out.
    rec = synthetic_trace(lat, np.array([False] * 7 + [True] * 3))
    rec["start_ns"][0] = 0
    s = calltrace.summarize(rec)
    assert s["calls"] == 9 and s["invalid_records"] == 1
    assert s["retried_share"] == pytest.approx(3 / 9, abs=1e-4)
    assert "retries_per_call_trace" not in s


def test_chain_seconds_per_call_uses_only_the_device_clock():
    """Two runs of 5 calls per rank; rank 1 starts each run 40 us late (a process that
    dispatched later): its first call is slow, the per-call time after it is not."""
    lat = np.array([[40.0, 2, 2, 2, 2, 3, 3, 3, 3, 3],   # rank 0: the first call waits
                    [1.0, 2, 2, 2, 2, 1, 3, 3, 3, 3]])   # rank 1
    rec = np.concatenate([synthetic_trace(lat[r], np.zeros(10, np.uint32), ranks=1)
                          for r in (0, 1)])
    rec["rank"][10:] = 1
    got = calltrace.chain_seconds_per_call(rec, 5)
    assert len(got) == 4  # 2 ranks x 2 runs
    np.testing.assert_allclose(sorted(np.array(got) * 1e6), [2.0, 2.0, 3.0, 3.0])


def test_multiprocess_decode_quick_run(tmp_path):
    """bench.decode under the launcher (2 processes on XLA:CPU): process 0 reports TP=2, sifar
    gives lax.psum's tokens, the per-call trace is taken."""
    cmd = [sys.executable, "-m", "sifar_jax.launch", "-n", "2", "--", sys.executable, "-m",
           "bench.decode", "--quick", "--batch", "1", "--context", "256",
           "--loops", "pipelined", "--no-sweep", "--allreduce", "psum,sifar", "--fused", "off",
           "--baselines", "none",
           "--out", str(tmp_path)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (json_path,) = tmp_path.glob("decode-cpu-*-2proc.json")
    recs = json.loads(json_path.read_text())
    by = {rec["allreduce"]: rec for rec in recs}
    assert set(by) == {"psum", "sifar"} and {rec["tp"] for rec in recs} == {2}
    assert by["sifar"]["generated"] == by["psum"]["generated"]
    assert by["sifar"]["sifar_check"] == "ok" and by["sifar"]["algorithm_used"]
    assert by["sifar"]["allreduce_trace"]["calls"] > 0, by["sifar"]["allreduce_trace"]


def test_trace_case_runs_the_chain_inside_the_trace(cpu_mesh):
    from bench.allreduce import measure

    mesh = cpu_mesh(2)
    cfg = {"chain": (2, 6), "trace_runs": 3}
    for skew in (0.0, 3.0):
        entry, lat = measure.trace_case(sifar_jax.call_trace, mesh, {}, cfg, 2, "sifar", 4096,
                                          skew)
        assert "error" not in entry, entry
        assert entry["calls"] == 2 * 6 * 3 and entry["invalid_records"] == 0  # ranks x chain x runs
        assert entry["ranks"] == 2 and entry["skew_us"] == skew
        assert 0 <= entry["retried_share"] <= 1 and entry["retries_per_call"] is not None
        assert TAIL_KEYS <= entry.keys() and lat.size == entry["calls"] and np.all(lat > 0)
        assert entry["us_p50"] <= entry["us_p90"] <= entry["us_p99"] <= entry["us_p99_9"]
    assert sifar_jax.comm._settings["skew"][0] == 0  # the forced skew was undone


def test_trace_is_taken_in_blocks_that_fit_the_ring(cpu_mesh):
    """A ring of 10 calls per rank and runs of 6 calls: one run per block, and
    every call of every run is in the records, each epoch once per rank."""
    from bench.allreduce import measure

    mesh = cpu_mesh(2)
    fn = measure.chain_fn(mesh, "sifar", 6)
    x = measure.random_bf16(0, 2, 2048)
    rec = calltrace.collect(sifar_jax.call_trace, "tp", fn, (x,), 4, 6, ring_calls=10)
    assert rec.size == 2 * 6 * 4
    for r in (0, 1):
        epochs = rec["epoch"][rec["rank"] == r]
        assert np.unique(epochs).size == epochs.size == 24


def test_trace_case_records_a_failing_trace(cpu_mesh):
    from bench.allreduce import measure

    def broken(axis_name):
        raise RuntimeError("no trace buffer")

    entry, lat = measure.trace_case(broken, cpu_mesh(2), {}, {"chain": (2, 4), "trace_runs": 1},
                                      2, "sifar", 4096, 0.0)
    assert lat is None and "no trace buffer" in entry["error"]


# -------------------------------------------------------- the comparison --
def _rec(alg, level, b, us):
    return {"algorithm": alg, "level": level, "tp": 2, "bytes": b, "us_median": us,
            "us_p10": us, "us_p90": us}


def test_comparison_ratios_and_the_peer_verdict():
    from bench.allreduce import tables as allreduce

    recs = [_rec("sifar", "jit", 8192, 3.0), _rec("sifar", "kernel", 8192, 1.7),
            _rec("oneshot", "jit", 8192, 6.0), _rec("lax.psum", "jit", 8192, 13.5),
            _rec(peers.TORCH_ONE_SHOT, peers.LEVEL_CUDA_GRAPH, 8192, 6.0)]
    comp = allreduce.comparison(recs)
    assert {c["peer"] for c in comp} == {"lax.psum", peers.TORCH_ONE_SHOT}  # not our own
    assert {c["peer"]: c["ratio"] for c in comp} == {"lax.psum": 4.5, peers.TORCH_ONE_SHOT: 2.0}
    slow = recs + [_rec(peers.XLA_ONE_SHOT, "jit", 8192, 2.5)]
    (_, _, rows) = allreduce.peer_tables(slow, allreduce.comparison(slow), [8192])[0]
    assert rows[-1][2] == f"**no**, 0.83x vs {peers.XLA_ONE_SHOT}"
    (tp, headers, rows) = allreduce.peer_tables(recs, comp, [8192])[0]
    assert rows[0][:2] == ["sifar", "jit"] and rows[-1][2].startswith("yes, 2.00x")
    # A peer not resolved above its noise is named, never counted as beaten.
    noisy = recs + [_rec(peers.TORCH_NCCL, "jit", 8192, None)]
    (_, _, rows) = allreduce.peer_tables(noisy, allreduce.comparison(noisy), [8192])[0]
    assert rows[-1][2].startswith("yes vs the resolved peers (2.00x")
    assert rows[-1][2].endswith(f"not resolved vs {peers.TORCH_NCCL}")


# ------------------------------------------------- latencies within their noise --
def _us(values):
    return [v * 1e-6 for v in values]


def test_a_latency_is_reported_only_above_its_noise():
    """A difference of two noisy timings (issue 26: '-1.08 us') is never a figure: a negative
    median, a positive one within its noise bound, or too few samples give None; a median
    well above the samples' spread is kept as it is."""
    negative = common.summarize_us(_us([-3.0, -1.0, 0.5, -2.0, 1.0, -1.08, 2.0, -4.0, 0.0, -1.0]))
    assert negative["us_median"] is None and negative["us_median_raw"] < 0
    assert negative["us_noise"] > 0 and negative["samples"] == 10
    # Positive, but the spread (IQR 8 us over 9 samples: bound ~5 us) swamps a 1 us median.
    within = common.summarize_us(_us([-5.0, -3.0, -3.0, 0.0, 1.0, 2.0, 5.0, 5.0, 6.0]))
    assert within["us_median_raw"] == pytest.approx(1.0) and within["us_noise"] > 1.0
    assert within["us_median"] is None
    assert common.summarize_us(_us([3.0, 3.1]))["us_median"] is None  # too few to bound
    clear = common.summarize_us(_us([3.1, 3.2, 3.0, 3.3, 3.1, 3.2, 3.15]))
    assert clear["us_median"] == pytest.approx(3.15) and clear["us_noise"] < 0.2
    # The bound: NOISE_SE standard errors of the median, from the interquartile range.
    iqr = common.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 75) - common.percentile(
        [1.0, 2.0, 3.0, 4.0, 5.0], 25)
    assert common.noise_bound_us([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(
        common.NOISE_SE * 1.2533 * iqr / 1.349 / np.sqrt(5))
    assert common.resolved_us(-1.08, 0.5) is None and common.resolved_us(0.4, 0.5) is None
    assert common.resolved_us(2.0, 0.5) == 2.0 and common.resolved_us(2.0, None) is None


def test_an_unresolved_latency_is_printed_as_words_not_a_number(capsys):
    """bench.allreduce's tables, its comparison with the peers and its terminal output say
    'not resolved' where a median lies within its noise: no '-1.08' anywhere."""
    from bench.allreduce import tables as allreduce

    noisy = {"algorithm": "sifar_flag", "level": "jit", "tp": 2, "bytes": 8192,
             **common.summarize_us(_us([-3.0, -1.0, 0.5, -2.0, 1.0, -1.08, 2.0, -4.0, 0.0, -1.0]))}
    psum = {"algorithm": "lax.psum", "level": "jit", "tp": 2, "bytes": 8192,
            **common.summarize_us(_us([9.0, 10.0, 11.0, 10.5, 9.5, 10.2, 9.8]))}
    sifar = dict(noisy, algorithm="sifar")
    records = [noisy, sifar, psum]
    (_, _, headers, rows), = allreduce.tables(records, [8192], with_spread=True)
    cells = {r[0]: r[1] for r in rows}
    assert cells["sifar_flag"] == cells["sifar"] == "not resolved"
    assert cells["lax.psum"].startswith("10.00")
    comp = allreduce.comparison(records)
    assert comp == [{"tp": 2, "bytes": 8192, "peer": "lax.psum", "peer_level": "jit",
                     "peer_us": 10.0, "sifar_us": None, "ratio": None}]
    allreduce.print_tables(records, comp, [8192], "test-host")
    out = capsys.readouterr().out
    assert "not resolved" in out and "-1.08" not in out and "-1.0" not in out
    assert common.fmt_latency(noisy, " us") == "not resolved"
    assert common.fmt_latency(psum, " us") == "10.00 us"


def test_allreduce_default_sizes_hold_the_decoders_payloads_and_sweep_spans_1k_to_64m():
    """The MoE model's all-reduce (2048 x bf16 = 4 KB per token) and Llama-3.1-8B's (8 KB)
    are default sizes; --sizes sweep runs 1 KB to 64 MB in powers of two (issue 26)."""
    from bench.allreduce import settings as allreduce_settings

    default = allreduce_settings.payload_bytes({"sizes_kb": allreduce_settings.parse_sizes(
        allreduce_settings.parse_args([]).sizes)})
    assert 2048 * 2 in default and 4096 * 2 in default
    sweep = allreduce_settings.payload_bytes({"sizes_kb": allreduce_settings.parse_sizes("sweep")})
    assert sweep[0] == 1024 and sweep[-1] == 64 << 20
    assert all(b == 2 * a for a, b in zip(sweep, sweep[1:]))
    assert allreduce_settings.parse_sizes("4,8.5") == [4.0, 8.5]
    with pytest.raises(SystemExit, match="sizes"):
        allreduce_settings.parse_sizes("big")


# ------------------------------------------- decode: baseline, floor, breakdown --
def test_decode_baseline_rows_come_by_default_and_only_at_the_loops_point():
    from bench.decode import settings as st

    s = st.settings(st.parse_args(["--quick"]), "cpu", 8)
    labels = [v.label for v in s.variants]
    assert labels[:3] == ["psum", "sifar:oneshot", "sifar:twoshot"]
    assert [v.options.algorithm for v in s.variants[:3]] == ["auto", "oneshot", "twoshot"]
    assert s.baselines == ("sifar:oneshot", "sifar:twoshot")
    loops_point = (1, s.context[0])
    for tp, b, c, v, _ in st.cases(s):
        if v.label in s.baselines:
            assert tp == 2 and (b, c) == loops_point
    swept = st.settings(st.parse_args(["--quick", "--sweep-all-variants"]), "cpu", 8)
    assert {(b, c) for tp, b, c, v, _ in st.cases(swept) if v.label == "sifar:oneshot"} == {
        (b, c) for b in swept.batch for c in swept.context}
    none = st.settings(st.parse_args(["--quick", "--baselines", "none"]), "cpu", 8)
    assert none.baselines == () and "sifar:oneshot" not in [v.label for v in none.variants]


def test_decode_settings_are_one_frozen_value_and_the_variants_decode_options():
    """The flags are read once into a frozen Settings; each variant is a label and the
    DecodeOptions it runs, the run's --kv-layout / --gemm-rows / --attn-impl in every one."""
    import dataclasses

    from bench.decode import settings as st
    from models import DecodeOptions

    s = st.settings(st.parse_args(["--quick", "--kv-layout", "bhsd", "--gemm-rows", "2"]), "cpu", 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.tokens = 3
    fused = next(v for v in s.variants if v.label == "sifar+fused")
    assert fused.options == DecodeOptions(allreduce="sifar", fused=True, kv_layout="bhsd",
                                          gemm_rows=2, step="xla")
    assert all(v.options.kv_layout == "bhsd" and v.options.gemm_rows == 2
               and v.options.step == "xla" for v in s.variants)  # the XLA decoders' rows
    both = st.cases(dataclasses.replace(s, step="both", tp=(2, 1)))
    persistent = {(tp, b, v.label): v.options for tp, b, c, v, _ in both
                  if v.options.step == "persistent"}
    assert set(persistent) == {(1, 1, "persistent"), (2, 1, "persistent"),
                               (2, 1, "persistent:oneshot")}  # batch 1, every TP
    assert persistent[(2, 1, "persistent")].step_allreduce == "sifar"
    assert persistent[(2, 1, "persistent:oneshot")].step_allreduce == "oneshot"
    assert {v.label for *_, v, _ in both} >= {"psum", "sifar", "sifar+fused"}
    only = st.settings(st.parse_args(["--quick", "--step", "persistent", "--step-allreduce",
                                      "oneshot"]), "cpu", 8)
    assert {(tp, v.label) for tp, b, c, v, _ in st.cases(only)} == {
        (2, "persistent:oneshot"), (1, "persistent")}
    with pytest.raises(SystemExit, match="--step-allreduce"):
        st.settings(st.parse_args(["--quick", "--step-allreduce", "twoshot"]), "cpu", 8)


def test_decode_quantize_is_the_fp8_flag_and_weights_its_deprecated_alias(capsys):
    from bench.decode import settings as st

    fp8 = st.settings(st.parse_args(["--quick", "--quantize", "fp8"]), "cpu", 8)
    assert (fp8.quantize, fp8.to_rows, fp8.weights, fp8.stem) == ("fp8", False, "fp8",
                                                                  "decode-fp8")
    old = st.parse_args(["--quick", "--weights", "fp8"])
    assert old.quantize == "fp8" and "--quantize fp8" in capsys.readouterr().err
    rows = st.settings(st.parse_args(["--quick", "--weights", "rows"]), "cpu", 8)
    assert (rows.quantize, rows.to_rows, rows.stem) == (None, True, "decode-rows")
    assert st.settings(st.parse_args(["--quick", "--to-rows"]), "cpu", 8).to_rows
    help_text = subprocess.run([sys.executable, "-m", "bench.decode", "--help"], cwd=REPO,
                               env=dict(os.environ, COLUMNS="200"), capture_output=True,
                               text=True, timeout=120).stdout
    assert "--quantize {fp8}" in help_text and "--weights fp8 = --quantize fp8" in help_text
    with pytest.raises(SystemExit, match="rows already"):
        st.settings(st.parse_args(["--quick", "--quantize", "fp8", "--to-rows"]), "cpu", 8)
    with pytest.raises(SystemExit, match="dense weights only"):
        st.settings(st.parse_args(["--quick", "--quantize", "fp8", "--ttft"]), "cpu", 8)


def test_decode_names_a_model_this_tp_size_cannot_quantize_without_a_traceback():
    from bench import decode as bd

    with pytest.raises(SystemExit, match=r"bench.decode: TP=4: FP8 weights: 'down' has 8 "
                                         r"contracted columns"):
        bd.main(["--preset", "qwen3_moe_tiny", "--tp", "4", "--quantize", "fp8", "--quick",
                 "--out", "/tmp/sifar-test-decode-fp8-tp4"])


def test_decode_runs_the_fused_rows_at_tp1_only_when_asked():
    """At TP=1 only lax.psum by default; with --fused on also the fused call (one rank: a
    residual add + RMSNorm kernel in place of XLA's fusions), at the loops' point."""
    from bench.decode import settings as st

    def tp1(argv):
        s = st.settings(st.parse_args(["--quick", "--tp", "1", *argv]), "cpu", 8)
        return {v.label for tp, b, c, v, _ in st.cases(s) if tp == 1}

    assert tp1([]) == {"psum"}
    assert tp1(["--fused", "on"]) == {"psum", "sifar+fused"}


def test_decode_counts_a_copy_of_one_layer_of_the_cache():
    """bench.decode's cache_copies counts a fresh array of one layer's keys, not only of the
    whole cache array (a per-layer copy was invisible to a check of the whole array's shape)."""
    import types

    import jax
    import jax.numpy as jnp

    from bench.decode import records
    from models.decoder import hlo

    cache = jnp.ones((2, 2, 1, 16, 4, 8), jnp.float32)  # [layers, 2, B, S, kv heads, D]
    exe = jax.jit(lambda c: (c, c[1, 0] * 2.0),
                  donate_argnums=0).lower(cache).compile()
    whole = hlo.cache_shapes(cache)[0]
    assert hlo.cache_copies(exe.as_text(), whole) == {}  # the whole array: aliased, not copied
    dec = types.SimpleNamespace(compiled_step=lambda: exe, state={"cache": cache})
    assert records.cache_copies(dec, "pipelined", None).get("entry", 0) >= 1


# ------------------------------------------------ the CPU rule: no timing figure --
def test_the_timing_figure_check_finds_what_cpu_runs_printed_before(timing_figures):
    """What bench.decode --quick printed on a CPU before (issue 60): each is caught."""
    for text in ("TP=2 batch 1 context 256 psum: pipelined -0.016 ms, sync 1.2 ms (set-up 0.3 s)",
                 "| 2 | pipelined | psum | -125515.8 tokens/s |", "sifar 1.234x", "gain +4.5%",
                 "TP  loop  TPOT median ms\n--  ----  --------------\n2   sync  0.100",
                 "| TP | TTFT ms |\n| --- | --- |\n| 2 | 1.0 |", "xla.one_shot: 12.30 us (jit)"):
        assert timing_figures(text), text
    assert timing_figures("What ran: 544 calls, 272 retries, sync 18/18, 4 KB, 50%") == []


def test_decode_names_the_baseline_and_carries_the_measured_floor(tmp_path, capsys,
                                                                   timing_figures):
    """bench.decode on the CPU: the in-decoder oneshot and twoshot rows run by default, the faster
    is named "baseline" in every record at its point and in the markdown; every record carries
    the copy rate measured in the run (copy_tb_s), floor_ms (weights + KV cache per rank at that
    rate), floor_ratio and overhead_ms; --breakdown is skipped with a note; and nothing printed
    or in the markdown is a timing figure (the JSON keeps them, flagged)."""
    from bench.decode import output, records as rec_mod, settings as st

    from bench import decode as bd

    assert rec_mod.floor_ms(10**9, 0, 2e12) == pytest.approx(0.5)  # bytes at bytes per second

    assert bd.main(["--quick", "--no-sweep", "--loops", "pipelined,sync", "--no-trace",
                    "--breakdown", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "--breakdown: skipped" in out and "docs/performance.md" in out
    md = next(tmp_path.glob("decode-*.md")).read_text()
    assert timing_figures(out) == [] and timing_figures(captured.err) == []
    assert timing_figures(md) == []
    assert re.search(r"sifar:oneshot\s+oneshot\s+[1-9]\d*\s+\d+\s+0\s+ok\s+pipelined 1/1", out)
    records = json.loads(next(tmp_path.glob("decode-*.json")).read_text())
    assert {r["shapes"] for r in records} == {"full"}
    assert {r["weights"] for r in records} == {"float32"}  # dense, the tiny preset's dtype
    assert all(r[report.CPU_FLAG] is True for r in records)
    by = {(r["tp"], r["allreduce"], r["loop"]): r for r in records}
    assert {(2, "sifar:oneshot"), (2, "sifar:twoshot"), (2, "psum"), (1, "psum")} <= {
        k[:2] for k in by}
    rates = {r["copy_tb_s"] for r in records}
    assert len(rates) == 1 and rates.pop() > 0  # one measurement per run
    for r in records:
        rate = r["copy_tb_s"] * 1e12
        want = rec_mod.floor_ms(r["weights_bytes_per_rank"], r["kv_bytes_per_rank"], rate)
        assert r["floor_ms"] == pytest.approx(want, rel=1e-3) and r["floor_ms"] > 0
        assert r["floor_ratio"] == pytest.approx(r["tpot_ms_median"] / r["floor_ms"], rel=1e-2)
        assert r["overhead_ms"] == pytest.approx(r["tpot_ms_median"] - r["floor_ms"], abs=1e-3)
        assert r["step"] == "xla" and r["step_reason"] is None and "breakdown" not in r
    for loop in ("pipelined", "sync"):
        fastest = min(("sifar:oneshot", "sifar:twoshot"),
                      key=lambda a: by[(2, a, loop)]["tpot_ms_median"])
        for r in (r for r in records if r["loop"] == loop):
            if r["tp"] == 2:
                assert r["baseline"] == fastest
                assert r["vs_baseline"] == pytest.approx(
                    by[(2, fastest, loop)]["tpot_ms_median"] / r["tpot_ms_median"], rel=1e-3)
            else:
                assert r["baseline"] is None and r["vs_baseline"] is None  # TP=1: psum alone
        assert by[(2, fastest, loop)]["vs_baseline"] == 1.0
        assert f"{fastest} (baseline)" in md
    import sifar_jax.fused  # the fused row says what its call prefetches into L2

    assert by[(2, "sifar+fused", "sync")]["prefetch_bytes"] == sifar_jax.fused.DEFAULT_PREFETCH_BYTES
    assert by[(2, "sifar", "sync")]["prefetch_bytes"] is None
    assert "--breakdown: skipped" in md and "What ran" in md
    assert "x floor" not in md and "Against the paper" not in md and "Memory floor" not in md
    # The GPU report of the same records (its code runs nowhere else before a GPU host).
    import dataclasses

    s = st.settings(st.parse_args(["--quick", "--no-sweep", "--loops", "pipelined,sync"]), "cpu", 8)
    s = dataclasses.replace(s, platform="gpu", out=str(tmp_path / "gpu"))
    output.write_outputs(s, {"host": "test-gpu"}, records, final=True)
    gpu_md = (tmp_path / "gpu" / "decode-test-gpu.md").read_text()
    assert "Against the paper" in gpu_md and "x floor" in gpu_md and "Memory floor" in gpu_md
    assert "overhead ms" in gpu_md and "measured in this run" in gpu_md
    assert timing_figures(gpu_md)  # the check sees a GPU report's figures
    output.print_summary(records, s)
    assert "memory floor" in capsys.readouterr().out


def test_copy_rate_counts_read_and_write_at_the_median(monkeypatch):
    """bench.common.copy_rate: 2 x the buffer's bytes (read + written) over the median of its
    timed samples, after untimed warm-up calls; it runs on the CPU's small buffer."""
    import jax

    cpu = jax.devices("cpu")[0]
    assert common.copy_rate(cpu, nbytes=1 << 20, samples=3, inner=2) > 0
    assert common.COPY_BYTES["gpu"] >= 4 << 30 and common.COPY_BYTES["cpu"] == 64 << 20
    seconds = iter([0.4, 0.1, 0.2])
    warmed = []
    monkeypatch.setattr(common, "warm_up", lambda fn, args, times: warmed.append(times))
    monkeypatch.setattr(common, "time_calls", lambda fn, args, inner: next(seconds))
    assert common.copy_rate(cpu, nbytes=1000, samples=3) == pytest.approx(2 * 1000 / 0.2)
    assert warmed == [2]


def test_decode_tp2_rank_shapes_run_one_rank_of_tp2_on_one_device(tmp_path):
    """--shapes tp2_rank: half the heads, MLP and vocabulary at TP=1 (one rank of TP=2 as a model
    on one device), and every record says so; run with --quantize fp8, whose records count the
    bytes a step reads of the FP8 params (e4m3 + scales: those of TP=2's rank of the full
    model)."""
    from bench import decode as bd
    from bench.decode import settings as st

    s = st.settings(st.parse_args(["--quick", "--shapes", "tp2_rank"]), "cpu", 8)
    full = st.PRESETS["tiny"]()
    c = s.config
    assert s.tp == (1,) and c.hidden_size == full.hidden_size and c.head_dim == full.head_dim
    assert (c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size) == (
        full.num_heads // 2, full.num_kv_heads // 2, full.intermediate_size // 2,
        full.vocab_size // 2)
    with pytest.raises(SystemExit, match="--tp 1 only"):
        st.settings(st.parse_args(["--quick", "--shapes", "tp2_rank", "--tp", "2"]), "cpu", 8)
    assert bd.main(["--quick", "--shapes", "tp2_rank", "--no-sweep", "--loops", "pipelined",
                    "--no-trace", "--quantize", "fp8", "--out", str(tmp_path)]) == 0
    records = json.loads(next(tmp_path.glob("decode-fp8-*.json")).read_text())
    assert records and {(r["shapes"], r["tp"], r["allreduce"], r["weights"]) for r in records} == {
        ("tp2_rank", 1, "psum", "fp8")}
    assert {r["weight_layout"] for r in records} == {"rows"}  # what the Decoder holds
    import jax

    from models import LLAMA
    from models.weights.transforms import quantize_params

    full = full.replace(max_seq_len=c.max_seq_len)
    layout = LLAMA.layout(full, 2)
    fp8 = jax.eval_shape(lambda p: quantize_params(p, LLAMA), LLAMA.abstract_model(full)[1])
    want = LLAMA.step_weight_bytes(layout, fp8)
    assert records[0]["weights_bytes_per_rank"] == want < LLAMA.step_weight_bytes(layout) / 2


def test_floor_note_names_the_baselines_and_the_measured_rate_or_says_none_ran():
    from bench.decode import output

    none = output.floor_note((), 3.21)
    assert none.endswith("Baseline: none (no in-decoder one-shot or two-shot row ran).")
    assert "3.21 TB/s" in none and "measured in this run" in none and "4.3" not in none
    assert "rows none ran" not in none
    two = output.floor_note(("sifar:oneshot", "sifar:twoshot"), 3.21)
    assert "the in-decoder rows sifar:oneshot or sifar:twoshot at the same TP" in two


def test_decode_step_both_runs_the_persistent_rows_at_every_tp(tmp_path, timing_figures):
    """bench.decode --step both on the small preset the persistent step serves: the
    'persistent' rows beside the XLA decoders' at TP=1 and 2 (TP=2: sifar and oneshot inside),
    on a CPU the op's C++ reference across the host devices; the records say which step ran
    and the all-reduce inside; their tokens are psum's (random cache, sequence 0); the step's
    all-reduce phases ran through sifar_jax (its stats and check). The old --weights fp8
    spelling still runs FP8. Nothing printed is a timing figure."""
    cmd = [sys.executable, "-m", "bench.decode", "--quick", "--preset", "llama_step_tiny",
           "--tp", "2", "1", "--batch", "1", "--context", "256", "--loops", "pipelined",
           "--no-sweep", "--allreduce", "psum", "--fused", "off", "--baselines", "none",
           "--no-trace", "--step", "both", "--weights", "fp8", "--kv-layout", "bhsd",
           "--out", str(tmp_path)]  # one cache layout: the same random cache in every row
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert timing_figures(r.stdout) == [] and "deprecated" in r.stderr
    (json_path,) = tmp_path.glob("decode-fp8-*.json")
    by = {(rec["tp"], rec["allreduce"]): rec for rec in json.loads(json_path.read_text())}
    assert set(by) == {(1, "psum"), (1, "persistent"), (2, "psum"), (2, "persistent"),
                       (2, "persistent:oneshot")}
    for (tp, label), rec in by.items():
        assert rec["weights"] == "fp8"
        assert rec["step"] == ("persistent" if label.startswith("persistent") else "xla")
        assert rec["step_reason"] is None
        assert rec["generated"] == by[(tp, "psum")]["generated"], (tp, label)
    assert by[(2, "persistent")]["step_allreduce"] == "sifar"
    assert by[(2, "persistent:oneshot")]["step_allreduce"] == "oneshot"
    assert by[(1, "persistent")]["step_allreduce"] is None
    for label in ("persistent", "persistent:oneshot"):
        rec = by[(2, label)]
        assert rec["sifar_check"] == "ok" and rec["sifar_stats"][rec["step_allreduce"]]["calls"]


def test_decode_persistent_rows_where_the_step_cannot_serve_say_why(tmp_path, monkeypatch):
    """--step persistent on the tiny preset (float32, head_dim 16), which the step does not
    serve: no row runs and the log says why (the Decoder's ValueError)."""
    import types

    import jax

    from bench.decode import records, settings as st

    s = st.settings(st.parse_args(["--quick", "--tp", "1", "--batch", "1", "--context", "256",
                                   "--loops", "pipelined", "--no-sweep", "--step",
                                   "persistent", "--out", str(tmp_path)]), "cpu", 8)
    lines = []
    bar = types.SimpleNamespace(write=lines.append, set_postfix_str=lambda *a: None,
                                update=lambda *a: None, close=lambda: None)
    monkeypatch.setattr(common, "progress", lambda *a, **k: bar)
    assert records.run(s, jax.devices("cpu"), 1e9, lambda rs: None) == []
    assert any("persistent: not run: step='persistent' cannot run this decoder: dtype=float32"
               in ln for ln in lines), lines


def test_decode_rows_weights_are_labelled_and_read_like_dense(tmp_path):
    """--to-rows: the projections held as [N, K] rows (models.to_rows) for every row of the
    run; the records say so (the layout of the params the Decoder holds), and a step reads the
    dense model's bytes."""
    from bench import decode as bd

    args = ["--quick", "--tp", "1", "--batch", "1", "--context", "256", "--loops", "pipelined",
            "--no-sweep", "--allreduce", "psum", "--fused", "off", "--baselines", "none",
            "--no-trace"]
    assert bd.main(args + ["--to-rows", "--out", str(tmp_path / "rows")]) == 0
    assert bd.main(args + ["--out", str(tmp_path / "dense")]) == 0
    (rows,) = json.loads(next((tmp_path / "rows").glob("decode-rows-*.json")).read_text())
    (dense,) = json.loads(next((tmp_path / "dense").glob("decode-*.json")).read_text())
    assert (rows["weight_layout"], dense["weight_layout"]) == ("rows", "einsum")
    assert rows["weights"] == dense["weights"] == rows["dtype"]
    assert rows["weights_bytes_per_rank"] == dense["weights_bytes_per_rank"]


def test_decode_virtual_ranks_time_the_persistent_step_at_r_ranks(tmp_path, monkeypatch, capsys,
                                                                   timing_figures):
    """--virtual-ranks on a model the persistent step serves (bf16, head_dim 128, FP8), the op's
    CPU reference on a CPU (step="persistent" asks for it by name): R = 1, 2, 4 with sifar and
    oneshot inside, one record each, the cost per all-reduce phase from t_R - t_1 over 2 x
    layers. On a model the step does not serve (the quick run's float32 tiny preset), one record
    says why and no row runs. Nothing printed or in the markdown is a timing figure."""
    import dataclasses

    import jax

    from bench.decode import cli, ranks, records, settings as st

    s = st.settings(st.parse_args(["--quick", "--tp", "1", "--quantize", "fp8", "--context",
                                   "256", "--samples", "1", "--virtual-ranks",
                                   "--out", str(tmp_path)]), "cpu", 8)
    assert s.virtual_ranks == (1, 2, 4)
    cpus = jax.devices("cpu")
    (skipped,) = ranks.run(s, cpus, 1e9)
    assert skipped["step"] == "xla" and "dtype=float32" in skipped["skipped"]
    config = st.PRESETS["tiny"](dtype="bfloat16", hidden_size=256, num_heads=8, num_kv_heads=4,
                                head_dim=128, intermediate_size=512, num_layers=2,
                                vocab_size=512, max_seq_len=256)
    s = dataclasses.replace(s, config=config, dtype="bfloat16")
    calls = []
    real = sifar_jax.llama_step_virtual_ranks
    monkeypatch.setattr(sifar_jax, "llama_step_virtual_ranks",
                        lambda *a, **k: calls.append((k["ranks"], k["allreduce"])) or real(*a, **k))
    json_path, md_path = cli.run_ranks(s, cpus, {"host": "test-cpu"}, True, 1e9)
    recs = json.loads(json_path.read_text())
    want = {(2, "sifar"), (2, "oneshot"), (4, "sifar"), (4, "oneshot")}
    assert {(r["ranks"], r["allreduce"]) for r in recs} == want | {(1, "none")}
    assert set(calls) == want  # the op at R ranks ran each all-reduce (R = 1: llama_step)
    t1 = next(r for r in recs if r["ranks"] == 1)["step_ms_median"]
    for r in recs:
        assert r["step"] == "persistent" and r["weights"] == "fp8" and r[report.CPU_FLAG]
        assert r["phases"] == (0 if r["ranks"] == 1 else 2 * config.num_layers)
        if r["ranks"] > 1:
            # (t_R - t_1) / phases; the medians in the JSON are rounded to 1e-4 ms
            assert r["per_phase_us"] == pytest.approx((r["step_ms_median"] - t1) / 4 * 1e3,
                                                      abs=0.05)
        floor = records.floor_ms(r["weights_bytes_per_rank"], r["kv_bytes_per_rank"], 1e9)
        assert r["floor_ms"] == pytest.approx(floor, rel=1e-3) and r["copy_tb_s"] == 0.001
    md = md_path.read_text()
    assert "persistent" in md and "oneshot" in md
    assert timing_figures(capsys.readouterr().out) == [] and timing_figures(md) == []


def test_gemv_floor_is_the_measured_copy_rate_and_a_cpu_table_has_no_timing(timing_figures):
    from bench import gemv

    rec = gemv.record("sifar fp8_matvec", "fp8", 1, 1, 1e-3, 10**9, 2.0)
    assert (rec["floor_ms"], rec["x_floor"], rec["copy_tb_s"]) == (0.5, 2.0, 2.0)
    torch_row = gemv.record("torch", "fp8", 2, 16, 1e-3, 10**9)  # the child: no rate yet
    assert "floor_ms" not in torch_row and gemv.with_floor(torch_row, 4.0)["x_floor"] == 4.0
    error = {"path": "torch", "tp_shapes": 2, "rows": 16, "error": "no GPU"}
    assert timing_figures(gemv.markdown([rec, error]))  # a GPU table has its figures
    cpu = gemv.markdown([rec, error], gpu=False)
    assert timing_figures(cpu) == [] and "sifar fp8_matvec" in cpu and "error" in cpu
