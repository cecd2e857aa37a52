// Launching the fused all-reduce + residual add + RMSNorm kernel
// (cuda_fused.cuh): one instance per element type and rank bound, rows longer
// than a block launched as thread-block clusters (cudaLaunchKernelEx, which
// CUDA graphs capture like any launch).
#include <cuda_runtime.h>

#include "allreduce/launch.h"
#include "core/cuda_check.h"
#include "fused/cuda_fused.cuh"

namespace sifar {
namespace {

using cuda::FusedArgs;
using cuda::kThreads;

// Blocks that only prefetch (cuda_fused.cuh). Measured in the decode step
// (2x H200): 16 gained most; 32 a little less; 64 made the call 5 -> 7.7 us,
// a loss.
constexpr int kPrefetchBlocks = 16;

template <typename T, int NR>
cudaError_t LaunchNR(const FusedArgs& f, int grid, cudaStream_t stream) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cuda::RowClusterLaunch(grid, f.row_blocks, stream, attr);
  return cudaLaunchKernelEx(&cfg, cuda::FusedKernel<T, NR>, f);
}
template <typename T>
cudaError_t Launch(const FusedArgs& f, int grid, cudaStream_t stream) {
  if (f.a.nranks <= 2) return LaunchNR<T, 2>(f, grid, stream);
  if (f.a.nranks <= 4) return LaunchNR<T, 4>(f, grid, stream);
  return LaunchNR<T, 8>(f, grid, stream);
}

template <typename T>
void LoadRow() {
  cudaFuncAttributes attr;
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, cuda::FusedKernel<T, 2>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, cuda::FusedKernel<T, 4>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, cuda::FusedKernel<T, 8>));
}

}  // namespace

cudaError_t LaunchRankFused(const RankCall& c, const FusedCall& fused, cudaStream_t stream) {
  if (c.comm == nullptr || c.algorithm != kSifar || c.nbytes % fused.row_bytes != 0 ||
      fused.row_blocks != FusedRowBlocks(fused.row_bytes) || fused.row_blocks == 0)
    return cudaErrorInvalidValue;
  FusedArgs f{};
  f.a = MakeKernelArgs(c);
  f.residual = fused.residual;
  f.weight = fused.weight;
  f.normed = fused.normed;
  f.row_lines = static_cast<uint32_t>(fused.row_bytes / 8);
  f.row_blocks = static_cast<uint32_t>(fused.row_blocks);
  f.hidden = static_cast<uint32_t>(fused.hidden);
  f.eps = fused.eps;
  f.prefetch = static_cast<const char*>(fused.prefetch);
  f.prefetch_bytes = fused.prefetch != nullptr ? fused.prefetch_bytes : 0;
  // The plain kernel's grid for this payload: a multiple of the cluster size,
  // since the payload is whole rows and kMaxBlocks whole clusters.
  const int grid = BlocksFor(c.nbytes / 8, kThreads);
  f.ar_blocks = static_cast<uint32_t>(grid);
  // Prefetch blocks: whole clusters after the all-reduce's.
  const int extra = f.prefetch_bytes == 0 ? 0
                    : (kPrefetchBlocks + f.row_blocks - 1) / f.row_blocks * f.row_blocks;
  switch (c.elem) {
    case Elem::kF32: return Launch<float>(f, grid + extra, stream);
    case Elem::kBf16: return Launch<__nv_bfloat16>(f, grid + extra, stream);
    case Elem::kF16: return Launch<__half>(f, grid + extra, stream);
    default: return cudaErrorInvalidValue;
  }
}

void PreloadFusedKernels() {
  LoadRow<float>();
  LoadRow<__nv_bfloat16>();
  LoadRow<__half>();
}

}  // namespace sifar
