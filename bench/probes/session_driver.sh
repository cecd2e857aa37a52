#!/usr/bin/env bash
# Session driver of 2026-12-06 (leaves the tree next commit): OUT=... bash bench/probes/session_driver.sh step...
# steps: info build ranks stress long8b decode decode2 gemv probe sanitize tests (probe: bench/probes/ranks_timing.py at 01dbc16, run from the repo root as probe_ranks.py)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/dev}; mkdir -p "$OUT"; T0=$(date +%s)
log() { echo "=== +$(( $(date +%s) - T0 ))s $*"; }
quiet() { grep -v "^[WI][0-9]\{4\}\|^\[[0-9]\] [WI][0-9]\{4\}"; }
PYP="env PYTHONPATH=$PWD/src:$PWD"
for step in "$@"; do
  case $step in
info) nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv ;;
build)
  log build
  if ls src/sifar_jax/_sifar*.so >/dev/null 2>&1 && [[ -z ${REBUILD:-} ]]; then log "module there"; else
  find ffi -type f -exec touch {} +
  BUILD_BEFORE=0 OUT=/tmp/v bash tools/validate_ffi.sh build 2>&1 | tail -5; fi ;;
tests)
  log tests
  timeout 200 $PYP python3 -m pytest -q -rs -p no:cacheprovider \
    tests/models/test_persistent.py -m "not slow" 2>&1 | quiet | tail -15 ;;
ranks)
  log "virtual ranks tests"
  timeout 300 $PYP python3 -m pytest -q -rs -s -p no:cacheprovider \
    tests/models/test_persistent_ranks.py 2>&1 | quiet | grep -E "phases in|passed|failed|Error|assert|^E " | tail -30 ;;
stress)
  log "1M skewed phases per (ranks, allreduce)"
  SIFAR_STEP_STRESS_PHASES=${PHASES:-1000000} timeout 400 $PYP python3 -m pytest -q -rs -s -p no:cacheprovider \
    tests/models/test_persistent_ranks.py -k skewed 2>&1 | quiet | grep -E "phases in|passed|failed|Error|assert|^E " | tail -20 ;;
long8b)
  log "8B shapes against the XLA step"
  timeout 300 $PYP python3 -m pytest -q -s -rs -p no:cacheprovider \
    tests/models/test_persistent.py -k 8b 2>&1 | quiet | grep -E "8b:|passed|failed|Error|assert" | tail -8 ;;
decode)
  log "decode TP=1"
  timeout 300 $PYP python3 -m bench.decode --preset llama3_8b --weights fp8 \
    --tp 1 --step both --allreduce psum --baselines none --fused off --loops pipelined,sync \
    --no-sweep --no-trace --breakdown --out "$OUT/dec1" 2>&1 | quiet | tail -25 ;;
decode2)
  log "decode TP=2 shapes"
  timeout 240 $PYP python3 -m bench.decode --preset llama3_8b --weights fp8 \
    --tp 1 --shapes tp2_rank --step both --allreduce psum --baselines none --fused off --loops pipelined \
    --no-sweep --no-trace --out "$OUT/dec2" 2>&1 | quiet | tail -20 ;;
gemv)
  log gemv
  timeout 150 $PYP python3 -m bench.gemv --tp 1 2 --out "$OUT/gemv" 2>&1 | quiet | tail -16 ;;
probe)
  log "probe: ranks timing"
  timeout 200 $PYP python3 probe_ranks.py 2>&1 | quiet | grep -E "probe_ranks|Error|error" | tail -12 ;;
sanitize)
  log sanitize
  timeout 280 bash tools/sanitize_llama_step.sh 2>&1 | tail -16 ;;
  esac
done
log done
