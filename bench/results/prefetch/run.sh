#!/usr/bin/env bash
# One device call (2x H200): the fused call prefetching the next matmul's weight into L2.
# Build, the GPU tests of the fused call and of ordering (nothing measured if they fail), then
# per-kernel device time of a decode step with and without the prefetch, then the decode loops
# pipelined/on_device over prefetch sizes (twice, in two orders: the spread is the noise).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TQDM_DISABLE=1 PYTHONUNBUFFERED=1
LOG="$OUT/run.log"; : >"$LOG"; T0=$(date +%s)
stage() { echo "=== +$(( $(date +%s) - T0 ))s $*" | tee -a "$LOG"; }
quiet() { grep -v "^[WI][0-9]\{4\}" ; }
echo "sources: $(cat ffi/* sifar_jax/*.py models/*.py | sha1sum | cut -c1-12)" | tee -a "$LOG"
stage build; python3 -m pip install --no-build-isolation --no-deps -q -e . >/tmp/build.log 2>&1 || { tail -30 /tmp/build.log | tee -a "$LOG"; exit 1; }
stage tests
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_fused.py tests/test_ordering.py -k gpu \
  2>&1 | quiet >"$OUT/tests.log"; rc=${PIPESTATUS[0]}
tail -3 "$OUT/tests.log" | tee -a "$LOG"
if (( rc != 0 )); then grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests.log" | head -30 | tee -a "$LOG"; stage "tests failed: nothing measured"; exit 1; fi
stage "step kernels"
timeout 120 python3 -m bench.probes.step_kernels --variants sifar+fused:pf0,sifar+fused,identity \
  --out "$OUT/step-kernels.json" 2>&1 | quiet | tee -a "$LOG"
stage "decode 1"
timeout 130 python3 -m bench.decode --tp 2 --no-sweep --loops pipelined,on_device --no-trace \
  --allreduce psum,sifar,identity --prefetch-mib 0 4 8 32 --out "$OUT/decode1" 2>&1 | quiet \
  | grep -E "TP=2 batch|wrote .*md" | tee -a "$LOG"
stage "decode 2"
timeout 110 python3 -m bench.decode --tp 2 --no-sweep --loops pipelined,on_device --no-trace \
  --allreduce identity,sifar --prefetch-mib 64 0 --out "$OUT/decode2" 2>&1 | quiet \
  | grep -E "TP=2 batch|wrote .*md" | tee -a "$LOG"
stage done
tar czf "$OUT/decode.tgz" -C "$OUT" decode1 decode2 && rm -rf "$OUT/decode1" "$OUT/decode2"
