#!/usr/bin/env bash
# Probe (leaves the tree in the next commit): timing-only variants of the persistent kernel, by sed on
# the working copy, each built and timed with bench/probes/persistent_step_time.py (outputs wrong by
# design except base, A and B, whose GPU tests ran). One H200 call each: docs/performance.md.
# The seds match ffi/step/cuda_llama_step.cu as it was from e1f7d15 to 59a54b9 (one file, before
# its phases moved into headers); persistent_step_variant_b.cu is that file with variant B.
#   bash bench/probes/persistent_step_variants.sh   (OUT: a results folder; one GPU)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 TQDM_DISABLE=1 PYTHONUNBUFFERED=1
F=ffi/step/cuda_llama_step.cu
cp $F /tmp/orig.cu
run() {
  echo "=== variant $1"
  touch $F
  python3 -m pip install --no-build-isolation --no-deps -e . > $OUT/build-$1.log 2>&1 || { tail -20 $OUT/build-$1.log; return; }
  timeout 60 python3 bench/probes/persistent_step_time.py 1 1024 2>&1 | grep -v "^[WI][0-9]\{4\}" | tail -1
}
rm -rf build
run base
cp /tmp/orig.cu $F; sed -i 's/^    Attention<G>(P, l, reinterpret_cast<float\*>(smem4), &flag, pos, start);/    \/\/ no attention/' $F; grep -c "no attention" $F; run no_attention
cp /tmp/orig.cu $F; sed -i 's/StageNorm(xs, rin, L.input_norm, s.hidden, s.eps, red);/StageX(xs, rin, s.hidden);/; s/StageNorm(xs, P.resid, L.post_norm, s.hidden, s.eps, red);/StageX(xs, P.resid, s.hidden);/' $F; grep -c "StageX(xs, rin" $F; run no_norms
cp /tmp/orig.cu $F; sed -i 's/^    Attention<G>(P, l, reinterpret_cast<float\*>(smem4), &flag, pos, start);/    \/\/ no attention/; s/auto sync = \[&\]() { GridSync(P.counters, ++bars \* gridDim.x); };/auto sync = [\&]() { __syncthreads(); };/' $F; grep -c "__syncthreads(); };" $F; run no_attention_no_barriers
cp /tmp/orig.cu $F
# the attention variants
sed -i 's/^constexpr int kKeysPerSplit = 64;/constexpr int kKeysPerSplit = 32;/; s/^#pragma unroll 8$/#pragma unroll 16/' $F
grep -n "kKeysPerSplit = \|unroll 16" $F | head -3
run A
cp bench/probes/persistent_step_variant_b.cu $F
run B
