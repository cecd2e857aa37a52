#!/usr/bin/env bash
# One development call on the GPU host: build (with compile-time variants if
# asked), then the steps named on the command line, in order; one log in $OUT.
# The evaluation suite is bench/gpu_host_run.sh; this is for A/B work.
#   OUT=/tmp/out bash bench/probes/device_run.sh tests kernels decode   (from the repository root)
#   build=<CUDA flags>  rebuild with these CMAKE_CUDA_FLAGS (a compile-time variant for an A/B)
#   tests     pytest -k gpu $TESTS              (default tests/sifar_jax/test_fused.py)
#   pytest    pytest $PYTEST, no -k             (default tests/models/test_decode_loops.py)
#   tail      bench.probes.layer_tail $TAIL_ARGS
#   kernels   bench.probes.step_kernels $KERNELS_ARGS
#   decode    bench.decode --no-sweep --no-plot $DECODE_ARGS
#   allreduce bench.allreduce --no-plot $ALLREDUCE_ARGS
#   poll      bench.probes.poll_depth $POLL_ARGS
#   sanitize[=tool]  compute-sanitizer --tool <tool> (memcheck) on $SANITIZE_CMD
# Each result file is named after the step and its position (3-tail.json).
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT="${OUT:-/tmp/sifar-out}"; mkdir -p "$OUT"
LOG="$OUT/run.log"; : >"$LOG"
T0=$(date +%s)
log() { echo "=== $(date -u +%H:%M:%S) (+$(( $(date +%s) - T0 ))s) $*" | tee -a "$LOG"; }
quiet() { grep -v "^[WI][0-9]\{4\}" | tee -a "$LOG"; }
log "sources: $({ find ffi -type f | sort | xargs cat; cat src/sifar_jax/*.py models/*.py bench/*.py bench/probes/*.py; } | sha1sum | cut -c1-12)"
nvidia-smi -L | tee -a "$LOG"
build() {  # the flags are always passed: CMake keeps a cached value otherwise
  log "build ${1:--DSIFAR_DEFAULTS}"
  python3 -m pip install --no-build-isolation --no-deps -q -e . \
    --config-settings=cmake.define.CMAKE_CUDA_FLAGS="${1:--DSIFAR_DEFAULTS}" 2>&1 | tail -5 | quiet
}
build
k=0
for step in "$@"; do
  k=$((k + 1))
  case "$step" in
    build=*) build "${step#build=}" ;;
    tests)
      log tests
      timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -x -k gpu ${TESTS:-tests/sifar_jax/test_fused.py} 2>&1 | tail -25 | quiet ;;
    pytest)
      log pytest
      timeout "${PYTEST_TIMEOUT:-240}" python3 -m pytest -q -x ${PYTEST:-tests/models/test_decode_loops.py} 2>&1 | tail -25 | quiet ;;
    tail)
      log tail
      timeout "${TAIL_TIMEOUT:-200}" python3 -m bench.probes.layer_tail ${TAIL_ARGS:-} --out "$OUT/$k-tail.json" 2>&1 | quiet ;;
    kernels)
      log kernels
      timeout "${KERNELS_TIMEOUT:-200}" python3 -m bench.probes.step_kernels ${KERNELS_ARGS:-} --out "$OUT/$k-step-kernels.json" 2>&1 | quiet ;;
    decode)
      log decode
      mkdir -p "$OUT/$k-decode"
      timeout "${DECODE_TIMEOUT:-300}" python3 -m bench.decode --no-sweep --no-plot ${DECODE_ARGS:-} --out "$OUT/$k-decode" 2>&1 | quiet ;;
    allreduce)
      log allreduce
      mkdir -p "$OUT/$k-allreduce"
      timeout "${ALLREDUCE_TIMEOUT:-300}" python3 -m bench.allreduce --no-plot ${ALLREDUCE_ARGS:-} --out "$OUT/$k-allreduce" 2>&1 | quiet ;;
    poll)
      log poll
      timeout "${POLL_TIMEOUT:-300}" python3 -m bench.probes.poll_depth ${POLL_ARGS:-} --out "$OUT/$k-poll.json" 2>&1 | quiet ;;
    sanitize|sanitize=*)
      tool="${step#sanitize}"; tool="${tool#=}"; tool="${tool:-memcheck}"
      log "sanitize $tool: ${SANITIZE_CMD:?}"
      timeout "${SANITIZE_TIMEOUT:-200}" compute-sanitizer --tool "$tool" \
        --target-processes all $SANITIZE_CMD 2>&1 | grep -v "^\[.\] [WI][0-9]\{4\}" | tail -30 | quiet ;;
    *) log "unknown step $step" ;;
  esac
done
log done
