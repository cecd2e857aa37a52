#!/usr/bin/env bash
# Probe driver (leaves the tree with ring_stream.cu): build and run the ring probe on one GPU
# at 2 and 4 rows per consumer warp (ring_gemv.cuh's kWarpRows) and with 16 consumer warps
# (llama_step.h's kThreads), each set in a copy of ffi/step,
# then the instruction mix of each chain kernel's SASS. OUT=/tmp/o bash bench/probes/ring_stream.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/ring}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv | tee "$OUT/gpu.txt"
INC=$(python3 -c 'import jax.ffi; print(jax.ffi.include_dir())')
# Variants: 2 rows per warp (the tree's ffi), 4 rows per warp, 16 consumer warps of 2 rows.
for v in 4 16; do
  rm -rf /tmp/ffi$v && mkdir -p /tmp/ffi$v && cp -r ffi/step /tmp/ffi$v/
done
sed -i 's/constexpr int kWarpRows = 2;/constexpr int kWarpRows = 4;/' /tmp/ffi4/step/ring_gemv.cuh
sed -i 's/constexpr int kThreads = 256;/constexpr int kThreads = 512;/' /tmp/ffi16/step/llama_step.h
grep -q "kWarpRows = 4;" /tmp/ffi4/step/ring_gemv.cuh && grep -q "kThreads = 512;" /tmp/ffi16/step/llama_step.h || exit 1
for v in ${VARIANTS:-2 4 16}; do
  inc=ffi; [[ $v != 2 ]] && inc=/tmp/ffi$v
  nvcc -O3 -std=c++17 -arch=sm_90 -I$inc -Iffi -Ibench/probes -I"$INC" -diag-suppress 940,2473 \
    bench/probes/ring_stream.cu -o /tmp/rs$v &
done
wait
for v in ${VARIANTS:-2 4 16}; do
  [[ -x /tmp/rs$v ]] || { echo "build $v failed"; continue; }
  timeout 200 /tmp/rs$v 2>&1 | tee "$OUT/ring$v.log"
  cuobjdump -sass /tmp/rs$v > /tmp/rs$v.sass
  python3 - /tmp/rs$v.sass <<'PY' | tee "$OUT/sass_mix$v.txt"
import re, sys, collections
cur, mix = None, collections.defaultdict(collections.Counter)
for line in open(sys.argv[1]):
    m = re.search(r"Function : (\S+)", line)
    if m: cur = m.group(1); continue
    m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
    if m and cur: mix[cur][m.group(1)] += 1
for f, c in mix.items():
    if "Chain" in f:
        print(f, sum(c.values()), dict(c.most_common(14)))
PY
done
