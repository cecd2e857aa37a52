"""Probe: does XLA:GPU run two independent branches of one jitted function at the same time?

A batch-1 decode step leaves the GPU's memory idle during its short kernels (RoPE, the cache
write, attention over a short cache, norms: ~19 us per Llama-8B layer on an H200). Work that
streams the next weight could fill that time only if XLA ran it *beside* those kernels. This
times a chain A of 16 small dependent matmuls (latency-bound) and a branch B that reads a
large array (an XLA reduction, or a Pallas kernel), alone and together in one function, under
each command-buffer scheduling mode and with B annotated for a second stream
(`compute_on("gpu_stream:1")`). Together ~= A + B: serialised; ~= max(A, B): concurrent.
"B after A[0]" starts B after A's first matmul (how a prefetch would follow its producer).
Times are wall time per call of back-to-back calls: A alone is near the host's dispatch cost
of its 18 arguments (~50 us on the H200 host), so read B and A + B against it. The stream
annotation may need `XLA_FLAGS=--xla_gpu_experimental_stream_annotation=true` (the same on
jax 0.11.2 with or without it).

    python -m bench.probes.concurrency            # one GPU
    python -m bench.probes.concurrency --quick    # CPU: small shapes, Pallas interpreted
"""

from __future__ import annotations

import argparse
import time

MODES = ("default", "SERIALIZE", "LHS", "CONCURRENT")


def on_stream(f, stream: int = 1):
    """f run by XLA on GPU stream `stream` (jax.experimental.compute_on; both API spellings)."""
    import jax.experimental.compute_on as co
    from jax._src.core import MemorySpace

    api = getattr(co, "compute_on2", None) or co.compute_on
    return api(f, compute_type=f"gpu_stream:{stream}", out_memory_spaces=MemorySpace.Device)


def branches(quick: bool):
    """{name: f(x, ws, big)} and their inputs."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    n, width, rows = (4, 64, 256) if quick else (16, 1024, 16384)  # big: 128 MiB of bf16 on GPUs
    keys = jax.random.split(jax.random.key(0), n + 2)
    ws = [jax.random.normal(k, (width, width), jnp.bfloat16) * width ** -0.5 for k in keys[:n]]
    x = jax.random.normal(keys[n], (2, width), jnp.bfloat16)
    big = jax.random.normal(keys[n + 1], (rows, 4096), jnp.bfloat16)

    def after(a, b):
        """a, ordered after b (no pass over a)."""
        return jax.lax.optimization_barrier((a, b))[0]

    def chain(x, ws):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    def xla_sum(big):
        return jnp.sum(big.astype(jnp.float32))

    def pallas_sum(big):
        blk = 256

        def kernel(b_ref, o_ref):
            o_ref[...] = jnp.sum(b_ref[...].astype(jnp.float32), axis=0, keepdims=True)

        out = pl.pallas_call(kernel, grid=(big.shape[0] // blk,),
                             in_specs=[pl.BlockSpec((blk, 4096), lambda i: (i, 0))],
                             out_specs=pl.BlockSpec((1, 4096), lambda i: (i, 0)),
                             out_shape=jax.ShapeDtypeStruct((big.shape[0] // blk, 4096),
                                                            jnp.float32),
                             interpret=jax.default_backend() == "cpu")(big)
        return out.sum()

    fns = {
        "A": lambda x, ws, big: chain(x, ws),
        "B xla": lambda x, ws, big: xla_sum(big),
        "B pallas": lambda x, ws, big: pallas_sum(big),
        "A + B xla": lambda x, ws, big: (chain(x, ws), xla_sum(big)),
        "A + B pallas": lambda x, ws, big: (chain(x, ws), pallas_sum(big)),
        "A + B pallas after A[0]": lambda x, ws, big: (
            chain(x, ws), pallas_sum(after(big, (x @ ws[0])[0, 0]))),
        "A + B pallas on stream 1": lambda x, ws, big: (chain(x, ws), on_stream(pallas_sum)(big)),
    }
    return fns, (x, ws, big)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.concurrency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES),
                   help="xla_gpu_command_buffer_scheduling_mode values ('default': XLA's)")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="small shapes (CPU)")
    args = p.parse_args(argv)
    import jax

    fns, inputs = branches(args.quick)
    calls = 2 if args.quick else args.calls
    for mode in args.modes.split(","):
        options = {} if mode == "default" else {"xla_gpu_command_buffer_scheduling_mode": mode}
        for name, f in fns.items():
            exe = jax.jit(f).lower(*inputs).compile(compiler_options=options or None)
            jax.block_until_ready(exe(*inputs))
            t0 = time.perf_counter()
            for _ in range(calls):
                out = exe(*inputs)
            jax.block_until_ready(out)
            print(f"{mode:>10} {name:<26} {(time.perf_counter() - t0) / calls * 1e6:9.1f} us "
                  f"per call", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
