// Launching one rank's fused kernel (psum_add_rmsnorm): the CUDA handler's
// path after PlanFusedCall, shared with the test harness that runs several
// ranks on one GPU (bindings/testing_gpu.cc).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "allreduce/plan.h"
#include "fused/fused.h"

namespace sifar {

// A fused launch's shape: what LaunchRankFused enqueues, and what its error
// names.
struct FusedLaunch {
  int grid = 0;          // thread blocks, the prefetch blocks included
  uint32_t cluster = 0;  // thread blocks per cluster (1: none)
  uint32_t group = 0;    // the protocol's blocks per thread block
};

// Enqueues the fused kernel of `call` and `fused` (as PlanFusedCall fills
// them, or a test harness by hand) on `stream` (no host synchronisation;
// CUDA-graph safe); `launch` receives its shape.  A shape the kernel does not
// hold is refused (cudaErrorInvalidValue) before any launch.
cudaError_t LaunchRankFused(const RankCall& call, const FusedCall& fused, cudaStream_t stream,
                            FusedLaunch& launch);

}  // namespace sifar
