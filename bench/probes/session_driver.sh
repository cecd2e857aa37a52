#!/usr/bin/env bash
# Session driver of 2026-12-06, third session (leaves the tree next commit); abn: A/B of .before/<V>.tar.gz builds against this tree: OUT=... bash bench/probes/session_driver.sh step...
# steps: info build ranks stress long8b decode decode2 gemv probe (PROBE=bench/probes/<file>) ncu ab8b (HEAD as a tarball in
# .before/head.tar.gz against this tree) tests sanitize
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/dev}; mkdir -p "$OUT"; T0=$(date +%s)
log() { echo "=== +$(( $(date +%s) - T0 ))s $*"; }
quiet() { grep --line-buffered -v "^[WI][0-9]\{4\}\|^\[[0-9]\] [WI][0-9]\{4\}"; }
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
    tests/models/test_persistent_ranks.py 2>&1 | quiet | grep --line-buffered -E "phases in|passed|failed|Error|assert|^E " | tail -30 ;;
stress)
  log "1M skewed phases per (ranks, allreduce)"
  SIFAR_STEP_STRESS_PHASES=${PHASES:-1000000} timeout 400 $PYP python3 -m pytest -q -rs -s -p no:cacheprovider \
    tests/models/test_persistent_ranks.py -k skewed 2>&1 | quiet | grep --line-buffered -E "phases in|passed|failed|Error|assert|^E " | tail -20 ;;
long8b)
  log "8B shapes against the XLA step"
  timeout 300 $PYP python3 -m pytest -q -s -rs -p no:cacheprovider \
    tests/models/test_persistent.py -k 8b 2>&1 | quiet | grep --line-buffered -E "8b:|passed|failed|Error|assert" | tail -8 ;;
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
  timeout 300 $PYP python3 ${PROBE:-bench/probes/l2_ahead_timing.py} 2>&1 | quiet | grep --line-buffered -E "probe_|Error|error" | tail -12 ;;
ab8b)
  log "A/B: HEAD (.before/head.tar.gz) against this tree"
  BUILD_BEFORE=1 BEFORE_TAR=.before/head.tar.gz OUT=/tmp/v bash tools/validate_ffi.sh build 2>&1 | tail -3
  for rnd in 1 2; do
    timeout 100 env PYTHONPATH=$PWD/.validate/before/src:$PWD/.validate/before python3 bench/probes/ab_timing.py A 2>&1 | grep --line-buffered -E "probe_|Error"
    timeout 100 $PYP python3 bench/probes/ab_timing.py B 2>&1 | grep --line-buffered -E "probe_|Error"
  done
  python3 -c "
import numpy as np, os
a, b = (np.load(os.path.join('$OUT', f'ab_{t}.npz')) for t in 'AB')
print('ab bits equal:', {k: bool(np.array_equal(a[k], b[k])) for k in a.files}, 'finite', bool(np.isfinite(b['logits']).all()))" ;;
abn)
  declare -A ENV_OF=([E]=SIFAR_STEP_AR1=1)
  log "A/B/..: .before/{${VARIANTS:-A B}}.tar.gz and this tree (C)"
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  bt() { cmake -S "$1" -B "$1/_build" "${gen[@]}" -DPython_EXECUTABLE="$(command -v python3)" -DSIFAR_ENABLE_CUDA=ON \
      -DSIFAR_CUDA_ARCHITECTURES=90-real -DCMAKE_BUILD_TYPE=Release >"$OUT/build_$2.log" 2>&1 &&
    cmake --build "$1/_build" -j 5 >>"$OUT/build_$2.log" 2>&1 && cp "$1"/_build/_sifar*.so "$1/src/sifar_jax/" && echo "built $2" || { tail -20 "$OUT/build_$2.log"; echo "BUILD FAILED $2"; }; }
  for v in ${VARIANTS:-A B}; do rm -rf .validate/v_$v; mkdir -p .validate/v_$v; tar -xzf .before/$v.tar.gz -C .validate/v_$v; bt $PWD/.validate/v_$v $v & done
  bt $PWD C & wait
  log built
  for rnd in 1 2; do for v in ${VARIANTS:-A B} C; do
    pp=$PWD/.validate/v_$v; [[ $v == C ]] && pp=$PWD
    timeout 100 env PYTHONPATH=$pp/src:$pp ${ENV_OF[$v]:-} python3 bench/probes/ab_timing.py $v 2>&1 | grep --line-buffered -E "probe_|Error"
  done; done
  python3 -c "
import numpy as np, os
vs = '${VARIANTS:-A B} C'.split()
d = {v: np.load(os.path.join('$OUT', f'ab_{v}.npz')) for v in vs}
for v in vs[1:]:
    print('bits', v, 'vs', vs[0], {k: bool(np.array_equal(d[vs[0]][k], d[v][k])) for k in d[v].files}, 'finite', bool(np.isfinite(d[v]['logits']).all()))" ;;
sass)  # what each fence and wait compiles to on sm_90
  cat > /tmp/fence_sass.cu <<'CU'
__global__ void k(unsigned* c, unsigned t, int* out) {
  unsigned v;
  while (true) { asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c) : "memory"); if (v >= t) break; }
  out[0] = v;
}
__global__ void k2(unsigned* c, unsigned t, int* out) {
  unsigned v;
  while (true) { asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c) : "memory"); if (v >= t) break; }
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
  out[0] = v;
}
__global__ void k3(unsigned* c) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(c) : "memory");
}
__global__ void k4(unsigned* c) {
  __threadfence();
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(c) : "memory");
}
__global__ void k5(unsigned* c, unsigned* o) {
  unsigned old; asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(c) : "memory"); *o = old;
}
CU
  nvcc -arch=sm_90 -cubin -o /tmp/fs.cubin /tmp/fence_sass.cu && cuobjdump -sass /tmp/fs.cubin | grep -E "Function|MEMBAR|LDG|RED|ATOM|CCTL|FENCE|ERRBAR|BAR|SYNCS" ;;
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
