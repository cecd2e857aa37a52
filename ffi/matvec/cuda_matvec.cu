// The batch-1 matrix-vector product on CUDA (matvec.h): a split-K streaming
// kernel whose lanes each load one 16-byte vector of a weight row per step,
// then, when K is split, a pass that adds the splits' partial sums in order.
// Both kernels are plain launches on the call's stream (CUDA-graph safe).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "allreduce/launch.h"
#include "allreduce/plan.h"
#include "core/cuda_check.h"
#include "matvec/matvec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sifar {
namespace cuda {
namespace {

using matvec::kThreads;
constexpr int kUnroll = 8;  // rows per thread whose loads are in flight at once
constexpr int kReduceThreads = 256;

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) { return __float2half_rn(v); }

// A weight vector, read once: past L1, not kept there.
__device__ __forceinline__ uint4 LoadStreaming(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

struct Args {
  const void* x;
  const void* w;
  const int32_t* ids;
  void* y;
  float* workspace;
  int64_t k, n, e, splits;
};

// Block (tile, split, m): the split's partial sums of its tile's columns
// (matvec.h gives the order), kLanes threads per row group.  splits == 1: y.
template <typename T, int kLanes>
__global__ void __launch_bounds__(kThreads) MatVecKernel(Args a) {
  constexpr int V = matvec::kVecBytes / sizeof(T);
  constexpr int kTile = kLanes * V;
  constexpr int kGroups = kThreads / kLanes;
  __shared__ float group_sums[kGroups > 1 ? kGroups : 1][kTile];
  const int lane = threadIdx.x % kLanes, group = threadIdx.x / kLanes;
  const int64_t tile = blockIdx.x, split = blockIdx.y, m = blockIdx.z;
  const int64_t n0 = tile * kTile + lane * V;
  const int64_t rows = matvec::SplitRows(a.k, a.splits);
  const int64_t k0 = split * rows;
  const int64_t k1 = min(a.k, k0 + rows);
  int64_t e = a.ids[m];
  e = e < 0 ? 0 : (e >= a.e ? a.e - 1 : e);
  const T* x = static_cast<const T*>(a.x) + m * a.k;
  const T* w = static_cast<const T*>(a.w) + e * a.k * a.n + n0;

  float acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = 0.0f;
  if (n0 < a.n) {
    for (int64_t k = k0 + group; k < k1; k += kUnroll * kGroups) {
      uint4 v[kUnroll];
      float xv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t r = k + u * kGroups;
        if (r < k1) {
          v[u] = LoadStreaming(w + r * a.n);
          xv[u] = ToFloat(x[r]);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (k + u * kGroups < k1) {
          const T* t = reinterpret_cast<const T*>(&v[u]);
#pragma unroll
          for (int j = 0; j < V; ++j) acc[j] = fmaf(xv[u], ToFloat(t[j]), acc[j]);
        }
      }
    }
  }
  if constexpr (kGroups == 1) {  // one group: each thread holds its columns' sums
    if (n0 < a.n) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (a.splits == 1)
          static_cast<T*>(a.y)[m * a.n + n0 + j] = FromFloat<T>(acc[j]);
        else
          a.workspace[(m * a.splits + split) * a.n + n0 + j] = acc[j];
      }
    }
    return;
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) group_sums[group][lane * V + j] = acc[j];
    __syncthreads();
    for (int i = threadIdx.x; i < kTile; i += kThreads) {
      const int64_t col = tile * kTile + i;
      if (col >= a.n) break;
      float sum = group_sums[0][i];
#pragma unroll
      for (int g = 1; g < kGroups; ++g) sum += group_sums[g][i];
      if (a.splits == 1)
        static_cast<T*>(a.y)[m * a.n + col] = FromFloat<T>(sum);
      else
        a.workspace[(m * a.splits + split) * a.n + col] = sum;
    }
  }
}

// y[m, col] = the splits' partial sums added in split order, rounded once.
template <typename T>
__global__ void __launch_bounds__(kReduceThreads) AddSplitsKernel(Args a, int64_t total) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kReduceThreads + threadIdx.x;
  if (i >= total) return;
  const int64_t m = i / a.n, col = i % a.n;
  const float* p = a.workspace + m * a.splits * a.n + col;
  float sum = p[0];
  for (int64_t s = 1; s < a.splits; ++s) sum += p[s * a.n];
  static_cast<T*>(a.y)[i] = FromFloat<T>(sum);
}

template <typename T, int kLanes>
cudaError_t LaunchLanes(const MatVecCall& c, const Args& a, cudaStream_t stream) {
  constexpr int kTile = kLanes * matvec::kVecBytes / static_cast<int>(sizeof(T));
  const dim3 grid(static_cast<unsigned>((c.n + kTile - 1) / kTile),
                  static_cast<unsigned>(c.splits), static_cast<unsigned>(c.m));
  MatVecKernel<T, kLanes><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t Launch(const MatVecCall& c, cudaStream_t stream) {
  Args a{c.x, c.w, c.ids, c.y, c.workspace, c.k, c.n, c.e, c.splits};
  cudaError_t e;
  switch (c.lanes) {
    case 32: e = LaunchLanes<T, 32>(c, a, stream); break;
    case 64: e = LaunchLanes<T, 64>(c, a, stream); break;
    case 128: e = LaunchLanes<T, 128>(c, a, stream); break;
    case 256: e = LaunchLanes<T, 256>(c, a, stream); break;
    default: return cudaErrorInvalidValue;
  }
  if (e != cudaSuccess || c.splits == 1) return e;
  const int64_t total = c.m * c.n;
  AddSplitsKernel<T><<<static_cast<unsigned>((total + kReduceThreads - 1) / kReduceThreads),
                       kReduceThreads, 0, stream>>>(a, total);
  return cudaGetLastError();
}

template <typename T>
void LoadKernels() {
  cudaFuncAttributes attr;
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, MatVecKernel<T, 32>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, MatVecKernel<T, 64>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, MatVecKernel<T, 128>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, MatVecKernel<T, 256>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, AddSplitsKernel<T>));
}

}  // namespace
}  // namespace cuda

namespace {

ffi::Error CudaMatVecImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                          ffi::AnyBuffer w, ffi::AnyBuffer ids, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> workspace, int64_t splits,
                          int64_t lanes) {
  MatVecCall call;
  ffi::Error err = PlanMatVec(x, w, ids, *y, *workspace, splits, lanes, &call);
  if (err.failure()) return err;
  err = UseDevice(ordinal);
  if (err.failure()) return err;
  switch (call.elem) {
    case Elem::kF32: return Launched(cuda::Launch<float>(call, stream));
    case Elem::kBf16: return Launched(cuda::Launch<__nv_bfloat16>(call, stream));
    case Elem::kF16: return Launched(cuda::Launch<__half>(call, stream));
    default: return Invalid("matvec supports float32, bfloat16 and float16");
  }
}

}  // namespace

void PreloadMatVecKernels() {
  cuda::LoadKernels<float>();
  cuda::LoadKernels<__nv_bfloat16>();
  cuda::LoadKernels<__half>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaMatVec, CudaMatVecImpl,
                              WithMatVecOperands(ffi::Ffi::Bind()
                                                     .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                     .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace sifar
