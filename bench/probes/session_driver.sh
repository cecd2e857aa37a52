#!/usr/bin/env bash
# Session driver of 2026-12-06, second session, last call (leaves the tree next commit): OUT=... bash bench/probes/session_driver.sh step...
# steps: info build ranks stress long8b decode decode2 gemv probe (PROBE=bench/probes/<file>) ncu ab8b (HEAD as a tarball in
# .before/head.tar.gz against this tree) tests sanitize
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
  timeout ${DECODE_S:-300} $PYP python3 -m bench.decode --preset llama3_8b --weights fp8 \
    --tp 1 --step both --allreduce psum --baselines none --fused off --loops ${LOOPS:-pipelined,sync} \
    --no-sweep --no-trace --out "$OUT/dec1" 2>&1 | quiet | tail -25 ;;
decode2)
  log "decode TP=2 shapes"
  timeout 240 $PYP python3 -m bench.decode --preset llama3_8b --weights fp8 \
    --tp 1 --shapes tp2_rank --step both --allreduce psum --baselines none --fused off --loops pipelined \
    --no-sweep --no-trace --out "$OUT/dec2" 2>&1 | quiet | tail -20 ;;
gemv)
  log gemv
  timeout 150 $PYP python3 -m bench.gemv --tp 1 2 --out "$OUT/gemv" 2>&1 | quiet | tail -16 ;;
probe)
  log "probe: ${PROBE:-bench/probes/l2_ahead_timing.py}"
  timeout 300 $PYP python3 ${PROBE:-bench/probes/l2_ahead_timing.py} 2>&1 | quiet | grep -E "probe_|Error|error" | tail -12 ;;
ab8b)
  log "A/B: HEAD (.before/head.tar.gz) against this tree"
  BUILD_BEFORE=1 BEFORE_TAR=.before/head.tar.gz OUT=/tmp/v bash tools/validate_ffi.sh build 2>&1 | tail -3
  for rnd in 1 2; do
    timeout 100 env PYTHONPATH=$PWD/.validate/before/src:$PWD/.validate/before python3 bench/probes/ab_timing.py A 2>&1 | grep -E "probe_|Error"
    timeout 100 $PYP python3 bench/probes/ab_timing.py B 2>&1 | grep -E "probe_|Error"
  done
  python3 -c "
import numpy as np, os
a, b = (np.load(os.path.join('$OUT', f'ab_{t}.npz')) for t in 'AB')
print('ab bits equal:', {k: bool(np.array_equal(a[k], b[k])) for k in a.files}, 'finite', bool(np.isfinite(b['logits']).all()))" ;;
sanitize)
  log sanitize
  timeout 280 bash tools/sanitize_llama_step.sh 2>&1 | tail -16 ;;
ncu)
  log "ncu: the step kernel once"
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu | head -1)
  timeout 400 $PYP $NCU --target-processes all --kernel-name regex:LlamaStep --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section SourceCounters --section InstructionStats --section Occupancy \
    -o "$OUT/step" python3 bench/probes/ncu_step.py 2>&1 | quiet | tail -12
  $NCU --import "$OUT/step.ncu-rep" --page details > "$OUT/details.txt" 2>&1; head -c 20000 "$OUT/details.txt"
  $NCU --import "$OUT/step.ncu-rep" --page source --csv --print-source sass > "$OUT/sass.csv" 2>&1; wc -c "$OUT/sass.csv" ;;
  esac
done
log done
