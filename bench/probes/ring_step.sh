#!/usr/bin/env bash
# Probe driver (leaves the tree with ring_stream.cu): one device call that (1) runs the ring
# probe, (2) picks the consumers' e4m3 decode and rows per warp from it (the fastest full
# chain at TP=1, where >= 2% ahead of cvt at 2 rows), (3) builds the extension with them
# (ffi/step edited in this copy of the tree only; CUDA for sm_90 only),
# (4) runs the persistent step's GPU tests and (5) bench.decode's FP8 TP=1 rows, XLA step and
# persistent step in one run, (6) TP=2's per-rank shapes, (7) the step's sanitizer script.
#   OUT=/tmp/o bash bench/probes/ring_step.sh [probe build tests decode decode2 sanitize gemv long8b phases]
# phases: the kernel's per-phase time (printf from block 0; rebuilds with step-phases.patch).
# gemv: bench.gemv, then fp8_matvec with the PairsMul decode (its GPU bit tests, bench.gemv).
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
  grep -E "device|d2d|^\[|ms|rows per|fail" "$OUT/probe.txt" | head -60 ;;
build)
  pick=${PICK:-}
  if [[ -z $pick ]]; then
    pick=$(python3 - "$OUT" <<'PY'
import re, sys
t = {}
for r in (2, 4, 16):
    try: lines = open(f"{sys.argv[1]}/ring{r}.log").read().split("\n")
    except OSError: continue
    for line in lines:
        if line.startswith("[tp2"): break
        m = re.match(r"ring (cvt|bits|pairs|pairsmul|hybridmul)\s+([\d.]+) ms.*bits equal|ring (cvt)\s+([\d.]+) ms.*reference", line)
        if m:
            name, ms = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            t[(name, r)] = float(ms)
base = t.get(("cvt", 2))
best = min(t, key=t.get) if t else ("cvt", 2)
print(*(best if base and t[best] < 0.98 * base else ("cvt", 2)))
PY
)
  fi
  read -r dot variant <<< "$pick"
  log "build: dot=$dot variant=$variant (2: 2 rows per warp, 4: 4 rows per warp, 16: 16 warps)"
  echo "$dot $variant" > "$OUT/pick.txt"
  [[ $variant == 4 ]] && sed -i "s/constexpr int kWarpRows = 2;/constexpr int kWarpRows = 4;/" ffi/step/ring_gemv.cuh
  [[ $variant == 16 ]] && sed -i "s/constexpr int kThreads = 256;/constexpr int kThreads = 512;/" ffi/step/llama_step.h
  if [[ $dot != cvt ]]; then
    D=$(python3 -c "print({'bits': 'BitsDot', 'pairs': 'PairsDot', 'pairsmul': 'PairsMulDot', 'hybridmul': 'HybridMulDot'}['$dot'])")
    sed -i "s/^using Dot = CvtDot; /using Dot = $D; /; s|#include \"step/ring_gemv.cuh\"|#include \"step/ring_gemv.cuh\"\n#include \"../../bench/probes/dots.cuh\"|" ffi/step/cuda_llama_step.cu
  fi
  grep -n "^using Dot\|dots.cuh" ffi/step/cuda_llama_step.cu; grep -n "kWarpRows = " ffi/step/ring_gemv.cuh; grep -n "kThreads = " ffi/step/llama_step.h
  BUILD_BEFORE=0 OUT=/tmp/v bash tools/validate_ffi.sh build 2>&1 | tail -5 ;;
tests)
  log tests
  timeout 200 env PYTHONPATH="$PWD/src:$PWD" python3 -m pytest -q -rs -p no:cacheprovider \
    tests/models/test_persistent.py -m "not slow" 2>&1 | quiet | tail -15 ;;
long8b)
  log "8B shapes against the XLA step"
  timeout 300 env PYTHONPATH="$PWD/src:$PWD" python3 -m pytest -q -s -rs -p no:cacheprovider \
    tests/models/test_persistent.py -k 8b 2>&1 | quiet | grep -E "8b:|passed|failed|Error|assert" | tail -8 ;;
decode)
  log "decode TP=1"
  timeout 300 env PYTHONPATH="$PWD/src:$PWD" python3 -m bench.decode --preset llama3_8b --weights fp8 \
    --tp 1 --step both --allreduce psum --baselines none --fused off --loops pipelined,sync \
    --no-sweep --no-trace --breakdown --out "$OUT/dec1" 2>&1 | quiet | tail -25 ;;
decode2)
  log "decode TP=2 shapes"
  timeout 240 env PYTHONPATH="$PWD/src:$PWD" python3 -m bench.decode --preset llama3_8b --weights fp8 \
    --tp 1 --shapes tp2_rank --step both --allreduce psum --baselines none --fused off --loops pipelined \
    --no-sweep --no-trace --out "$OUT/dec2" 2>&1 | quiet | tail -20 ;;
gemv)  # fp8_matvec's decode as PairsMul (fp8mv-pairsmul.patch) against the product's, one call
  log "gemv before"
  timeout 150 env PYTHONPATH="$PWD/src:$PWD" python3 -m bench.gemv --tp 1 2 --out "$OUT/gemv0" 2>&1 | quiet | tail -14
  git apply bench/probes/fp8mv-pairsmul.patch && log "gemv: PairsMul decode applied" || exit 1
  BUILD_BEFORE=0 OUT=/tmp/v bash tools/validate_ffi.sh build 2>&1 | tail -3
  timeout 150 env PYTHONPATH="$PWD/src:$PWD" python3 -m pytest -q -x -p no:cacheprovider \
    tests/sifar_jax/test_fp8_matvec.py 2>&1 | quiet | tail -4
  log "gemv after"
  timeout 150 env PYTHONPATH="$PWD/src:$PWD" python3 -m bench.gemv --tp 1 2 --out "$OUT/gemv1" 2>&1 | quiet | tail -14 ;;
phases)  # the kernel's time per phase (block 0's clock at each grid barrier, step-phases.patch)
  git apply bench/probes/step-phases.patch && log "phases: patch applied" || exit 1
  BUILD_BEFORE=0 OUT=/tmp/v bash tools/validate_ffi.sh build 2>&1 | tail -2
  for shapes in full tp2_rank; do
  timeout 200 env PYTHONPATH="$PWD/src:$PWD" SHAPES=$shapes python3 - <<'PY' 2>&1 | quiet > "$OUT/phases_$shapes.txt"
import os, numpy as np
from models import Decoder, make_mesh
from models.families import FAMILIES
from models.options import DecodeOptions
from bench.decode import tp2_rank_config
L = FAMILIES["llama"]
cfg = L.preset("llama3_8b")
if os.environ["SHAPES"] == "tp2_rank":
    cfg = tp2_rank_config(cfg)
mesh = make_mesh(1)
dec = Decoder(cfg, mesh, L.random_params(cfg, mesh, seed=0, quantize="fp8"),
              DecodeOptions(kv_layout="bhsd", step="persistent"))
dec.reset(2048); dec.randomize_cache(1); dec.seek(1000, np.array([5]))
for t in range(24):
    np.asarray(dec.step(np.array([t + 7])))
PY
  python3 - "$OUT/phases_$shapes.txt" $shapes <<'PY'
import re, sys, statistics
rows = [list(map(int, re.findall(r"\d+", l))) for l in open(sys.argv[1]) if l.startswith("phases_ns")]
rows = rows[-16:]
names = "qkv attn o gate_up down final head".split()
if not rows: print("phases: no output", open(sys.argv[1]).read()[-800:]); sys.exit()
med = [statistics.median(r[i] for r in rows) / 1e3 for i in range(7)]
print(sys.argv[2], "phases us (median of", len(rows), "launches):", {n: round(v, 1) for n, v in zip(names, med)}, "total", round(sum(med), 1))
PY
  done ;;
sanitize)
  log sanitize
  timeout 280 bash tools/sanitize_llama_step.sh 2>&1 | tail -16 ;;
  esac
done
log done
