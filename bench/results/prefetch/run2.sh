#!/usr/bin/env bash
# Second device call (2x H200): prefetch from extra blocks (not the all-reduce's four), with an
# L2 policy hint. A: the default build (evict_last, 32 prefetch blocks): GPU tests, step kernels,
# decode over sizes. Then builds varying one knob each, each timed against pf0 in one run.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TQDM_DISABLE=1 PYTHONUNBUFFERED=1
R="$OUT/r"; mkdir -p "$R"; LOG="$OUT/run.log"; : >"$LOG"; T0=$(date +%s)
stage() { echo "=== +$(( $(date +%s) - T0 ))s $*" | tee -a "$LOG"; }
quiet() { grep -v "^[WI][0-9]\{4\}" ; }
echo "sources: $(cat ffi/* sifar_jax/*.py models/*.py | sha1sum | cut -c1-12)" | tee -a "$LOG"
build() { local name="$1"; shift
          python3 -m pip install --no-build-isolation --no-deps -q -e . "$@" >"$R/build-$name.log" 2>&1 \
          || { tail -30 "$R/build-$name.log" | tee -a "$LOG"; exit 1; }; }
kernels() { timeout 90 python3 -m bench.probes.step_kernels --variants "$2" --top 4 --out "$R/sk-$1.json" 2>&1 \
            | quiet | tee -a "$LOG"; }
decode() { timeout 120 python3 -m bench.decode --tp 2 --no-sweep --loops pipelined,on_device --no-trace \
             --allreduce "$2" --prefetch-mib $3 --out "$R/dec-$1" 2>&1 | quiet \
             | grep -E "TP=2 batch" | tee -a "$LOG"; }
stage "build A (evict_last, 32 blocks)"; build A
stage tests
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_fused.py tests/test_ordering.py -k gpu \
  2>&1 | quiet >"$R/tests.log"; rc=${PIPESTATUS[0]}
tail -2 "$R/tests.log" | tee -a "$LOG"
if (( rc != 0 )); then grep -E "^(FAILED|ERROR)|Error|assert" "$R/tests.log" | head -30 | tee -a "$LOG"; stage "tests failed: nothing measured"; exit 1; fi
kernels A sifar+fused:pf0,sifar+fused,identity
decode A sifar,identity "0 8 32"
for v in "B -DSIFAR_PREFETCH_HINT=0" "C -DSIFAR_PREFETCH_HINT=2" "D -DSIFAR_PREFETCH_BLOCKS=64"; do
  set -- $v
  stage "build $1 ($2)"; build "$1" "--config-settings=cmake.define.CMAKE_CUDA_FLAGS=$2"
  kernels "$1" sifar+fused
  decode "$1" sifar "0"
done
stage done
tar czf "$OUT/prefetch2.tgz" -C "$R" .
