#!/usr/bin/env bash
# Second device call: the early read checked BEFORE the first regular wave
# (which is issued as without it), A/B/A in one call: this tree ("early"),
# the same built with -DSIFAR_NO_EARLY_READ ("noearly": the fused kernel's
# one-barrier cluster exchange only), the previous kernels ("old", ab_old/),
# then "early" again. GPU tests of the changed kernels after the first build.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TQDM_DISABLE=1 PYTHONUNBUFFERED=1
R="$OUT/r"; mkdir -p "$R"; LOG="$OUT/run.log"; : >"$LOG"
T0=$(date +%s)
stage() { echo "=== +$(( $(date +%s) - T0 ))s $*" | tee -a "$LOG"; }
quiet() { grep -v "^[WI][0-9]\{4\}" ; }
build() { local name="$1"; shift
          python3 -m pip install --no-build-isolation --no-deps -q -e . "$@" >"$R/build-$name.log" 2>&1 \
          || { tail -30 "$R/build-$name.log" | tee -a "$LOG"; }; }
measure() {
  stage "allreduce ($1)"
  timeout 60 python3 -m bench.allreduce --peers none --no-trace --sizes 4,8 --algorithms sifar,lax.psum \
    --out "$R/ar-$1" 2>&1 | quiet >"$R/ar-$1.log"; tail -1 "$R/ar-$1.log" | tee -a "$LOG"
  stage "decode ($1)"
  timeout 90 python3 -m bench.decode --tp 2 --no-sweep --loops pipelined,on_device --allreduce "$2" \
    --out "$R/dec-$1" 2>&1 | quiet >"$R/dec-$1.log"; tail -1 "$R/dec-$1.log" | tee -a "$LOG"
}
NOEARLY=(--config-settings=cmake.define.CMAKE_CUDA_FLAGS=-DSIFAR_NO_EARLY_READ)
stage "build (early)"; build early
stage tests
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py tests/test_fused.py \
  tests/test_ordering.py -k gpu 2>&1 | quiet >"$R/tests.log"
tail -2 "$R/tests.log" | tee -a "$LOG"
measure early sifar,identity,psum
stage "build (noearly)"; build noearly "${NOEARLY[@]}"
measure noearly sifar
if [[ -d ab_old ]]; then
  stage "build (old)"; cp ffi/cuda_kernels.cuh ffi/cuda_fused.cuh "$R/"; cp ab_old/*.cuh ffi/
  build old --config-settings=cmake.define.CMAKE_CUDA_FLAGS=
  measure old sifar
  stage "build (early again)"; cp "$R/cuda_kernels.cuh" "$R/cuda_fused.cuh" ffi/
  build early2 --config-settings=cmake.define.CMAKE_CUDA_FLAGS=
  measure early2 sifar
fi
stage done
tar czf "$OUT/early-read2.tgz" -C "$R" .
