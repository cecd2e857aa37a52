#!/usr/bin/env bash
# One device call (2x H200): the fused kernel without the cluster exchange at two ranks
# (FusedRowKernel): build, the GPU tests of the fused call and of ordering first (nothing is
# measured if they fail), then the layer-tail probe and the decode loops pipelined/on_device.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TQDM_DISABLE=1 PYTHONUNBUFFERED=1
LOG="$OUT/run.log"; : >"$LOG"; T0=$(date +%s)
stage() { echo "=== +$(( $(date +%s) - T0 ))s $*" | tee -a "$LOG"; }
stage build; python3 -m pip install --no-build-isolation --no-deps -q -e . >/tmp/build.log 2>&1 || { tail -30 /tmp/build.log | tee -a "$LOG"; exit 1; }
stage tests
timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_fused.py tests/test_ordering.py -k gpu \
  2>&1 | grep -v "^[WI][0-9]\{4\}" >"$OUT/tests.log"; rc=${PIPESTATUS[0]}
tail -3 "$OUT/tests.log" | tee -a "$LOG"
if (( rc != 0 )); then grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests.log" | head -30 | tee -a "$LOG"; stage "tests failed: nothing measured"; exit 1; fi
stage "layer tail"
timeout 80 python3 -m bench.probes.layer_tail --out "$OUT/layer-tail-rowpull.json" 2>&1 | grep -v "^[WI][0-9]\{4\}" | tee -a "$LOG"
stage decode
timeout 110 python3 -m bench.decode --tp 2 --no-sweep --loops pipelined,on_device --out "$OUT/decode" 2>&1 \
  | grep -v "^[WI][0-9]\{4\}" | tail -2 | tee -a "$LOG"
stage done
