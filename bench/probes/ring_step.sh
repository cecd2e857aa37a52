#!/usr/bin/env bash
# Probe driver (leaves the tree with ring_stream.cu): one device call that (1) runs the ring
# probe, (2) picks the consumers' e4m3 decode from it (integer ops where they were >= 3%
# faster on the TP=1 chain), (3) builds the extension with it (CUDA for sm_90 only),
# (4) runs the persistent step's GPU tests and (5) bench.decode's FP8 TP=1 rows, XLA step and
# persistent step in one run, (6) TP=2's per-rank shapes, (7) the step's sanitizer script.
#   OUT=/tmp/o bash bench/probes/ring_step.sh [probe build tests decode decode2 sanitize]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/ring}; mkdir -p "$OUT"; T0=$(date +%s)
log() { echo "=== +$(( $(date +%s) - T0 ))s $*"; }
steps=("$@"); [[ ${#steps[@]} -eq 0 ]] && steps=(probe build tests decode)
quiet() { grep -v "^[WI][0-9]\{4\}\|^\[[0-9]\] [WI][0-9]\{4\}"; }
for step in "${steps[@]}"; do
  case $step in
probe)
  log probe; OUT=$OUT bash bench/probes/ring_stream.sh > "$OUT/probe.txt" 2>&1
  grep -E "device|d2d|^\[|ms" "$OUT/probe.txt" | head -30
  rm -f "$OUT/sass_mix.txt" "$OUT/gpu.txt" ;;
build)
  dec=${DECODE:-}
  if [[ -z $dec ]]; then
    dec=$(python3 - "$OUT/ring.log" <<'PY'
import re, sys
t = {}
for line in open(sys.argv[1]):
    if line.startswith("[tp2"): break
    m = re.match(r"ring, (cvt|integer) decode\s+([\d.]+) ms", line)
    if m: t[m.group(1)] = float(m.group(2))
print(1 if "integer" in t and "cvt" in t and t["integer"] < 0.97 * t["cvt"] else 0)
PY
)
  fi
  log "build: SIFAR_STEP_DECODE=$dec"
  echo "$dec" > "$OUT/decode_choice.txt"
  CUDAFLAGS="-DSIFAR_STEP_DECODE=$dec" BUILD_BEFORE=0 OUT=/tmp/v bash tools/validate_ffi.sh build 2>&1 | tail -5 ;;
tests)
  log tests
  timeout 200 env PYTHONPATH="$PWD/src:$PWD" python3 -m pytest -q -rs -p no:cacheprovider \
    tests/models/test_persistent.py 2>&1 | quiet | tail -15 ;;
decode)
  log "decode TP=1"
  timeout 300 env PYTHONPATH="$PWD/src:$PWD" python3 -m bench.decode --preset llama3_8b --weights fp8 \
    --tp 1 --step both --allreduce psum --baselines none --fused off --loops pipelined,sync \
    --no-sweep --no-trace --out "$OUT/dec1" 2>&1 | quiet | tail -25 ;;
decode2)
  log "decode TP=2 shapes"
  timeout 240 env PYTHONPATH="$PWD/src:$PWD" python3 -m bench.decode --preset llama3_8b --weights fp8 \
    --tp 1 --shapes tp2_rank --step both --allreduce psum --baselines none --fused off --loops pipelined \
    --no-sweep --no-trace --out "$OUT/dec2" 2>&1 | quiet | tail -20 ;;
sanitize)
  log sanitize
  timeout 280 bash tools/sanitize_llama_step.sh 2>&1 | tail -16 ;;
  esac
done
log done
