#!/usr/bin/env bash
# Probe driver (leaves the tree with ring_stream.cu): build and run the ring probe on one GPU,
# then the instruction mix of each chain kernel's SASS. OUT=/tmp/o bash bench/probes/ring_stream.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/ring}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv | tee "$OUT/gpu.txt"
INC=$(python3 -c 'import jax.ffi; print(jax.ffi.include_dir())')
nvcc -O3 -std=c++17 -arch=sm_90 -Iffi -I"$INC" -diag-suppress 940,2473 bench/probes/ring_stream.cu -o /tmp/rs || exit 1
timeout 300 /tmp/rs 2>&1 | tee "$OUT/ring.log"
cuobjdump -sass /tmp/rs > /tmp/rs.sass
python3 - <<'PY' | tee "$OUT/sass_mix.txt"
import re, collections
cur, mix = None, collections.defaultdict(collections.Counter)
for line in open("/tmp/rs.sass"):
    m = re.search(r"Function : (\S+)", line)
    if m: cur = m.group(1); continue
    m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
    if m and cur: mix[cur][m.group(1)] += 1
for f, c in mix.items():
    if "Chain" in f:
        print(f, sum(c.values()), dict(c.most_common(18)))
PY
