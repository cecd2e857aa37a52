#!/usr/bin/env bash
# The GPU suite, each command sized for one 10-minute device call; one log (run.log) and the
# result files land in $OUT.
#   bash bench/gpu_host_run.sh                  # build, bench.allreduce (peers, trace), bench.decode
#   bash bench/gpu_host_run.sh build tests mp   # the GPU tests and one process per GPU
#   bash bench/gpu_host_run.sh --quick ...      # the same on a CPU machine (quick variants)
#   bash bench/gpu_host_run.sh steptp           # >= 2 GPUs: the persistent step across them,
#   bash bench/gpu_host_run.sh steptp-rows      # FP8 / bf16 rows; one 10-minute call each
# Steps: build tests allreduce decode mp steptp steptp-rows. steptp: bench.decode --preset
# llama3_8b --quantize fp8 --step both at TP = 2, 4, 8 as the GPUs allow: the persistent step
# with sifar and with oneshot inside beside the XLA decoders psum / sifar / sifar+fused, batch 1,
# the loops' point only (pipelined, KV length 1024); steptp-rows: the same with --to-rows (bf16
# projections held as rows). With --quick (a CPU): llama_step_tiny at TP=2 on host devices, the
# op's CPU reference. Environment: OUT (/tmp/sifar-out), PYTHON (python3), ALLREDUCE_ARGS,
# DECODE_ARGS, MP_ARGS, STEPTP_ARGS, TESTS_ARGS (pytest arguments in place of the GPU tests),
# BUILD_/TESTS_/ALLREDUCE_/DECODE_/MP_/STEPTP_TIMEOUT (seconds per step), SUITE_BUDGET_S (570: every
# step's timeout is cut to what is left; a step that cannot start in time is skipped, saying so).
# NVLink multicast stays off: its three switches are forced off, logged as found and as used.
set -uo pipefail
export PYTHONUNBUFFERED=1
export TQDM_DISABLE=1  # progress bars are noise in a log

quick=0
if [[ "${1:-}" == "--quick" ]]; then
  quick=1
  shift
fi
steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(build allreduce decode)
n_gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU " || true)

OUT="${OUT:-/tmp/sifar-out}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
LOG="$OUT/run.log"
: >"$LOG"
BUDGET="${SUITE_BUDGET_S:-570}"
T0=$(date +%s)

log() { echo "=== $(date -u +%H:%M:%S) (+$(( $(date +%s) - T0 ))s) $*" | tee -a "$LOG"; }
# XLA's and absl's info/warning lines (I1130 ..., W1130 ...) stay out of the log.
quiet() { grep -v "^[WI][0-9]\{4\}" | tee -a "$LOG"; }
# run_step NAME DEFAULT_TIMEOUT CMD...: runs CMD with the step's timeout cut to the budget left.
run_step() {
  local name="$1" want="$2"
  shift 2
  local left=$(( BUDGET - ($(date +%s) - T0) - 15 ))
  if (( left < 30 )); then
    log "$name: SKIPPED, only $(( left + 15 )) s of the ${BUDGET} s budget left"
    return
  fi
  local t=$(( want < left ? want : left ))
  log "$name (timeout ${t} s): $*"
  timeout --kill-after=10 "$t" "$@" 2>&1 | quiet | tail -40
  local rc=${PIPESTATUS[0]}
  if (( rc == 124 || rc == 137 )); then
    log "$name: TIMED OUT after ${t} s"
  elif (( rc != 0 )); then
    log "$name: exit code $rc"
  fi
}

log "host ($([[ $quick == 1 ]] && echo quick || echo full) suite: ${steps[*]}; budget ${BUDGET} s)"
{
  switches() { for v in NCCL_NVLS_ENABLE NVSHMEM_DISABLE_NVLS TORCH_SYMM_MEM_DISABLE_MULTICAST; do
    printf ' %s=%s' "$v" "${!v-<unset>}"; done; echo; }
  echo "multicast switches as found:$(switches)"
  export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  echo "multicast switches as used: $(switches)"
  echo "kernel: $(uname -srm); cores: $(nproc)"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,clocks.max.sm \
      --format=csv 2>&1
    nvidia-smi topo -m 2>&1 | head -12
  else
    echo "nvidia-smi: not found"
  fi
  command -v nvcc >/dev/null 2>&1 && nvcc --version | tail -2 || echo "nvcc: not found"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '-')"
  # The device tool copies the working tree, not always its .git: the sources' own hash
  # says which code ran (compare with the same command in a checkout).
  echo "sources: $(find ffi src/sifar_jax models bench/*.py CMakeLists.txt pyproject.toml -type f \
    \( -name '*.py' -o -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' -o -name '*.txt' \
    -o -name '*.toml' \) 2>/dev/null | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-12)"
  "$PYTHON" -c "import importlib, platform; print('python', platform.python_version())
for m in ('jax', 'jaxlib', 'numpy', 'ml_dtypes', 'flax', 'tqdm', 'torch'):
    try: print(m, importlib.import_module(m).__version__)
    except Exception as e: print(m, '-', type(e).__name__)"
} 2>&1 | tee -a "$LOG"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

quick_arg=()
[[ $quick == 1 ]] && quick_arg=(--quick)
# steptp: the TP sizes the GPUs allow (>= 2), or TP=2 on host devices with --quick
steptp_tps=()
for t in 2 4 8; do (( t <= n_gpus )) && steptp_tps+=("$t"); done
[[ $quick == 1 && ${#steptp_tps[@]} -eq 0 ]] && steptp_tps=(2)
steptp() {  # steptp NAME WEIGHTS_FLAG...: one bench.decode run of the persistent rows
  local name="$1"
  shift
  if (( ${#steptp_tps[@]} == 0 )); then
    log "$name: SKIPPED, needs >= 2 GPUs (found $n_gpus)"
    return
  fi
  local preset=(--preset llama3_8b --context 1024 --samples 4 --tokens 32)
  # (--kv-layout bhsd: XLA:CPU's default is bshd; one layout gives every row the same cache)
  [[ $quick == 1 ]] && preset=(--quick --preset llama_step_tiny --context 256 --samples 2 \
    --kv-layout bhsd)
  # shellcheck disable=SC2086
  run_step "$name" "${STEPTP_TIMEOUT:-540}" \
    "$PYTHON" -m bench.decode "${preset[@]}" "$@" --step both --step-allreduce sifar,oneshot \
    --tp "${steptp_tps[@]}" --batch 1 --loops pipelined --no-sweep --allreduce psum,sifar \
    --baselines none --fused auto --no-trace --out "$OUT/$name" ${STEPTP_ARGS:-}
}
for step in "${steps[@]}"; do
  case "$step" in
    build)
      if [[ $quick == 1 ]] && "$PYTHON" -c "import sifar_jax._ext" >/dev/null 2>&1; then
        log "build: skipped (--quick and the extension imports)"
      else
        run_step build "${BUILD_TIMEOUT:-300}" \
          "$PYTHON" -m pip install --no-build-isolation --no-deps -q -e .
      fi ;;
    tests)
      if [[ -n "${TESTS_ARGS:-}" ]]; then
        # shellcheck disable=SC2086
        run_step "tests ($TESTS_ARGS)" "${TESTS_TIMEOUT:-300}" \
          "$PYTHON" -m pytest -q -rs -p no:cacheprovider $TESTS_ARGS
        continue
      fi
      # The GPU-only files, then the GPU parameters of the files that run on both.
      run_step "tests" "${TESTS_TIMEOUT:-300}" \
        "$PYTHON" -m pytest -q -rs -s -p no:cacheprovider tests/sifar_jax/test_gpu.py tests/sifar_jax/test_buffers.py
      run_step "tests (gpu parameters)" "${TESTS_TIMEOUT:-300}" \
        "$PYTHON" -m pytest -q -rs -s -p no:cacheprovider tests/sifar_jax/test_ordering.py tests/sifar_jax/test_fused.py \
        tests/sifar_jax/test_transforms.py tests/sifar_jax/test_multiprocess.py -k gpu ;;
    allreduce)
      # shellcheck disable=SC2086
      run_step "bench.allreduce" "${ALLREDUCE_TIMEOUT:-480}" \
        "$PYTHON" -m bench.allreduce ${quick_arg[@]+"${quick_arg[@]}"} --out "$OUT" ${ALLREDUCE_ARGS:-} ;;
    decode)
      # the loops at batch 1 (every variant), then batch x KV length (psum, sifar, identity)
      # shellcheck disable=SC2086
      run_step "bench.decode" "${DECODE_TIMEOUT:-480}" \
        "$PYTHON" -m bench.decode ${quick_arg[@]+"${quick_arg[@]}"} --out "$OUT/decode" \
        ${DECODE_ARGS:-} ;;
    mp)
      # One process per GPU (CPU: 2 processes of XLA:CPU devices).
      nproc_mp=$(( n_gpus >= 2 ? n_gpus : 2 ))
      # shellcheck disable=SC2086
      run_step "bench.allreduce, $nproc_mp processes" "${MP_TIMEOUT:-240}" \
        "$PYTHON" -m sifar_jax.launch -n "$nproc_mp" -- "$PYTHON" -m bench.allreduce \
        ${quick_arg[@]+"${quick_arg[@]}"} --peers none --no-trace --out "$OUT/mp" \
        ${MP_ARGS:---sizes 8,32 --algorithms sifar,sifar_push,lax.psum}
      # shellcheck disable=SC2086
      run_step "bench.decode, $nproc_mp processes" "${MP_TIMEOUT:-240}" \
        "$PYTHON" -m sifar_jax.launch -n "$nproc_mp" -- "$PYTHON" -m bench.decode \
        ${quick_arg[@]+"${quick_arg[@]}"} --no-sweep --fused off --out "$OUT/mp" ;;
    steptp)
      steptp steptp --quantize fp8 ;;
    steptp-rows)
      steptp steptp-rows --to-rows ;;
    *)
      log "unknown step '$step' (build, tests, allreduce, decode, mp, steptp, steptp-rows)" ;;
  esac
done

n=$(find "$OUT" -type f | wc -l)
log "done: $n files in $OUT"
ls -la "$OUT" | tee -a "$LOG"
if (( n > 8 )); then
  log "WARNING: more than 8 files in $OUT: the device tool brings back 8 at most"
fi
