#!/usr/bin/env bash
# Everything one lease of a GPU host runs, in one call: build, the GPU tests,
# both benchmarks. One log plus the result files land in $OUT, which the
# device tool brings back (8 files at most).
#
#   bash bench/gpu_host_run.sh [tests|allreduce|decode ...]   # default: all three
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/sifar-out}"
mkdir -p "$OUT"
LOG="$OUT/run.log"
steps=("${@:-tests allreduce decode}")
steps=(${steps[*]})

log() { echo "=== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }

log "host"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader 2>&1 | tee -a "$LOG"
env | grep -E "NVLS|MULTICAST" | tee -a "$LOG"
log "build"
python3 -m pip install --no-build-isolation --no-deps -q -e . 2>&1 | tail -3 | tee -a "$LOG"
for step in "${steps[@]}"; do
  case "$step" in
    tests)
      log "tests: pytest tests/test_gpu.py tests/test_buffers.py"
      timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -rs -s tests/test_gpu.py tests/test_buffers.py \
        2>&1 | grep -v "^[WI][0-9]\{4\}" | tee -a "$LOG" | tail -25 ;;
    allreduce)
      log "bench.allreduce ${ALLREDUCE_ARGS:-}"
      timeout "${ALLREDUCE_TIMEOUT:-200}" python3 -m bench.allreduce ${ALLREDUCE_ARGS:-} \
        2>&1 | grep -v "^[WI][0-9]\{4\}" | tee -a "$LOG" | tail -40 ;;
    decode)
      log "bench.decode ${DECODE_ARGS:-}"
      timeout "${DECODE_TIMEOUT:-300}" python3 -m bench.decode ${DECODE_ARGS:-} \
        2>&1 | grep -v "^[WI][0-9]\{4\}" | tee -a "$LOG" | tail -25 ;;
  esac
done
cp bench/results/*xH200.* "$OUT"/ 2>/dev/null
log "done"; ls "$OUT"
