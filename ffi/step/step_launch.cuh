// The persistent steps' launch geometry (host code shared by cuda_llama_step.cu and
// cuda_qwen3_moe_step.cu): the block's threads, its shared memory (the GEMV input or the
// attention's scratch, then the ring's stages), the cooperative grid that fits, and the
// SIFAR_STEP_MAX_BLOCKS cap.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>

#include "step/device_math.cuh"
#include "step/llama_step.h"
#include "step/ring_gemv.cuh"

namespace sifar {
namespace cuda {

constexpr int kBlockThreads = phase::kThreads + 32;  // the consumers, then the producer warp

using phase::kHeadDim;
using phase::kStageBytes;
using phase::kWarps;

inline size_t AttentionSmem(const step::Shape& s) {
  return sizeof(float) * (static_cast<size_t>(s.group) * kHeadDim + 2 * kHeadDim +
                          static_cast<size_t>(kWarps) * s.group * (kHeadDim + 2));
}

// The block's shared memory: the GEMV input (or the attention's scratch), then the ring's
// stages (as many as fit, at most kMaxStages) and their 2 mbarriers each.
constexpr int kMaxStages = 8;
struct Smem {
  size_t xs = 0, total = 0;
  int stages = 0;
};

// The cooperative grid on this device (one block per SM; 0 blocks: it does not fit), or the
// CUDA error that stopped the query.
template <class Kernel>
cudaError_t GridBlocks(Kernel kernel, const step::Shape& s, Smem* sm, int* blocks) {
  *blocks = 0;
  int dev = 0, sms = 0, coop = 0, optin = 0, per_sm = 0;
  cudaFuncAttributes attr;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, kernel);
  if (e != cudaSuccess) return e;
  sm->xs = (std::max(sizeof(float) * static_cast<size_t>(s.max_k()), AttentionSmem(s)) + 127) / 128 * 128;
  const size_t per_stage = kStageBytes + 2 * sizeof(uint64_t);
  const size_t used = sm->xs + attr.sharedSizeBytes;
  sm->stages = used < static_cast<size_t>(optin)
                   ? static_cast<int>(std::min<size_t>(kMaxStages, (optin - used) / per_stage))
                   : 0;
  if (sm->stages < 2 || !coop) return cudaSuccess;  // no room for a ring of two stages
  sm->total = sm->xs + sm->stages * per_stage;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(sm->total));
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlockThreads, sm->total);
  if (e == cudaSuccess) *blocks = per_sm * sms;
  return e;
}

// SIFAR_STEP_MAX_BLOCKS (read once per process): at most this many blocks in the step's grid
// (unset or 0: one block per SM). Ranks of a step across devices that share one GPU under MPS
// need grids that fit beside each other (a cooperative grid that fills the GPU leaves the
// other rank's no room: it waits until the first one's timeout); without MPS their contexts
// take turns on the GPU, whatever the grid (docs/step_across_devices.md, "One GPU, two
// processes").
inline int StepMaxBlocks() {
  static const int cap = [] {
    const char* v = std::getenv("SIFAR_STEP_MAX_BLOCKS");
    return v ? std::max(0, std::atoi(v)) : 0;
  }();
  return cap;
}

}  // namespace cuda
}  // namespace sifar
