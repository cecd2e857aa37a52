"""Torch peers of bench.allreduce, one process per GPU (bench.peers runs this).

    python -m bench.peers.torch_allreduce --algorithm torch.nccl --tp 2 \\
        --sizes 4096,8192 --chain 20,200 --runs 30 --warmup 3 --json out.json

Per size, every rank: one checked all-reduce (bench.common.random_payload, against the float64
sum; a wrong sum is an error, not timed), then chains of R1 and R2 all-reduces captured in two
CUDA graphs, each replay after a host barrier timed with CUDA events: (t(R2) - t(R1)) / (R2 - R1),
the mean over ranks. torch.nccl: dist.all_reduce in place; one_shot:
one_shot_all_reduce_copy_out; two_shot: two_shot_all_reduce_ in place. Refuses to start unless
MULTICAST_OFF is in its environment. `--device cpu` runs torch.nccl's path over gloo without
graphs (level eager_chain): a test of this file, not a result.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
import traceback
import zlib

from bench import common, peers

ALGORITHMS = peers.TORCH


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.peers.torch_allreduce",
                                description="Torch all-reduce peers (one process per GPU).")
    p.add_argument("--algorithm", required=True, choices=ALGORITHMS)
    p.add_argument("--tp", type=int, required=True, help="ranks (one GPU each)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--op-timeout", type=float, default=120.0,
                   help="seconds a collective may wait for a peer process")
    return peers.child_args(p, argv)


def refuse_multicast() -> None:
    wrong = {k: os.environ.get(k) for k, v in common.MULTICAST_OFF.items()
             if os.environ.get(k) != v}
    if wrong:
        raise SystemExit(f"refusing to start: NVLink multicast must be off "
                         f"({common.MULTICAST_OFF}); this environment has {wrong}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -------------------------------------------------------------------- peers --
class Context:
    """What the peers of one rank share: torch, the groups, the device and
    (for symm_mem) one symmetric buffer of the largest size, rendezvoused once."""

    def __init__(self, torch, dist, device, rank: int, tp: int, max_elems: int, host_group):
        self.torch, self.dist, self.device = torch, dist, device
        self.rank, self.tp, self.max_elems = rank, tp, max_elems
        self.host_group = host_group
        self.group_name = dist.group.WORLD.group_name
        self._symm = None
        self.multicast_ptr = None

    def empty(self, elems: int):
        return self.torch.empty(elems, dtype=self.torch.bfloat16, device=self.device)

    def symm_buffer(self):
        if self._symm is None:  # collective: every rank gets here at the same point
            import torch.distributed._symmetric_memory as symm_mem

            self._symm = symm_mem.empty(self.max_elems, dtype=self.torch.bfloat16,
                                        device=self.device)
            try:
                handle = symm_mem.rendezvous(self._symm, self.group_name)
            except RuntimeError as e:
                if "group" not in str(e).lower():
                    raise
                # torch before the process group registered itself with symm_mem
                # (2.11 says the call is no longer needed): register, then again.
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    symm_mem.enable_symm_mem_for_group(self.group_name)
                handle = symm_mem.rendezvous(self._symm, self.group_name)
            self.multicast_ptr = int(getattr(handle, "multicast_ptr", 0) or 0)
        return self._symm

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank (gloo)."""
        out = [None] * self.tp
        self.dist.all_gather_object(out, obj, group=self.host_group)
        return out

    def barrier(self) -> None:
        self.dist.barrier(group=self.host_group)


class Peer:
    """One rank's chain step y <- allreduce(y): torch.nccl in place on a buffer of its own,
    two_shot in place on the symmetric buffer, one_shot (its copy-out form, staged through the
    symmetric buffer) from one of two buffers into the other."""

    def __init__(self, ctx: Context, algorithm: str, elems: int):
        self.ctx, self.algorithm, self.cur = ctx, algorithm, 0
        self.symm = None if algorithm == peers.TORCH_NCCL else ctx.symm_buffer()[:elems]
        if algorithm == peers.TORCH_TWO_SHOT:
            self.ys = [self.symm]
        elif algorithm == peers.TORCH_ONE_SHOT:
            self.ys = [ctx.empty(elems), ctx.empty(elems)]
        else:
            self.ys = [ctx.empty(elems)]

    def load(self, x):
        self.ys[0].copy_(x)
        self.cur = 0

    def step(self):
        y, group = self.ys[self.cur], self.ctx.group_name
        if self.algorithm == peers.TORCH_NCCL:
            self.ctx.dist.all_reduce(y)
        elif self.algorithm == peers.TORCH_TWO_SHOT:
            self.ctx.torch.ops.symm_mem.two_shot_all_reduce_(y, "sum", group)
        else:
            self.cur = 1 - self.cur
            self.ctx.torch.ops.symm_mem.one_shot_all_reduce_copy_out(self.symm, y, "sum", group,
                                                                     self.ys[self.cur])

    def value(self):
        return self.ys[self.cur]


# ------------------------------------------------------------------- timing --
class GraphChain:
    """`length` steps captured in one CUDA graph; a call replays it once after a
    host barrier and returns its device time in seconds (CUDA events)."""

    def __init__(self, ctx: Context, peer, length: int):
        torch = ctx.torch
        self.ctx = ctx
        # Eager steps first: NCCL creates its communicator at the first call,
        # which must not happen during capture.
        for _ in range(2):
            peer.step()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog thread may query events meanwhile.
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            for _ in range(length):
                peer.step()
        torch.cuda.synchronize()
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def __call__(self) -> float:
        self.ctx.barrier()
        self.start.record()
        self.graph.replay()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


class EagerChain:
    """CPU mode: `length` steps run eagerly, host-timed."""

    def __init__(self, ctx: Context, peer, length: int):
        self.ctx, self.peer, self.length = ctx, peer, length

    def __call__(self) -> float:
        self.ctx.barrier()
        t0 = time.perf_counter()
        for _ in range(self.length):
            self.peer.step()
        return time.perf_counter() - t0


def measure(ctx: Context, args, nbytes: int) -> dict:
    """One size on this rank: a record, or {"error": ...} (the same on every rank)."""
    torch = ctx.torch
    elems = nbytes // 2
    peer = Peer(ctx, args.algorithm, elems)
    seed = zlib.crc32(repr((ctx.tp, args.algorithm, nbytes)).encode())
    x_all = common.random_payload(seed, ctx.tp, elems)
    peer.load(torch.from_numpy(x_all[ctx.rank]).to(device=ctx.device, dtype=torch.bfloat16))
    peer.step()
    got = peer.value().float().cpu().numpy()
    wrong = common.allreduce_mismatch(got[None], x_all, ranks=[ctx.rank])
    wrong = [m for m in ctx.gather(wrong) if m]
    if wrong:
        return {"error": "WRONG RESULT, not timed: " + "; ".join(wrong)}

    r1, r2 = args.chain
    chain = GraphChain if args.device == "cuda" else EagerChain
    small, large = chain(ctx, peer, r1), chain(ctx, peer, r2)
    for _ in range(args.warmup):
        small()
        large()
    samples = []
    for _ in range(args.runs):
        t_small = small()
        samples.append((large() - t_small) / (r2 - r1))
    per_rank = ctx.gather(samples)
    mean = [sum(col) / len(col) for col in zip(*per_rank)]
    level = peers.LEVEL_CUDA_GRAPH if args.device == "cuda" else peers.LEVEL_EAGER
    return {"algorithm": args.algorithm, "level": level, "tp": ctx.tp, "bytes": nbytes,
            **common.summarize_us(mean), "runs": args.runs, "chain": list(args.chain)}


def _info(torch, ctx: Context) -> dict:
    info = {"torch": torch.__version__}
    try:
        if ctx.device.type == "cuda":
            info["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
            info["torch_cuda"] = torch.version.cuda
            info["torch_gpu"] = torch.cuda.get_device_name(ctx.device)
        if ctx.multicast_ptr is not None:
            info["symm_mem_multicast_ptr"] = ctx.multicast_ptr  # 0: no multicast object
    except Exception as e:  # noqa: BLE001 - informational only
        info["info_error"] = repr(e)
    return info


def worker(rank: int, args, port: int) -> None:
    refuse_multicast()
    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=args.tp,
                            timeout=datetime.timedelta(seconds=args.op_timeout))
    host = dist.new_group(backend="gloo") if cuda else dist.group.WORLD
    ctx = Context(torch, dist, device, rank, args.tp, max(args.sizes) // 2, host)
    out = {"records": [], "errors": [], "info": {}}
    try:
        for nbytes in args.sizes:
            try:
                res = measure(ctx, args, nbytes)
            except Exception as e:  # noqa: BLE001 - recorded, the next size goes on
                res = {"error": f"{type(e).__name__}: {e}".strip()}
                traceback.print_exc()
            errors = [r for r in ctx.gather(res) if "error" in r]  # the lowest failing rank says why
            if rank == 0:
                out["info"] = _info(torch, ctx)
                peers.add_result(out, args.json, args.algorithm, args.tp, nbytes,
                                 errors[0] if errors else res, cpu=args.device == "cpu")
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        refuse_multicast()
        import torch

        if args.device == "cuda" and torch.cuda.device_count() < args.tp:
            raise RuntimeError(f"needs {args.tp} CUDA GPUs, torch sees "
                               f"{torch.cuda.device_count()}")
        import torch.multiprocessing as mp

        # The worker is pickled by its module's importable name, not __main__.
        from bench.peers import torch_allreduce as this

        mp.spawn(this.worker, args=(args, free_port()), nprocs=args.tp, join=True)
        return 0
    except BaseException as e:  # noqa: BLE001 - a failed peer is a result too
        lines = str(e).strip().splitlines() or [type(e).__name__]
        msg = lines[-1] if isinstance(e, Exception) else f"{type(e).__name__}: {lines[-1]}"
        part = {"records": [], "errors": [], "info": {}}
        try:
            with open(args.json) as f:
                part = json.load(f)
        except (OSError, ValueError):
            pass
        part["errors"].append({"algorithm": args.algorithm, "tp": args.tp, "error": msg})
        peers.write_partial(args.json, part)
        print(f"{args.algorithm} tp={args.tp}: {msg}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
