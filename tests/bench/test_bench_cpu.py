"""The all-reduce benchmark on the CPU: the quick run end to end (its JSON, its
default output directory, a clean checkout afterwards), the peers' failure
handling, the reference check every peer must pass, the per-call trace
summary, and sifar-against-peers comparison and target verdict.

The torch peer's own code path runs here only where torch is installed (CPU
mode over gloo); its GPU path runs on the GPU host (bench/gpu_host_run.sh).
"""

from __future__ import annotations

import importlib.util
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
from bench import calltrace, common, peers

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
def test_quick_run_json_and_clean_checkout(tmp_path):
    status_before = _git("status", "--porcelain", "--untracked-files=all")
    cmd = [sys.executable, "-m", "bench.allreduce", "--quick", "--sizes", "4,8",
           "--skew-us", "0,5", "--out", str(tmp_path)]
    if importlib.util.find_spec("matplotlib") is None:
        cmd.append("--no-plot")
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert time.monotonic() - t0 < 120

    (json_path,) = tmp_path.glob("allreduce-cpu-*core.json")
    data = json.loads(json_path.read_text())
    assert data["schema"] == "sifar-jax/bench.allreduce/2"
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
        if calltrace.find()[0] is not None:
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
    assert data["target"]["verdict"]
    # The trace: skipped with its reason until the library has call_trace.
    if calltrace.find()[0] is None:
        assert data["trace"]["skipped"] == calltrace.MISSING
    else:
        entries = data["trace"]["records"]
        assert {(t["bytes"], t["skew_us"]) for t in entries} == {
            (b, s) for b in (4096, 8192) for s in (0.0, 5.0)}
        for t in entries:
            assert "error" not in t, t
            assert TAIL_KEYS <= t.keys() and t["calls"] > 0, t
    md = json_path.with_suffix(".md").read_text()
    assert "sifar against every peer, TP=2" in md and "Target (issue 14)" in md

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


def test_benchmarks_run_without_matplotlib(tmp_path):
    """matplotlib is a bench extra, not a test one: without it both benchmarks still write
    their JSON and markdown and exit 0 (CI found bench.decode failing at its plot)."""
    hidden = tmp_path / "hide"
    (hidden / "matplotlib").mkdir(parents=True)
    (hidden / "matplotlib" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    # Prepended: a checkout run without an install finds sifar_jax through PYTHONPATH=src.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(hidden), os.environ.get("PYTHONPATH")])))
    for cmd, name in ((["bench.decode", "--quick", "--tp", "2", "--no-sweep", "--loops",
                        "pipelined", "--allreduce", "psum,identity", "--baselines", "none"],
                       "decode"),
                      (["bench.allreduce", "--quick", "--sizes", "4", "--peers", "none",
                        "--no-trace", "--algorithms", "sifar"], "allreduce")):
        out = tmp_path / name
        r = subprocess.run([sys.executable, "-m", *cmd, "--out", str(out)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert "matplotlib is not installed" in r.stderr
        assert list(out.glob("*.json")) and list(out.glob("*.md")) and not list(out.glob("*.png"))


def test_cpu_results_default_to_an_ignored_directory():
    assert common.default_out("gpu") == REPO / "bench" / "results"
    local = common.default_out("cpu")
    assert local != common.default_out("gpu")
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
           "bench.decode", "--quick", "--no-plot", "--batch", "1", "--context", "256",
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
    from bench import allreduce

    mesh = cpu_mesh(2)
    cfg = {"chain": (2, 6), "trace_runs": 3}
    for skew in (0.0, 3.0):
        entry, lat = allreduce.trace_case(sifar_jax.call_trace, mesh, {}, cfg, 2, "sifar", 4096,
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
    from bench import allreduce

    mesh = cpu_mesh(2)
    fn = allreduce.chain_fn(mesh, "sifar", 6)
    x = allreduce.random_bf16(0, 2, 2048)
    rec = calltrace.collect(sifar_jax.call_trace, "tp", fn, (x,), 4, 6, ring_calls=10)
    assert rec.size == 2 * 6 * 4
    for r in (0, 1):
        epochs = rec["epoch"][rec["rank"] == r]
        assert np.unique(epochs).size == epochs.size == 24


def test_trace_case_records_a_failing_trace(cpu_mesh):
    from bench import allreduce

    def broken(axis_name):
        raise RuntimeError("no trace buffer")

    entry, lat = allreduce.trace_case(broken, cpu_mesh(2), {}, {"chain": (2, 4), "trace_runs": 1},
                                      2, "sifar", 4096, 0.0)
    assert lat is None and "no trace buffer" in entry["error"]


# -------------------------------------------------------- the comparison --
def _rec(alg, level, b, us):
    return {"algorithm": alg, "level": level, "tp": 2, "bytes": b, "us_median": us,
            "us_p10": us, "us_p90": us}


def test_comparison_ratios_and_target_verdict():
    from bench import allreduce

    recs = [_rec("sifar", "jit", 8192, 3.0), _rec("sifar", "kernel", 8192, 1.7),
            _rec("oneshot", "jit", 8192, 6.0), _rec("lax.psum", "jit", 8192, 13.5),
            _rec(peers.TORCH_ONE_SHOT, peers.LEVEL_CUDA_GRAPH, 8192, 6.0)]
    comp = allreduce.comparison(recs)
    assert {c["peer"] for c in comp} == {"lax.psum", peers.TORCH_ONE_SHOT}  # not our own
    assert {c["peer"]: c["ratio"] for c in comp} == {"lax.psum": 4.5, peers.TORCH_ONE_SHOT: 2.0}
    everyone = ["lax.psum", peers.TORCH_ONE_SHOT]
    v = allreduce.target_verdict(comp, [], [8192], everyone)
    assert v["verdict"] == "met" and v["lowest_ratio"]["peer"] == peers.TORCH_ONE_SHOT
    v = allreduce.target_verdict(comp, [], [8192], everyone + [peers.TORCH_NCCL])
    assert v["verdict"].startswith("met against the peers measured")
    assert v["peers_missing"] == [peers.TORCH_NCCL]
    v = allreduce.target_verdict(comp, [], [4096, 8192], everyone)  # nobody measured at 4 KB
    assert v["verdict"].startswith("met against the peers measured")
    assert v["peers_missing"] == everyone
    slow = allreduce.comparison(recs + [_rec(peers.XLA_ONE_SHOT, "jit", 8192, 2.5)])
    v = allreduce.target_verdict(slow, [], [8192], everyone)
    assert v["verdict"] == "missed" and v["behind"][0]["peer"] == peers.XLA_ONE_SHOT
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
    from bench import allreduce

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
    from bench import allreduce

    default = allreduce.payload_bytes({"sizes_kb": allreduce.parse_sizes(
        allreduce.parse_args([]).sizes)})
    assert 2048 * 2 in default and 4096 * 2 in default
    sweep = allreduce.payload_bytes({"sizes_kb": allreduce.parse_sizes("sweep")})
    assert sweep[0] == 1024 and sweep[-1] == 64 << 20
    assert all(b == 2 * a for a, b in zip(sweep, sweep[1:]))
    assert allreduce.parse_sizes("4,8.5") == [4.0, 8.5]
    with pytest.raises(SystemExit, match="sizes"):
        allreduce.parse_sizes("big")


def test_step_kernel_probe_sums_per_step_by_kind():
    """bench.probes.step_kernels: kinds from kernel names, per-step counts and microseconds."""
    from bench.probes import step_kernels as sk

    assert sk.kind_of("void sifar::cuda::FusedKernel<__nv_bfloat16, 2>(sifar::cuda::FusedArgs)") \
        == "sifar"
    assert sk.kind_of("gemm_fusion_dot_354") == "matmul"
    assert sk.kind_of("input_reduce_fusion_49") == "reduction"
    assert sk.kind_of("ncclDevKernel_AllGather_RING_LL") == "nccl"
    assert sk.kind_of("loop_multiply_fusion_126") == "other"
    assert sk.kind_of("mha_forward") == "attention"  # the Pallas decode kernel's name
    # sifar_jax.matvec's kernels (Qwen3's experts) are matmuls, not all-reduces
    assert sk.kind_of("void sifar::cuda::MatVecKernel<__nv_bfloat16, 8>(sifar::cuda::Args)") \
        == "matmul"
    assert sk.kind_of("void sifar::cuda::AddSplitsKernel<float>(sifar::cuda::Args, long)") \
        == "matmul"
    # a kernel no HLO instruction names: by its name (the Pallas kernel counts as attention)
    b = sk.breakdown([("mha_forward", 0, 4_000), ("gemm_fusion_dot_1", 5_000, 10_000),
                      ("loop_add_fusion", 16_000, 1_000)], steps=1, kinds={})
    assert (b["attention_us"], b["matmul_us"], b["other_us"], b["unmatched"]) == (4.0, 10.0, 1.0, 3)
    kernels = [("gemm_fusion_dot_1", 0, 30_000), ("input_reduce_fusion_2", 31_000, 2_000),
               ("AllReduceKernel_sifar", 34_000, 3_000), ("AllReduceKernel_sifar", 38_000, 5_000),
               ("gemm_fusion_dot_1", 50_000, 30_000), ("input_reduce_fusion_2", 81_000, 2_000),
               ("AllReduceKernel_sifar", 84_000, 3_000), ("AllReduceKernel_sifar", 88_000, 5_000)]
    r = sk.per_step(kernels, steps=2, top=2)
    assert r["kernels_per_step"] == 4
    assert r["busy_us_per_step"] == 40.0
    assert r["span_us_per_step"] == 46.5  # (93 - 0) us over 2 steps
    assert r["by_kind"]["sifar"] == {"count": 2.0, "us": 8.0}
    assert r["by_kind"]["matmul"] == {"count": 1.0, "us": 30.0}
    assert [t["kernel"] for t in r["top"]] == ["gemm_fusion_dot_1", "AllReduceKernel_sifar"]
    assert r["top"][1]["median_us"] == 4.0


def test_step_kernel_probe_runs_on_the_cpu(tmp_path):
    """On a CPU the probe runs every variant and says that it found no GPU kernels."""
    from bench.probes import step_kernels as sk

    out = tmp_path / "probe.json"
    assert sk.main(["--quick", "--steps", "2", "--context", "256", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["variants"]) == set(sk.VARIANTS)
    assert all("no GPU kernels" in v["note"] for v in data["variants"].values())


def test_layer_tail_probe_runs_on_the_cpu(tmp_path):
    """bench.probes.layer_tail times every variant and checks the communicator afterwards."""
    from bench.probes import layer_tail

    out = tmp_path / "tail.json"
    assert layer_tail.main(["--quick", "--hidden", "256", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["us_per_tail"]) == {"norm", "psum+norm", "sifar+norm", "fused"}
    assert all(np.isfinite(v["median"]) for v in data["us_per_tail"].values())


def test_waited_step_probe_runs_on_the_cpu(tmp_path):
    """bench.probes.waited_step splits a waited step and times the argument-only executables;
    the token is read from its pinned host copy, and the state is where it was afterwards."""
    from bench.probes import waited_step

    out = tmp_path / "waited.json"
    assert waited_step.main(["--quick", "--steps", "4", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["token_memory"] == "pinned_host"
    for key in ("waited_us", "waited_early_copy_us"):
        assert set(data[key]) == {"dispatch", "wait", "read", "total"}
        assert all(v > 0 for v in data[key].values())
    assert data["pipelined_us"] > 0 and data["null_all_us"]["dispatch"] > 0
    # --pack both: the decoder with its norm scales packed and without, alternating
    assert waited_step.main(["--quick", "--steps", "2", "--pack", "both", "--repeat", "1",
                             "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["pack_params"] for r in runs] == [True, False]
    assert runs[0]["arrays_per_step"] < runs[1]["arrays_per_step"]


def test_command_buffers_probe_counts_each_executables_events(capsys):
    """bench.probes.command_buffers runs its three executables in a child process and counts
    XLA's command-buffer log lines per executable (none on a CPU; the parser on a sample)."""
    from bench.probes import command_buffers as cb

    log = "\n".join([
        "I1201 command_buffer_thunk.cc:1] Initialized command buffer on device #0",
        f"{cb.MARK} step 0", "I1201 command_buffer_thunk.cc:2] Execute command buffer; n=1",
        f"{cb.MARK} device_token 0",
        "I1201 command_buffer_thunk.cc:3] [0] Updated command buffer in 120 us",
        "I1201 command_buffer_thunk.cc:2] Execute command buffer; n=2",
        f"{cb.MARK} end", "I1201 command_buffer_thunk.cc:2] Execute command buffer; n=3"])
    counts = cb.count_events(log)
    assert dict(counts["step"]) == {"execute": 1}  # the line before the first mark: no one's
    assert dict(counts["device_token"]) == {"update": 1, "execute": 1}
    assert not counts["no_token"]
    assert cb.main(["--quick", "--steps", "2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[:5] for r in rows] == [[v, "4", "0", "0", "0"] for v in cb.VARIANTS]
    assert all(float(r[5]) > 0 for r in rows)


def test_stacked_weights_probe_finds_materialised_slices(capsys):
    """bench.probes.stacked_weights: the parser counts a layer-sized result that is not a
    parameter or a bitcast (XLA:CPU copies the down projection's slice: the probe sees it), and
    the --quick run compares stacked and separate weights."""
    from bench.probes import stacked_weights as sw

    text = "\n".join([
        "  %p = bf16[8,64,32]{2,1,0} parameter(0)",
        "  %b = bf16[64,32]{1,0} bitcast(%p)",
        "  %slice_fusion.2 = bf16[64,32]{1,0} fusion(%p), kind=kLoop, calls=%c",
        "  ROOT %gemm_fusion = bf16[2,32]{1,0} fusion(%x, %b), kind=kCustom, calls=%g"])
    assert sw.layer_sized_writes(text, {"bf16[64,32]"}) == [
        "%slice_fusion.2 = bf16[64,32]{1,0} fusion(%p), kind=kLoop, calls=%c"]
    assert sw.main(["--quick", "--layers", "2", "--calls", "2"]) == 0
    out = capsys.readouterr().out
    assert "layer-sized writes" in out and "stacked:" in out and "separate:" in out


def test_concurrency_probe_times_every_branch_per_mode(capsys):
    """bench.probes.concurrency times each branch alone and together (a second stream
    included) under each scheduling mode it is given."""
    from bench.probes import concurrency

    assert concurrency.main(["--quick", "--modes", "default,CONCURRENT"]) == 0
    rows = [line.split(" us per call")[0].rsplit(None, 1)
            for line in capsys.readouterr().out.splitlines()]
    names = list(concurrency.branches(True)[0])
    assert [r[0].split(None, 1) for r in rows] == [[m, n] for m in ("default", "CONCURRENT")
                                                   for n in names]
    assert all(float(r[1]) > 0 for r in rows)


def test_layer_stream_xla_probe_computes_the_kernels_math(capsys):
    """bench.probes.layer_stream_xla: one layer against a float64 reference with the same bf16
    roundings as layer_stream.cu's host reference (random data, small shapes), then the --quick
    run times both chains, the layers with the decoder's attention and the step's head."""
    import jax.numpy as jnp

    from bench.probes import layer_stream_xla as lsx

    hidden, qkv, ffn = 64, 96, 224
    w = lsx.make_weights(1, hidden, qkv, ffn)[0]
    x = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (1, hidden)), jnp.bfloat16)
    got = np.asarray(lsx.layer(x, w, hidden, ffn), np.float64)

    def bf(v):
        return np.asarray(jnp.asarray(v, jnp.float32).astype(jnp.bfloat16), np.float64)

    f = {k: np.asarray(v, np.float64) for k, v in w.items()}

    def rms(r, scale):
        return bf(bf(r / np.sqrt(np.mean(r * r) + lsx.EPS)) * scale)

    r = np.asarray(x, np.float64)[0]
    q = bf(rms(r, f["attn_norm"]) @ f["qkv"])[:hidden]
    r = bf(r + bf(q @ f["o"]))
    gu = bf(rms(r, f["mlp_norm"]) @ f["gate_up"])
    a = bf(gu[:ffn] / (1 + np.exp(-gu[:ffn])) * gu[ffn:])
    want = bf(r + bf(a @ f["down"]))
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got[0], want, atol=4e-2 * np.abs(want).max())
    assert lsx.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"XLA layers .*: 2 layers \d+\.\d+ ms", out)
    assert "the four dots alone" in out
    assert re.search(r"XLA layers with the decoder's attention \(Pallas, KV 64\): 2 layers "
                     r"\d+\.\d+ ms", out)
    assert re.search(r"XLA head \(final norm, logits \[64, 512\], argmax\): \d+\.\d+ ms", out)
    assert lsx.main(["--quick", "--tp", "2"]) == 0  # one rank's shapes at TP=2
    out = capsys.readouterr().out
    assert "TP=2's per-rank shapes: hidden 64, qkv 48, o 32 x 64, gate_up 224, down 112" in out
    assert re.search(r"XLA layers with the decoder's attention \(Pallas, KV 64\): 2 layers", out)
    assert "logits [64, 256]" in out


def test_dispatch_cost_probe_runs_on_the_cpu(tmp_path):
    """bench.probes.dispatch_cost times every argument count, donated or not, and every read."""
    from bench.probes import dispatch_cost

    out = tmp_path / "dispatch.json"
    assert dispatch_cost.main(["--calls", "3", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(c["n"], c["donate"]) for c in data["calls"]] == [
        (n, d) for d in (False, True) for n in dispatch_cost.COUNTS]
    assert {"asarray_us", "async_copy_us", "device_get_us"} <= set(data["read"])


def test_xla_options_probe_times_each_option_set_and_reports_unknown_ones(capsys):
    """bench.probes.xla_options compiles the step once per option set (the options reach the
    compile: an option XLA does not know is reported, not fatal) and times each one."""
    from bench.probes import xla_options

    assert xla_options.parse_options("a=true,b=3,c=LHS,d=false") == {
        "a": True, "b": 3, "c": "LHS", "d": False}
    assert xla_options.main(["--quick", "--samples", "2",
                             "--options", ";no_such_xla_option=1"]) == 0
    out = capsys.readouterr().out
    assert "[no_such_xla_option=1]: not compiled" in out
    assert re.search(r"\[defaults\]: \d+\.\d+ ms/step pipelined", out)


def test_l2_reuse_probe_runs_on_the_cpu(capsys):
    """bench.probes.l2_reuse runs its chain and says when there is no GPU profile to read."""
    from bench.probes import l2_reuse

    assert l2_reuse.main(["--quick", "--runs", "2"]) == 0
    out = capsys.readouterr().out
    assert "tiny:" in out


def test_poll_depth_probe_runs_on_the_cpu(tmp_path):
    """bench.probes.poll_depth times each (algorithm, depth, gap) at every level, restores
    the default polling and writes one record per setting and level."""
    from bench.probes import poll_depth

    out = tmp_path / "poll.json"
    poll_depth.main(["--quick", "--algorithms", "sifar_push", "--settings", "1:0,2:40",
                     "--out", str(out)])
    recs = json.loads(out.read_text())["records"]
    levels = sorted({r["level"] for r in recs})
    assert levels in (["jit", "jit_device", "kernel"], ["jit", "kernel"])  # jit_device: with a trace
    assert [(r["depth"], r["gap_ns"]) for r in recs] == [(1, 0)] * len(levels) + [(2, 40)] * len(levels)
    assert all(np.isfinite(r["us_median_raw"]) and r["algorithm"] == "sifar_push" for r in recs)


def test_decode_prefetch_rows_and_records(tmp_path):
    """bench.decode --prefetch-mib: one fused row per size after the default fused row; each
    record says what the fused call prefetched (None unfused, the library default for the plain
    fused row), and prefetching changes no token."""
    from bench import decode as bd
    import sifar_jax.fused

    args = bd.parse_args(["--quick", "--allreduce", "psum,sifar", "--baselines", "none",
                          "--prefetch-mib", "0", "1.5"])
    variants = bd.parse_variants(args)
    assert [v[0] for v in variants] == ["psum", "sifar", "sifar+fused", "sifar+fused:pf0",
                                        "sifar+fused:pf1.5"]
    assert variants[3][4] == 0 and variants[4][4] == 3 << 19
    with pytest.raises(SystemExit, match="prefetch-mib"):
        bd.parse_variants(bd.parse_args(["--quick", "--allreduce", "psum", "--prefetch-mib", "8"]))

    assert bd.main(["--quick", "--tp", "2", "--no-sweep", "--loops", "sync", "--no-plot",
                    "--no-trace", "--allreduce", "sifar", "--baselines", "none", "--prefetch-mib", "0",
                    "--out", str(tmp_path)]) == 0
    records = json.loads(next(tmp_path.glob("decode-*.json")).read_text())
    by_label = {r["allreduce"]: r for r in records if r["tp"] == 2}
    assert by_label["sifar"]["prefetch_bytes"] is None
    assert by_label["sifar+fused"]["prefetch_bytes"] == sifar_jax.fused.DEFAULT_PREFETCH_BYTES
    assert by_label["sifar+fused:pf0"]["prefetch_bytes"] == 0
    assert by_label["sifar+fused"]["generated"] == by_label["sifar+fused:pf0"]["generated"]


# ------------------------------------------- decode: baseline, floor, breakdown --
def test_decode_baseline_rows_come_by_default_and_only_at_the_loops_point():
    from bench import decode as bd

    s = bd.settings(bd.parse_args(["--quick"]), "cpu", 8)
    labels = [v[0] for v in s["variants"]]
    assert labels[:3] == ["psum", "sifar:oneshot", "sifar:twoshot"]
    assert s["baselines"] == ["sifar:oneshot", "sifar:twoshot"]
    loops_point = (1, s["context"][0])
    for tp, b, c, v, _ in bd.cases(s):
        if v[0] in s["baselines"]:
            assert tp == 2 and (b, c) == loops_point
    swept = bd.settings(bd.parse_args(["--quick", "--sweep-all-variants"]), "cpu", 8)
    assert {(b, c) for tp, b, c, v, _ in bd.cases(swept) if v[0] == "sifar:oneshot"} == {
        (b, c) for b in swept["batch"] for c in swept["context"]}
    none = bd.settings(bd.parse_args(["--quick", "--baselines", "none"]), "cpu", 8)
    assert none["baselines"] == [] and "sifar:oneshot" not in [v[0] for v in none["variants"]]



def test_decode_runs_the_fused_rows_at_tp1_only_when_asked():
    """At TP=1 only lax.psum by default; with --fused on also the fused call (one rank: a
    residual add + RMSNorm kernel in place of XLA's fusions), at the loops' point."""
    from bench import decode as bd

    def tp1(argv):
        s = bd.settings(bd.parse_args(["--quick", "--tp", "1", *argv]), "cpu", 8)
        return {v[0] for tp, b, c, v, _ in bd.cases(s) if tp == 1}

    assert tp1([]) == {"psum"}
    assert tp1(["--fused", "on"]) == {"psum", "sifar+fused"}

def test_decode_counts_a_copy_of_one_layer_of_the_cache():
    """bench.decode.cache_copies counts a fresh array of one layer's keys, not only of the whole
    cache array (a per-layer copy was invisible to a check of the whole array's shape)."""
    import types

    import jax
    import jax.numpy as jnp

    from bench import decode as bd
    from models import hlo

    cache = jnp.ones((2, 2, 1, 16, 4, 8), jnp.float32)  # [layers, 2, B, S, kv heads, D]
    exe = jax.jit(lambda c: (c, c[1, 0] * 2.0),
                  donate_argnums=0).lower(cache).compile()
    whole = hlo.cache_shapes(cache)[0]
    assert hlo.cache_copies(exe.as_text(), whole) == {}  # the whole array: aliased, not copied
    dec = types.SimpleNamespace(compiled_step=lambda: exe, state={"cache": cache})
    assert bd.cache_copies(dec, "pipelined", {}).get("entry", 0) >= 1


def test_decode_names_the_baseline_and_carries_the_floor(tmp_path, capsys):
    """bench.decode on the CPU: the in-decoder oneshot and twoshot rows run by default, the faster
    is named "baseline" in every record at its point and in the markdown, every record carries
    floor_ms (weights + KV cache per rank at HBM_BYTES_PER_S) and floor_ratio, and --breakdown
    is skipped with a note (no GPU kernels to trace)."""
    from bench import decode as bd

    assert bd.main(["--quick", "--no-sweep", "--loops", "pipelined", "--no-plot", "--no-trace",
                    "--breakdown", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "--breakdown: skipped" in out and "memory floor" in out
    records = json.loads(next(tmp_path.glob("decode-*.json")).read_text())
    by = {(r["tp"], r["allreduce"]): r for r in records}
    assert {(2, "sifar:oneshot"), (2, "sifar:twoshot"), (2, "psum"), (1, "psum")} <= set(by)
    fastest = min(("sifar:oneshot", "sifar:twoshot"), key=lambda a: by[(2, a)]["tpot_ms_median"])
    for r in records:
        want = bd.floor_ms(r["weights_bytes_per_rank"], r["kv_bytes_per_rank"])
        assert r["floor_ms"] == pytest.approx(want, rel=1e-3) and r["floor_ms"] > 0
        assert r["floor_ratio"] == pytest.approx(r["tpot_ms_median"] / r["floor_ms"], rel=1e-2)
        assert "breakdown" not in r
        if r["tp"] == 2:
            assert r["baseline"] == fastest
            assert r["vs_baseline"] == pytest.approx(
                by[(2, fastest)]["tpot_ms_median"] / r["tpot_ms_median"], rel=1e-3)
        else:
            assert r["baseline"] is None and r["vs_baseline"] is None  # TP=1: psum alone
    assert by[(2, fastest)]["vs_baseline"] == 1.0
    md = next(tmp_path.glob("decode-*.md")).read_text()
    assert f"{fastest} (baseline)" in md and "x floor" in md and "--breakdown: skipped" in md


def _tiny_decoder(cpu_mesh, allreduce="psum"):
    from bench import decode as bd
    from models import random_params

    config = bd.PRESETS["tiny"]().replace(max_seq_len=256)
    mesh = cpu_mesh(2)
    params = random_params(config, mesh, seed=0)
    dec = bd.make_decoder(config, mesh, params, (allreduce, allreduce, "auto", False), 1, 256, 0)
    dec.seek(200, bd.start_tokens(config, 1, 0))
    return dec


def test_step_breakdown_classifies_the_decoder_step_hlo(cpu_mesh):
    """The kernels of a compiled decode step (XLA:CPU here) by kind: the weight matmuls (one per
    projection and the LM head), the KV-cache update and attention, the all-reduces, the rest;
    every kind's microseconds add up to the busy time, idle is span - busy."""
    from bench.probes import step_kernels as sk

    dec = _tiny_decoder(cpu_mesh)
    kinds = sk.decoder_kinds(dec)
    text = dec.compiled_step().as_text()
    comps, entry, _ = sk._instructions(text)
    ops = {i[0]: i for instrs in comps.values() for i in instrs}
    layers = dec.config.num_layers
    # qkv, o, gate_up, down per layer and the LM head read a weight through a dot
    weight_dots = [n for n, k in kinds.items() if k == "matmul" and n in ops]
    assert len(weight_dots) >= 4 * layers + 1, weight_dots
    assert all(ops[n][2] in ("dot", "fusion", "custom-call") for n in weight_dots)
    # the cache update writes a cache-shaped value: attention
    updates = [n for n, i in ops.items() if "dynamic-update-slice" in n and n in kinds]
    assert updates and all(kinds[n] == "attention" for n in updates)
    assert sum(k == "all_reduce" for n, k in kinds.items() if n in ops) >= 2 * layers  # psum
    assert "other" in kinds.values()
    names = [n for n in kinds if n in ops][:6]
    kernels = [(n, 1000 * i * 10, 1000 * (i + 1), None) for i, n in enumerate(names)]
    b = sk.breakdown(kernels, 2, kinds)
    assert sum(b[f"{k}_us"] for k in sk.BREAKDOWN) == pytest.approx(b["busy_us"], abs=0.2)
    assert b["busy_us"] == pytest.approx(sum(i + 1 for i in range(6)) / 2, abs=0.1)
    assert b["idle_us"] == pytest.approx(b["span_us"] - b["busy_us"], abs=0.1)
    assert b["unmatched"] == 0



def test_step_breakdown_takes_the_arrays_the_step_is_passed_as_its_weights(cpu_mesh, monkeypatch):
    """With the norm scales packed, the step's weights are its first len(dec.weights.leaves) entry
    parameters, fewer than the params tree's leaves: counting those would class state arrays
    as weights."""
    import jax

    from bench.probes import step_kernels as sk

    dec = _tiny_decoder(cpu_mesh)
    seen = []
    monkeypatch.setattr(sk, "hlo_kinds", lambda text, n, shapes: seen.append(n) or {})
    sk.decoder_kinds(dec)
    assert seen == [len(dec.weights.leaves)] and len(dec.weights.leaves) < len(jax.tree.leaves(dec.params))


GPU_LIKE_HLO = """HloModule jit_step, is_scheduled=true

FunctionNames
1 "Attention.__call__"
2 "rms_norm"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=1}
2 {file_name_id=1 function_name_id=2 line=20 end_line=20 column=1 end_column=1}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}

%gemm_computation (p0: bf16[1,64], p1: bf16[64,32]) -> bf16[1,32] {
  %p0 = bf16[1,64]{1,0} parameter(0)
  %p1 = bf16[64,32]{1,0} parameter(1)
  ROOT %dot.1 = bf16[1,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%softmax_computation (p0.1: f32[1,8]) -> f32[1,8] {
  %p0.1 = f32[1,8]{1,0} parameter(0)
  ROOT %exponential.1 = f32[1,8]{1,0} exponential(%p0.1), metadata={op_name="x" stack_frame_id=1}
}

%norm_computation (p0.2: bf16[1,64]) -> bf16[1,64] {
  %p0.2 = bf16[1,64]{1,0} parameter(0)
  ROOT %multiply.1 = bf16[1,64]{1,0} multiply(%p0.2, %p0.2), metadata={op_name="y" stack_frame_id=2}
}

%command_buffer (arg.0: bf16[1,64], arg.1: bf16[64,32], arg.2: f32[1,8]) -> (bf16[1,32], f32[1,8]) {
  %arg.0 = bf16[1,64]{1,0} parameter(0)
  %arg.1 = bf16[64,32]{1,0} parameter(1)
  %arg.2 = f32[1,8]{1,0} parameter(2)
  %bitcast.3 = bf16[64,32]{1,0} bitcast(%arg.1)
  %gemm_fusion_dot.7 = bf16[1,32]{1,0} fusion(%arg.0, %bitcast.3), kind=kCustom, calls=%gemm_computation
  %loop_exponential_fusion = f32[1,8]{1,0} fusion(%arg.2), kind=kLoop, calls=%softmax_computation
  ROOT %tuple.1 = (bf16[1,32]{1,0}, f32[1,8]{1,0}) tuple(%gemm_fusion_dot.7, %loop_exponential_fusion)
}

ENTRY %main.9 (param.0: bf16[64,32], param.1: bf16[1,64], param.2: bf16[1,4,16,8]) -> bf16[1,64] {
  %param.0 = bf16[64,32]{1,0} parameter(0), metadata={op_name="w"}
  %param.1 = bf16[1,64]{1,0} parameter(1)
  %param.2 = bf16[1,4,16,8]{3,2,1,0} parameter(2)
  %custom-call.2 = bf16[1,64]{1,0} custom-call(%param.1), custom_call_target="sifar_psum_add_rmsnorm"
  %loop_multiply_fusion.4 = bf16[1,64]{1,0} fusion(%custom-call.2), kind=kLoop, calls=%norm_computation
  %fusion.5 = f32[1,8]{1,0} fusion(%param.2), kind=kLoop, calls=%softmax_computation
  %call.6 = (bf16[1,32]{1,0}, f32[1,8]{1,0}) call(%loop_multiply_fusion.4, %param.0, %fusion.5), to_apply=%command_buffer
  %cublas-gemm.8 = bf16[1,32]{1,0} custom-call(%loop_multiply_fusion.4, %param.1), custom_call_target="__cublas$gemm"
  ROOT %add.9 = bf16[1,64]{1,0} add(%loop_multiply_fusion.4, %loop_multiply_fusion.4)
}
"""


MATVEC_HLO = """HloModule jit_step, is_scheduled=true

ENTRY %main.3 (param.0: bf16[8,64,32], param.1: bf16[1,64], param.2: s32[1]) -> bf16[1,32] {
  %param.0 = bf16[8,64,32]{2,1,0} parameter(0)
  %param.1 = bf16[1,64]{1,0} parameter(1)
  %param.2 = s32[1]{0} parameter(2)
  %custom-call.1 = (bf16[1,32]{1,0}, f32[256]{0}) custom-call(%param.1, %param.0, %param.2), custom_call_target="sifar_matvec"
  %get-tuple-element.2 = bf16[1,32]{1,0} get-tuple-element(%custom-call.1), index=0
  %custom-call.3 = bf16[1,32]{1,0} custom-call(%get-tuple-element.2), custom_call_target="sifar_allreduce"
  ROOT %copy.4 = bf16[1,32]{1,0} copy(%custom-call.3)
}
"""


def test_step_breakdown_counts_the_experts_matvec_as_a_matmul():
    """sifar_jax.matvec reading a weight (Qwen3's experts) is a matmul; only sifar_jax's
    all-reduce targets count as all_reduce (a Qwen3 TP=1 step once showed 1.3 ms of
    "all-reduce" with no all-reduce in it)."""
    from bench.probes import step_kernels as sk

    kinds = sk.hlo_kinds(MATVEC_HLO, n_weights=1)
    assert kinds["custom-call.1"] == "matmul"
    assert kinds["custom-call.3"] == "all_reduce"


def test_step_breakdown_follows_weights_through_command_buffers():
    """GPU-shaped HLO: a Triton GEMM inside a command buffer reads entry parameter 0 (a weight)
    through the call and a bitcast: matmul; a cuBLAS GEMM reading a non-weight: not matmul;
    the fused all-reduce's custom call: all_reduce; a fusion from an attention function or
    reading the KV cache: attention; a norm: other. Kernels match by the profile's hlo_op stat
    or by the kernel name XLA:GPU derives from the instruction's."""
    from bench.probes import step_kernels as sk

    kinds = sk.hlo_kinds(GPU_LIKE_HLO, n_weights=1, cache_shapes={"bf16[1,4,16,8]"})
    assert kinds["gemm_fusion_dot.7"] == "matmul" and kinds["gemm_fusion_dot_7"] == "matmul"
    assert kinds["custom-call.2"] == "all_reduce"
    assert kinds["loop_exponential_fusion"] == "attention"  # its source: Attention.__call__
    assert kinds["fusion.5"] == "attention"  # reads the cache (and the same source)
    assert kinds["loop_multiply_fusion.4"] == "other"
    assert kinds["cublas-gemm.8"] == "other"  # a GEMM, but of no weight
    assert "add.9" in kinds and "call.6" not in kinds and "param.0" not in kinds
    assert "dot.1" not in kinds  # inside a fusion: no kernel of its own
    kernels = [("gemm_fusion_dot_7", 0, 10_000), ("void sifar::cuda::FusedKernel<bf16>", 12_000, 5_000),
               ("sm90_xmma_gemm_bf16", 20_000, 4_000, "cublas-gemm.8"),
               ("some_library_kernel", 30_000, 1_000)]
    b = sk.breakdown(kernels, 1, kinds)
    assert (b["matmul_us"], b["all_reduce_us"], b["other_us"]) == (10.0, 5.0, 5.0)
    assert b["unmatched"] == 1 and b["idle_us"] == pytest.approx(31.0 - 20.0)
    assert b["overlap_us"] == 0.0
    # A command buffer runs independent kernels at once: overlap is counted apart, idle is the
    # time with no kernel running (on 1x H200 the old span - busy printed -87.5 us per step)
    both = [("gemm_fusion_dot_7", 0, 10_000), ("loop_multiply_fusion.4", 4_000, 10_000),
            ("add.9", 20_000, 2_000)]
    b = sk.breakdown(both, 1, kinds)
    assert b["busy_us"] == 22.0 and b["span_us"] == 22.0
    assert b["idle_us"] == pytest.approx(6.0) and b["overlap_us"] == pytest.approx(6.0)

def test_matvec_speed_probe_quick(tmp_path, capsys):
    """bench.probes.matvec_speed runs every variant and checks each against float64."""
    import json

    from bench.probes import matvec_speed

    out = tmp_path / "mv.json"
    assert matvec_speed.main(["--quick", "--targets", "264,528/0.1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert {r["variant"] for r in results} >= {"xla1", "xla2", "gather2", "matvec@528/0.1"}
    assert all(r["rel_err"] < 1e-5 for r in results)  # float32 on the CPU


JAX_TEST_LIKE = '''from __future__ import annotations
import jax
from jax import lax


class T:
  @parameterized.parameters([lax.psum, lax.pmax])
  def test_value(self, collective):
    return collective

  def test_call(self):
    self.assertEqual(eqn.primitive.name, 'psum_invariant')
    return jax.lax.psum(x, 'i') + lax.psum_scatter(x, 'i') + lax.psum(x, 'j')

  def test_other(self):
    self.assertIn('psum_invariant', str(lax.psum_p))
'''


def test_jax_psum_suite_swaps_lax_psum_and_keeps_the_tests_that_call_it():
    """bench.probes.jax_psum_suite: every lax.psum / jax.lax.psum (a call or a value) becomes
    the swapped psum, psum_scatter and psum_p stay; the tests that never call it are renamed
    away from pytest, and a string naming a psum primitive is noticed."""
    from bench.probes import jax_psum_suite as suite

    text, n = suite.swap(JAX_TEST_LIKE)
    assert n == 3
    assert text.splitlines()[1] == "import _sifar_swap  # sifar_psum in lax.psum's place"
    assert "_sifar_swap.psum(x, 'i') + lax.psum_scatter(x, 'i')" in text
    assert "[_sifar_swap.psum, lax.pmax]" in text and "str(lax.psum_p)" in text
    text, kept, names_psum = suite.select(text)
    assert kept == ["T.test_value", "T.test_call"]
    assert "def _not_psum_test_other(self):" in text and "def test_call(self):" in text
    assert names_psum == {"T.test_value": False, "T.test_call": True}
    assert suite.base_name("f.T.test_value_collective=psum", kept) == "T.test_value"


def test_gemv_cluster_probe_xla_side_runs_on_the_cpu(capsys):
    """bench.probes.gemv_cluster_xla times each projection kind and the layer chain at 1 and 2
    rows (small shapes on the CPU)."""
    from bench.probes import gemv_cluster_xla

    assert gemv_cluster_xla.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert out.count("us per projection") == 8 and out.count("LAYER CHAIN") == 2


@pytest.mark.parametrize("probe", ["gemv_cluster.cu", "layer_stream.cu",
                                   "layer_stream.cu -DLS_TP=2"])
def test_cuda_probe_compiles_where_nvcc_is(probe):
    """The standalone CUDA probes (bench/probes/*.cu, with probe_util.cuh and
    attention_phase.cuh) build for sm_90a, layer_stream also for TP=2's per-rank shapes."""
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                    if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        pytest.skip("no nvcc")
    name, *flags = probe.split()
    src = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "probes", name)
    out = subprocess.run([nvcc, "-O1", "-std=c++17", "-arch=sm_90a", *flags, "-c", src, "-o",
                          os.devnull],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]


def test_floor_note_names_the_baselines_or_says_none_ran():
    from bench import decode as bd

    none = bd.floor_note({"baselines": []})
    assert none.endswith("Baseline: none (no in-decoder one-shot or two-shot row ran).")
    assert "rows none ran" not in none
    two = bd.floor_note({"baselines": ["sifar:oneshot", "sifar:twoshot"]})
    assert "the in-decoder rows sifar:oneshot or sifar:twoshot at the same TP" in two
