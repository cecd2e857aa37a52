"""Other all-reduces than ours, measured by bench.allreduce in the same run: torch.nccl
(torch.distributed.all_reduce), torch.symm_mem.one_shot / two_shot (symmetric memory), each in a
CUDA graph, and xla.one_shot (lax.psum with XLA's one-shot kernel flag).

Every peer runs in processes of its own (torch needs one per GPU and no JAX beside it; XLA reads
XLA_FLAGS once), each with a timeout: a peer that fails, hangs or sums wrong costs only its own
rows, recorded in "errors". Children get MULTICAST_OFF and write their JSON after every size.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench import common

TORCH_NCCL = "torch.nccl"
TORCH_ONE_SHOT = "torch.symm_mem.one_shot"
TORCH_TWO_SHOT = "torch.symm_mem.two_shot"
XLA_ONE_SHOT = "xla.one_shot"
TORCH = (TORCH_NCCL, TORCH_ONE_SHOT, TORCH_TWO_SHOT)
ALL = TORCH + (XLA_ONE_SHOT,)

# How each peer is timed ("level" in the records).
LEVEL_CUDA_GRAPH = "cuda_graph_chain"
LEVEL_EAGER = "eager_chain"  # the torch child's CPU mode (gloo, no graphs): development only
LEVEL_JIT = "jit"  # as bench.allreduce's jit level: a lax.psum chain in one jitted function
LEVELS = {
    LEVEL_CUDA_GRAPH: "chains of R1 and R2 data-dependent all-reduces captured in two CUDA graphs, "
                      "each replay timed with CUDA events, (t(R2) - t(R1)) / (R2 - R1), mean over "
                      "the ranks",
    LEVEL_JIT: "chains of R1 and R2 data-dependent lax.psum in one jitted shard_map function "
               "(XLA command buffers), (t(R2) - t(R1)) / (R2 - R1), as the jit level of sifar",
    LEVEL_EAGER: "eager chains on the CPU (gloo): a test of the code path, not a result",
}
XLA_ONE_SHOT_FLAG = "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"


def parse(spec: str) -> list[str]:
    """--peers: "auto" (every peer), "none", or a comma list of ALL."""
    spec = spec.strip()
    if spec == "none":
        return []
    if spec == "auto":
        return list(ALL)
    names = [v.strip() for v in spec.split(",") if v.strip()]
    for v in names:
        if v not in ALL:
            raise SystemExit(f"unknown peer {v!r}; choose from {', '.join(ALL)} (or auto, none)")
    return names


def child_args(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """A peer process's arguments: `p`'s own and those `run` gives every peer, parsed: sizes
    (payload bytes per rank), chain (R1, R2), runs, warmup and json."""
    p.add_argument("--sizes", required=True, help="comma list of payload bytes per rank (bf16)")
    p.add_argument("--chain", default="20,200", help="R1,R2: all-reduces per chain")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", required=True, help="where to write the results")
    args = p.parse_args(argv)
    args.sizes = [int(v) for v in args.sizes.split(",") if v.strip()]
    args.chain = tuple(int(v) for v in args.chain.split(","))
    if not 0 < args.chain[0] < args.chain[1]:
        p.error("--chain needs 0 < R1 < R2")
    return args


def run(peers: list[str], *, tps: list[int], sizes: list[int], chain: tuple[int, int], runs: int,
        warmup: int, n_gpus: int, timeout_s: float, log: Callable[[str], None] = print) -> dict:
    """Measures `peers` at every TP size and payload size (bytes of bf16): {"records", "errors",
    "info"}, records like bench.allreduce's, errors as {"algorithm", "tp", "bytes"?, "error"}."""
    out: dict = {"records": [], "errors": [], "info": {}}
    common_args = ["--sizes", ",".join(str(b) for b in sizes), "--chain", f"{chain[0]},{chain[1]}",
                   "--runs", str(runs), "--warmup", str(warmup)]
    for name in peers:
        if name == XLA_ONE_SHOT:
            cmd = [sys.executable, "-m", "bench.peers.xla_one_shot",
                   "--tp", ",".join(str(t) for t in tps)] + common_args
            flags = os.environ.get("XLA_FLAGS", "")
            env = common.child_env(XLA_FLAGS=f"{flags} {XLA_ONE_SHOT_FLAG}".strip(),
                                   XLA_PYTHON_CLIENT_PREALLOCATE="false")
            _merge(out, run_child(cmd, env, timeout_s, name, None, log))
            continue
        for tp in tps:
            why = None
            if importlib.util.find_spec("torch") is None:
                why = "skipped: torch is not importable here"
            elif n_gpus < tp:
                why = f"skipped: needs {tp} CUDA GPUs (one process per GPU), {n_gpus} visible"
            if why is not None:
                out["errors"].append({"algorithm": name, "tp": tp, "error": why})
                log(f"peer {name} tp={tp}: {why}")
                continue
            cmd = [sys.executable, "-m", "bench.peers.torch_allreduce", "--algorithm", name,
                   "--tp", str(tp)] + common_args
            # Everything is on this host: rendezvous and NCCL bootstrap over loopback.
            env = common.child_env(**{k: os.environ.get(k, "lo")
                                      for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")})
            _merge(out, run_child(cmd, env, timeout_s, name, tp, log))
    return out


def _merge(into: dict, part: dict) -> None:
    into["records"] += part.get("records", [])
    into["errors"] += part.get("errors", [])
    into["info"].update(part.get("info", {}))


def run_child(cmd: list[str], env: dict, timeout_s: float, name: str, tp: int | None,
              log: Callable[[str], None] = print) -> dict:
    """Runs one peer process (`cmd` plus `--json PATH`) in its own session, with
    a timeout; returns what it wrote, plus an error entry if it failed, timed
    out or wrote nothing. Its output is logged, prefixed, when it ends."""
    label = name if tp is None else f"{name} tp={tp}"
    with tempfile.TemporaryDirectory(prefix="sifar-peer-") as tmp:
        json_path = Path(tmp) / "peer.json"
        log_path = Path(tmp) / "peer.log"
        log(f"peer {label}: {' '.join(cmd[1:])}")
        status = None
        with open(log_path, "wb") as logf:
            # A session of its own, so that one signal ends the child and its workers.
            proc = subprocess.Popen(cmd + ["--json", str(json_path)], env=env, cwd=common.REPO_ROOT,
                                    stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
            # If we are terminated meanwhile (the suite's timeout), take the child down too.
            prev = signal.signal(signal.SIGTERM, _exit_on_sigterm)
            try:
                rc = proc.wait(timeout=timeout_s)
                if rc != 0:
                    status = f"exit code {rc}"
            except subprocess.TimeoutExpired:
                status = f"timed out after {timeout_s:g} s (killed)"
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                signal.signal(signal.SIGTERM, prev)
        text = log_path.read_text(errors="replace")
        for line in _interesting(text):
            log(f"  [{label}] {line}")
        try:
            part = json.loads(json_path.read_text())
        except (OSError, ValueError) as e:
            part = {}
            status = status or f"wrote no results ({type(e).__name__})"
        part = {"records": part.get("records", []), "errors": part.get("errors", []),
                "info": part.get("info", {})}
        if status is not None:
            tail = " | ".join(_interesting(text)[-3:])
            part["errors"].append(
                {"algorithm": name, "tp": tp, "error": f"{status}: {tail}" if tail else status})
        return part


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _interesting(text: str) -> list[str]:
    """The child's output without XLA's and absl's info and warning lines (I1130 ..., W1130 ...)."""
    lines = (line.strip() for line in text.splitlines())
    return [s for s in lines if s and not (len(s) > 5 and s[0] in "IW" and s[1:5].isdigit())][-40:]


def add_result(out: dict, path: str, name: str, tp: int, nbytes: int, res: dict,
               cpu: bool = False) -> None:
    """A child's result at one size (a record, or {"error": why}) into `out`, said (a CPU's
    without its timing) and written."""
    if "error" in res:
        out["errors"].append({"algorithm": name, "tp": tp, "bytes": nbytes, "error": res["error"]})
    else:
        out["records"].append(res)
    said = res.get("error") or ("measured (a CPU: no timing shown)" if cpu else
                                f"{common.fmt_latency(res, ' us')} ({res['level']})")
    print(f"{name} tp={tp} {nbytes} B: {said}", flush=True)
    write_partial(path, out)


def write_partial(path: str, payload: dict) -> None:
    """What a child calls after every size: the results so far, atomically."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)
