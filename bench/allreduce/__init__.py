"""All-reduce latency of every portable SiFAR algorithm, of lax.psum and of the peers (torch NCCL,
torch symmetric memory, XLA's one-shot kernel), in one run.

    python -m bench.allreduce                 # GPUs: the results the project commits
    python -m bench.allreduce --quick         # a quick look (CPU / CI: well under a minute)
    python -m bench.allreduce --peers none --no-trace   # ours and lax.psum only
    python -m bench.allreduce --sizes sweep --write-auto-table auto.json   # what "auto" runs
    python -m sifar_jax.launch -n 2 -- python -m bench.allreduce   # one process per GPU

Levels (kernel, jit, jit_device, the peers' cuda_graph_chain), the noise rule ("not resolved"),
the per-call trace and the JSON's fields: docs/reference.md (bench.allreduce). On a machine with
fewer than two GPUs it runs on 8 XLA:CPU host devices at TP=2: a protocol demo (every algorithm
checked bit for bit against lax.psum, sifar_jax.stats()), not a performance result: it prints and
writes no timing figure (its JSON keeps the raw numbers, flagged cpu_timings_not_a_speed_figure).

Modules: settings (flags), measure (the functions timed, the checks, the peers, the trace),
tables, cli (main and the report, through bench.report).
"""

from bench import common

common.use_host_devices(8)  # before jax is imported; only XLA:CPU reads it


def main(argv=None) -> int:
    from bench.allreduce.cli import main as run

    return run(argv)
