// The persistent step's grid barrier: bounded, monotonic (one counter per launch, zeroed by
// the op; the k-th barrier waits for k * gridDim.x arrivals), among the consumer threads.
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

// Every block's writes before it are visible to every block after it: a barrier of the block's
// consumer threads, one thread's gpu-scope release (cumulative over the block's writes through
// bar.sync), its acquire of the count (a bounded wait: Deadline), a barrier of the consumers.
__device__ __forceinline__ void GridSync(unsigned* counter, unsigned target) {
  BlockSync();
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
    unsigned v;
    Deadline d;
    while (true) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
      if (v >= target) break;
      d.Tick();
    }
  }
  BlockSync();
}

}  // namespace phase
}  // namespace cuda
}  // namespace sifar
