#!/usr/bin/env bash
# One device call of this session's fused-matmul work (see README.md here):
# build, then the steps named on the command line.
#   tests   the GPU tests of psum_add_rmsnorm_matmul and psum_add_rmsnorm
#   probe   bench.probes.tail_matmul (QKV and gate/up shapes, TP=2)
#   decode  bench.decode loops with the fused-matmul decoder
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT="${OUT:-/tmp/sifar-out}"; mkdir -p "$OUT"
LOG="$OUT/run.log"; : >"$LOG"
T0=$(date +%s)
log() { echo "=== $(date -u +%H:%M:%S) (+$(( $(date +%s) - T0 ))s) $*" | tee -a "$LOG"; }
quiet() { grep -v "^[WI][0-9]\{4\}" | tee -a "$LOG"; }
log "sources: $(cat ffi/* sifar_jax/*.py models/*.py bench/*.py bench/probes/*.py | sha1sum | cut -c1-12)"
nvidia-smi -L | tee -a "$LOG"
build() {  # build [CUDA flags]: the extension, with compile-time variants if given; the
  # flags are always passed (CMake keeps a cached value otherwise)
  log "build ${1:--DSIFAR_DEFAULTS}"
  python3 -m pip install --no-build-isolation --no-deps -q -e . \
    --config-settings=cmake.define.CMAKE_CUDA_FLAGS="${1:--DSIFAR_DEFAULTS}" 2>&1 | tail -5 | quiet
}
build
for step in "$@"; do
  case "$step" in
    build=*) build "${step#build=}" ;;
    tests)
      log tests
      timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -x -k gpu ${TESTS:-tests/test_fused_matmul.py} 2>&1 | tail -25 | quiet ;;
    probe)
      log probe
      timeout "${PROBE_TIMEOUT:-200}" python3 -m bench.probes.tail_matmul ${PROBE_ARGS:-} --out "$OUT/tail-matmul.json" 2>&1 | quiet ;;
    decode)
      log decode
      timeout "${DECODE_TIMEOUT:-300}" python3 -m bench.decode --no-sweep --no-plot ${DECODE_ARGS:-} --out "$OUT" 2>&1 | quiet ;;
    kernels)
      log kernels
      timeout "${KERNELS_TIMEOUT:-200}" python3 -m bench.probes.step_kernels ${KERNELS_ARGS:-} --out "$OUT/step-kernels.json" 2>&1 | quiet ;;
    pytest)
      log pytest
      timeout "${PYTEST_TIMEOUT:-200}" python3 -m pytest -q -x ${PYTEST:-tests/test_decode_loops.py} 2>&1 | tail -25 | quiet ;;
    grid)
      log grid
      python3 -c "import sifar_jax; print('matmul grid:', sifar_jax._ext._sifar.matmul_grid(0))" 2>&1 | quiet ;;
    sanitize)
      log sanitize
      timeout 200 compute-sanitizer --tool memcheck python3 -m pytest -q -x -k "gpu and matches" tests/test_fused_matmul.py 2>&1 | tail -15 | quiet ;;
  esac
done
log done
