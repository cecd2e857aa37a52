#!/usr/bin/env bash
# Fourth device call (2x H200): the committed default (bulk evict_last prefetch from 16 blocks,
# 16 MiB). GPU tests of the fused call, ordering and the plain kernels, then every decode loop
# (psum, sifar, sifar+fused, sifar+fused:pf0, identity; TP 2 and 1), then 8 prefetch blocks.
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
stage build; build final
stage tests
timeout 170 python3 -m pytest -q -rs -p no:cacheprovider tests/test_fused.py tests/test_ordering.py tests/test_gpu.py -k gpu \
  2>&1 | quiet >"$OUT/tests.log"; rc=${PIPESTATUS[0]}
tail -2 "$OUT/tests.log" | tee -a "$LOG"
if (( rc != 0 )); then grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests.log" | head -30 | tee -a "$LOG"; stage "tests failed: nothing measured"; exit 1; fi
stage decode
timeout 200 python3 -m bench.decode --no-sweep --prefetch-mib 0 --out "$OUT/decode" 2>&1 | quiet \
  | grep -E "TP=. batch|wrote .*md" | tee -a "$LOG"
stage "build H (8 prefetch blocks)"; build H "--config-settings=cmake.define.CMAKE_CUDA_FLAGS=-DSIFAR_PREFETCH_BLOCKS=8"
timeout 100 python3 -m bench.decode --tp 2 --no-sweep --loops pipelined,on_device --no-trace \
  --allreduce sifar --prefetch-mib 0 --out "$R/dec-H" 2>&1 | quiet | grep -E "TP=2 batch" | tee -a "$LOG"
stage done
tar czf "$OUT/extra.tgz" -C "$R" .
