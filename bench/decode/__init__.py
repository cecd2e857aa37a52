"""End-to-end decode: time per output token (TPOT) of the decoder (Llama, or any family's --preset)
with lax.psum, the paper's baseline inside our decoder (the better of sifar:oneshot and
sifar:twoshot), sifar (unfused and fused with the residual add and RMSNorm) and identity (no
all-reduce: the upper bound), in every decode loop, then over batch sizes and KV lengths; each
record beside the step's memory floor (the bytes it reads at the device's copy rate, measured in
the run: bench.common.copy_rate).

    python -m bench.decode                    # GPU: Llama-3.1-8B shapes, bf16, TP=2 (4, 8) then 1
    python -m bench.decode --quick            # CPU demo (tiny model): about a minute on 2 cores
    python -m bench.decode --shapes tp2_rank  # one GPU: TP=2's per-rank shapes, no all-reduce
    python -m bench.decode --quantize fp8 --tp 1 --virtual-ranks   # the persistent step at R ranks

Weights: --quantize fp8 (FP8 projections, as models.generate --quantize fp8), --to-rows (dense
projections held as [N, K] rows); the old --weights fp8 / --weights rows still work (deprecated).
The method, every option and the record fields: docs/reference.md (bench.decode); the results:
docs/performance.md. Writes decode-<host>.{json,md} after every variant: to bench/results/ on
GPUs, to the git-ignored bench/results/local/ on a CPU, where nothing printed or written in
markdown is a timing (the JSON keeps the raw numbers, flagged cpu_timings_not_a_speed_figure).

Modules: settings (flags -> one Settings), timers, records (the run and its records), tables,
output (JSON, markdown, summary), ranks (--virtual-ranks), model_api (what it uses of models/
beyond the top-level names), cli (main).
"""

from bench import common

common.use_host_devices(8)  # before jax is imported; only XLA:CPU reads it


def main(argv=None) -> int:
    from bench.decode.cli import main as run

    return run(argv)
