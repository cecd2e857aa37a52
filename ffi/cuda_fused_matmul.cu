// Launching psum_add_rmsnorm_matmul (cuda_fused_matmul.cuh): a fixed grid per
// device, in clusters of the row's blocks as the fused call launches them
// (the all-reduce blocks need them; the matmul blocks ignore them).
#include <cuda_runtime.h>

#include <atomic>

#include "cuda_check.h"
#include "cuda_fused_matmul.cuh"
#include "launch.h"

namespace sifar {
namespace {

using cuda::MatmulArgs;
using cuda::kThreads;

// As many blocks as can be resident at once (the kernel's launch bounds allow
// kMatmulBlocksPerSM per SM; a cluster must fit one GPC, which can leave
// slots unused), so that a matmul block never waits for an all-reduce block
// that has no SM, nor for a second wave.  The same for every call (the
// blocks' call counts need it): the smallest over every cluster size, in
// whole clusters of the largest.  Per device, computed once.
int ComputeMatmulGrid() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return 0;
  int grid = sms * cuda::kMatmulBlocksPerSM;
  bool queried = false;
  for (int cluster = 2; cluster <= kMaxRowBlocks; cluster *= 2) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cuda::RowClusterLaunch(grid / cluster * cluster, cluster, 0, attr);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, cuda::FusedMatmulKernel<__nv_bfloat16, 2>,
                                       &cfg) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    queried = true;
    if (clusters * cluster < grid) grid = clusters * cluster;
  }
  if (!queried) return 0;  // no fit known: refuse the launch rather than guess
  if (grid > kMaxMatmulGrid) grid = kMaxMatmulGrid;
  return grid / kMaxRowBlocks * kMaxRowBlocks;
}

template <typename T, int NR>
cudaError_t LaunchNR(const MatmulArgs& m, int grid, cudaStream_t stream) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cuda::RowClusterLaunch(grid, m.f.row_blocks, stream, attr);
  return cudaLaunchKernelEx(&cfg, cuda::FusedMatmulKernel<T, NR>, m);
}
template <typename T>
cudaError_t Launch(const MatmulArgs& m, int grid, cudaStream_t stream) {
  if (m.f.a.nranks <= 2) return LaunchNR<T, 2>(m, grid, stream);
  if (m.f.a.nranks <= 4) return LaunchNR<T, 4>(m, grid, stream);
  return LaunchNR<T, 8>(m, grid, stream);
}

template <typename T>
void LoadRow() {
  cudaFuncAttributes attr;
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, cuda::FusedMatmulKernel<T, 2>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, cuda::FusedMatmulKernel<T, 4>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, cuda::FusedMatmulKernel<T, 8>));
}

}  // namespace

cudaError_t LaunchRankFusedMatmul(const RankCall& c, const FusedCall& fused,
                                  const MatmulCall& mm, cudaStream_t stream) {
  if (c.comm == nullptr || c.algorithm != kSifar || c.repeat != 1 ||
      c.nbytes != fused.row_bytes || fused.row_blocks != FusedRowBlocks(fused.row_bytes) ||
      fused.row_blocks == 0 || fused.prefetch_bytes != 0 || mm.cols == 0)
    return cudaErrorInvalidValue;
  MatmulArgs m{};
  m.f.a = MakeKernelArgs(c);
  m.f.residual = fused.residual;
  m.f.weight = fused.weight;
  m.f.normed = fused.normed;
  m.f.row_lines = static_cast<uint32_t>(fused.row_bytes / 8);
  m.f.row_blocks = static_cast<uint32_t>(fused.row_blocks);
  m.f.hidden = static_cast<uint32_t>(fused.hidden);
  m.f.eps = fused.eps;
  m.f.ar_blocks = static_cast<uint32_t>(BlocksFor(c.nbytes / 8, kThreads));
  m.matrix = mm.matrix;
  m.y = mm.y;
  m.cols = static_cast<uint32_t>(mm.cols);
  m.split = MatmulSplitOf(fused.hidden, mm.cols, fused.row_bytes / fused.hidden);
  if (fused.hidden > static_cast<size_t>(cuda::kMaxHidden)) return cudaErrorInvalidValue;
  const int grid = MatmulGrid();
  if (grid <= 0) return cudaErrorInvalidConfiguration;
  if (grid <= static_cast<int>(m.f.ar_blocks)) return cudaErrorInvalidConfiguration;
  switch (c.elem) {
    case Elem::kF32: return Launch<float>(m, grid, stream);
    case Elem::kBf16: return Launch<__nv_bfloat16>(m, grid, stream);
    case Elem::kF16: return Launch<__half>(m, grid, stream);
    default: return cudaErrorInvalidValue;
  }
}

int MatmulGrid() {
  static std::atomic<int> grids[64];  // per device ordinal; 0: not computed yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 0;
  int grid = grids[device].load();
  if (grid == 0) {  // the same value from any thread that computes it
    grid = ComputeMatmulGrid();
    grids[device].store(grid);
  }
  return grid;
}

int MatmulGridOn(int device) {
  int prev = 0;
  if (cudaGetDevice(&prev) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  const int grid = MatmulGrid();
  cudaSetDevice(prev);
  return grid;
}

void PreloadFusedMatmulKernels() {
  MatmulGrid();  // while no peer spins (the occupancy query may load the module)
  LoadRow<float>();
  LoadRow<__nv_bfloat16>();
  LoadRow<__half>();
}

}  // namespace sifar
