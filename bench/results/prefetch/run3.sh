#!/usr/bin/env bash
# Third device call (2x H200): the prefetch's issue path. E: per-line prefetch.global.L2::evict_last
# from every thread of 32 prefetch blocks; F: bulk prefetch (evict_last) from 16 blocks; G: per-line
# from 64 blocks. Each: step kernels (fused, default 16 MiB) and decode against pf0 in one run.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TQDM_DISABLE=1 PYTHONUNBUFFERED=1
R="$OUT/r"; mkdir -p "$R"; LOG="$OUT/run.log"; : >"$LOG"; T0=$(date +%s)
stage() { echo "=== +$(( $(date +%s) - T0 ))s $*" | tee -a "$LOG"; }
quiet() { grep -v "^[WI][0-9]\{4\}" ; }
echo "sources: $(cat ffi/* sifar_jax/*.py models/*.py | sha1sum | cut -c1-12)" | tee -a "$LOG"
build() { local name="$1"; shift
          python3 -m pip install --no-build-isolation --no-deps -q -e . "$@" >"$R/build-$name.log" 2>&1 \
          || { tail -30 "$R/build-$name.log" | tee -a "$LOG"; exit 1; }; }
kernels() { timeout 90 python3 -m bench.probes.step_kernels --variants "$2" --top 4 --out "$R/sk-$1.json" 2>&1 \
            | quiet | tee -a "$LOG"; }
decode() { timeout 120 python3 -m bench.decode --tp 2 --no-sweep --loops pipelined,on_device --no-trace \
             --allreduce "$2" --prefetch-mib $3 --out "$R/dec-$1" 2>&1 | quiet \
             | grep -E "TP=2 batch" | tee -a "$LOG"; }
for v in "E -DSIFAR_PREFETCH_HINT=3" "F -DSIFAR_PREFETCH_BLOCKS=16" "G -DSIFAR_PREFETCH_HINT=3 -DSIFAR_PREFETCH_BLOCKS=64"; do
  set -- $v; name=$1; shift
  stage "build $name ($*)"; build "$name" "--config-settings=cmake.define.CMAKE_CUDA_FLAGS=$*"
  kernels "$name" sifar+fused
  decode "$name" sifar "0"
done
stage done
tar czf "$OUT/prefetch3.tgz" -C "$R" .
