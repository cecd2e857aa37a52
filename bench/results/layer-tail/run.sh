#!/usr/bin/env bash
# One device call (2x H200): the layer-tail probe (norm alone, lax.psum + norm, sifar + norm,
# fused) on the committed kernels, then the fused kernel rebuilt with the timing-only
# variants of fused-timing-experiment.patch (1: no cluster exchange, 2: no row sum either,
# 3: and no cluster launch; their norms are wrong by design), the probe's fused and
# sifar+norm rows each time. The patch is reverted at the end. Between them: bench.decode's
# four loops at TP 2 and 1 on the committed kernels.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TQDM_DISABLE=1 PYTHONUNBUFFERED=1
LOG="$OUT/run.log"; : >"$LOG"; T0=$(date +%s)
stage() { echo "=== +$(( $(date +%s) - T0 ))s $*" | tee -a "$LOG"; }
probe() { timeout 90 python3 -m bench.probes.layer_tail --out "$OUT/layer-tail-$1.json" "${@:2}" 2>&1 \
          | grep -v "^[WI][0-9]\{4\}" | tee -a "$LOG"; }
stage build; python3 -m pip install --no-build-isolation --no-deps -q -e . >/tmp/build.log 2>&1 || tail -20 /tmp/build.log
stage "probe (committed kernels)"; probe committed
stage "decode loops (committed kernels)"
timeout 150 python3 -m bench.decode --tp 2 1 --no-sweep --out "$OUT/decode" 2>&1 | grep -v "^[WI][0-9]\{4\}" | tail -3 | tee -a "$LOG"
patch -p1 -s < bench/results/layer-tail/fused-timing-experiment.patch
for e in 1 2 3; do
  stage "build (SIFAR_FUSED_EXP=$e)"
  python3 -m pip install --no-build-isolation --no-deps -q -e . \
    --config-settings=cmake.define.CMAKE_CUDA_FLAGS=-DSIFAR_FUSED_EXP=$e >/tmp/build-$e.log 2>&1 || tail -20 /tmp/build-$e.log
  stage "probe (exp $e)"; probe exp$e --variants sifar+norm,fused,norm
done
patch -p1 -R -s < bench/results/layer-tail/fused-timing-experiment.patch
stage done
