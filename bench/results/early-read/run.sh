#!/usr/bin/env bash
# One device call (2x H200): build this tree, run the GPU tests of the changed
# kernels, time sifar / sifar_push (bench.allreduce) and the decode step
# (bench.decode), profile the decode step's kernels; then rebuild with the
# previous kernels (ab_old/, copied in by the caller) and time the same again:
# an A/B within one call. Results in $OUT/early-read.tgz and $OUT/run.log.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TQDM_DISABLE=1 PYTHONUNBUFFERED=1
R="$OUT/r"; mkdir -p "$R"; LOG="$OUT/run.log"; : >"$LOG"
T0=$(date +%s)
stage() { echo "=== +$(( $(date +%s) - T0 ))s $*" | tee -a "$LOG"; }
quiet() { grep -v "^[WI][0-9]\{4\}" ; }
build() { python3 -m pip install --no-build-isolation --no-deps -q -e . >"$R/build-$1.log" 2>&1 \
          || { tail -30 "$R/build-$1.log" | tee -a "$LOG"; }; }
AR="--peers none --no-trace --sizes 4,8,16 --algorithms sifar,sifar_push,lax.psum"
DEC="--tp 2 --no-sweep --loops pipelined,on_device"
nvidia-smi -L | tee -a "$LOG"
stage "build (new)"; build new
stage tests
timeout 170 python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py tests/test_buffers.py \
  tests/test_fused.py tests/test_ordering.py -k gpu 2>&1 | quiet >"$R/tests.log"
tail -4 "$R/tests.log" | tee -a "$LOG"
stage "allreduce (new)"
timeout 75 python3 -m bench.allreduce $AR --out "$R/ar-new" 2>&1 | quiet >"$R/ar-new.log"; tail -3 "$R/ar-new.log" | tee -a "$LOG"
stage "decode (new)"
timeout 110 python3 -m bench.decode $DEC --out "$R/dec-new" 2>&1 | quiet >"$R/dec-new.log"; tail -3 "$R/dec-new.log" | tee -a "$LOG"
stage "probe (new)"
timeout 90 python3 -m bench.probes.step_kernels --out "$R/step-kernels.json" 2>&1 | quiet >"$R/probe.log"; tail -60 "$R/probe.log" >>"$LOG"
if [[ -d ab_old ]]; then
  stage "build (old kernels)"; cp ab_old/*.cuh ffi/; build old
  stage "allreduce (old)"
  timeout 60 python3 -m bench.allreduce $AR --out "$R/ar-old" 2>&1 | quiet >"$R/ar-old.log"; tail -3 "$R/ar-old.log" | tee -a "$LOG"
  stage "decode (old)"
  timeout 70 python3 -m bench.decode $DEC --allreduce sifar --out "$R/dec-old" 2>&1 | quiet >"$R/dec-old.log"; tail -3 "$R/dec-old.log" | tee -a "$LOG"
fi
stage done
tar czf "$OUT/early-read.tgz" -C "$R" .
