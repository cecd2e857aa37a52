// The persistent step's grid barrier: bounded, monotonic (one counter per launch, zeroed by
// the op; the k-th barrier waits for k * gridDim.x arrivals).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "step/device_math.cuh"

namespace sifar {
namespace cuda {
namespace phase {

constexpr long long kSpinLimit = 1ll << 30;  // polls (~0.3-0.5 us each: minutes): a lost block traps

// Every block's writes before it are visible to every block after it: a CTA barrier, one
// thread's gpu-scope release (cumulative over the CTA's writes through bar.sync), its acquire
// of the count, a CTA barrier.
__device__ __forceinline__ void GridSync(unsigned* counter, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
    unsigned v;
    long long n = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
      if (++n > kSpinLimit) __trap();
    } while (v < target);
  }
  __syncthreads();
}

}  // namespace phase
}  // namespace cuda
}  // namespace sifar
