// The FP8-weight product on CUDA (fp8_matvec.h): one launch, no workspace.  A persistent grid
// (as many blocks as stay resident, each looping over groups of rows); each weight row (K
// contiguous bytes) is read by `lanes` threads in 16-byte loads, the next batch of loads in
// flight while the current one is added up; `ksplit` warps of a block share a row's K and add
// their sums through shared memory.  With pdl the launch is a programmatic dependent launch:
// the block lets the next kernel launch, optionally (prefetch) asks L2 for its first rows
// (weights never depend on the previous kernel; an L2 prefetch binds no value), then waits for
// the previous kernel before reading x and ids.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "allreduce/launch.h"
#include "allreduce/plan.h"
#include "core/cuda_check.h"
#include "matvec/fp8_matvec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sifar {
namespace cuda {
namespace {

using fp8mv::kChunk;
using fp8mv::kThreads;
using fp8mv::kWarps;
constexpr int kUnroll = 8;  // 16-byte weight loads each thread has in flight

struct Fp8Args {
  const void* x;
  const uint8_t* w;
  const float* scale;
  const int32_t* ids;
  void* y;
  int64_t m, k, n, e, sn, sk, block_n, block_k;
  int lanes, ksplit, prefetch;
};

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

// A weight vector, read once: past L1, with L2 asked for the whole 256-byte sector group.
__device__ __forceinline__ uint4 LoadWeights(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 16 e4m3 weights as float (exact).
__device__ __forceinline__ void DecodeE4m3(const uint4& v, float* f) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(words[i] >> (16 * h));
      const __half2 hv = __half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3));
      const float2 fv = __half22float2(hv);
      f[4 * i + 2 * h] = fv.x;
      f[4 * i + 2 * h + 1] = fv.y;
    }
  }
}

// 16 activations x[k0 .. k0 + 15] as float.
__device__ __forceinline__ void LoadX16(const float* p, float* f) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(p) + i);
    f[4 * i] = v.x, f[4 * i + 1] = v.y, f[4 * i + 2] = v.z, f[4 * i + 3] = v.w;
  }
}
// bf16: the word's halves shifted into a float's top bits (exact).
__device__ __forceinline__ void LoadX16(const __nv_bfloat16* p, float* f) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      f[8 * i + 2 * j] = __uint_as_float(words[j] << 16);
      f[8 * i + 2 * j + 1] = __uint_as_float(words[j] & 0xffff0000u);
    }
  }
}
__device__ __forceinline__ void LoadX16(const __half* p, float* f) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 fv = __half22float2(h[j]);
      f[8 * i + 2 * j] = fv.x;
      f[8 * i + 2 * j + 1] = fv.y;
    }
  }
}

__device__ __forceinline__ void AllowNextLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}
__device__ __forceinline__ void WaitForPreviousGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void PrefetchL2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// A persistent grid: block b takes row groups (RowsPerBlock rows) b, b + gridDim.x, ... of w;
// x rows blockIdx.y * MB .. + MB (E == 1: one weight row serves MB rows of x) or x row
// blockIdx.y (a stack: MB == 1).  Each lane streams its chunks of its rows as one sequence of
// batches of U loads, the next batch in flight while the current one is added up.
template <typename T, int MB>
__global__ void __launch_bounds__(kThreads, 2) Fp8MatVecKernel(Fp8Args a) {
  constexpr int U = MB <= 2 ? 8 : 4;
  __shared__ float split_sums[2][kWarps][8][MB];  // [row group parity][warp][row of warp][x row]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kw = warp % a.ksplit, rg = warp / a.ksplit;
  const int rows_per_warp = 32 / a.lanes, rw = lane / a.lanes, l = lane % a.lanes;
  const int64_t rows_per_block = (kWarps / a.ksplit) * rows_per_warp;
  const int64_t groups = (a.n + rows_per_block - 1) / rows_per_block;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * MB;
  int64_t g = blockIdx.x;
  AllowNextLaunch();
  if (a.prefetch && a.e == 1 && threadIdx.x == 0) {
    const int64_t row0 = g * rows_per_block, rows = min(rows_per_block, a.n - row0);
    PrefetchL2(a.w + row0 * a.k, static_cast<uint32_t>(rows * a.k));
  }
  WaitForPreviousGrid();

  int64_t e = 0;
  if (a.e > 1) {
    e = a.ids[m0];
    e = e < 0 ? 0 : (e >= a.e ? a.e - 1 : e);
  }
  const int64_t chunks = a.k / kChunk;
  const int64_t per_split = (chunks + a.ksplit - 1) / a.ksplit;
  const int64_t c_begin = min(chunks, kw * per_split) + l;
  const int64_t c_end = min(chunks, kw * per_split + per_split);
  // Batches per row: the same for every lane of the warp (their shuffles pair up).
  const int nb = static_cast<int>(((c_end - (c_begin - l) + a.lanes - 1) / a.lanes + U - 1) / U);
  const bool kblocked = a.block_k < a.k;
  const T* x = static_cast<const T*>(a.x) + m0 * a.k;
  bool live[MB];
#pragma unroll
  for (int r = 0; r < MB; ++r) live[r] = m0 + r < a.m;
  auto row_of = [&](int64_t grp) {  // a row past N computes, is never stored
    const int64_t n = grp * rows_per_block + rg * rows_per_warp + rw;
    return n < a.n ? n : a.n - 1;
  };
  auto load = [&](uint4* v, int64_t grp, int b) {
    const uint8_t* wr = a.w + (e * a.n + row_of(grp)) * a.k;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c_begin + static_cast<int64_t>(b * U + u) * a.lanes;
      if (c < c_end) v[u] = LoadWeights(wr + c * kChunk);
    }
  };

  float acc[MB];
#pragma unroll
  for (int r = 0; r < MB; ++r) acc[r] = 0.0f;
  uint4 cur[U], nxt[U];
  if (nb > 0) load(cur, g, 0);
  int b = 0, parity = 0;
  while (g < groups) {
    int64_t gn = g;
    int bn = b + 1;
    if (bn >= nb) bn = 0, gn = g + gridDim.x;
    if (gn < groups && nb > 0) load(nxt, gn, bn);
    if (nb > 0) {
      const float* srow = a.scale + (e * a.sn + row_of(g) / a.block_n) * a.sk;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t c = c_begin + static_cast<int64_t>(b * U + u) * a.lanes;
        if (c >= c_end) break;
        float wf[kChunk];
        DecodeE4m3(cur[u], wf);
        const float s = kblocked ? __ldg(srow + c * kChunk / a.block_k) : 1.0f;
#pragma unroll
        for (int r = 0; r < MB; ++r) {
          if (!live[r]) continue;
          float xf[kChunk];
          LoadX16(x + r * a.k + c * kChunk, xf);
          float p = 0.0f;
#pragma unroll
          for (int j = 0; j < kChunk; ++j) p = __fmaf_rn(xf[j], wf[j], p);
          acc[r] = kblocked ? __fmaf_rn(p, s, acc[r]) : __fadd_rn(acc[r], p);
        }
      }
    }
    if (bn == 0) {  // the row is done: lanes, then splits, then the scale; rounded once
      for (int off = a.lanes / 2; off >= 1; off /= 2) {
#pragma unroll
        for (int r = 0; r < MB; ++r)
          acc[r] = __fadd_rn(acc[r], __shfl_xor_sync(0xffffffffu, acc[r], off));
      }
      if (a.ksplit > 1) {
        if (l == 0) {
#pragma unroll
          for (int r = 0; r < MB; ++r) split_sums[parity][warp][rw][r] = acc[r];
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < MB; ++r) {
          float total = split_sums[parity][warp - kw][rw][r];
          for (int sp = 1; sp < a.ksplit; ++sp)
            total = __fadd_rn(total, split_sums[parity][warp - kw + sp][rw][r]);
          acc[r] = total;
        }
        parity ^= 1;
      }
      const int64_t n = g * rows_per_block + rg * rows_per_warp + rw;
      if (kw == 0 && l == 0 && n < a.n) {
        const float s = kblocked ? 1.0f : __ldg(a.scale + (e * a.sn + n / a.block_n) * a.sk);
#pragma unroll
        for (int r = 0; r < MB; ++r) {
          if (!live[r]) continue;
          const float out = kblocked ? acc[r] : __fmul_rn(acc[r], s);
          static_cast<T*>(a.y)[(m0 + r) * a.n + n] = FromFloat<T>(out);
        }
      }
#pragma unroll
      for (int r = 0; r < MB; ++r) acc[r] = 0.0f;
    }
    g = gn;
    b = bn;
#pragma unroll
    for (int u = 0; u < U; ++u) cur[u] = nxt[u];
  }
}

template <typename T, int MB>
cudaError_t LaunchRows(const Fp8MatVecCall& c, const Fp8Args& a, unsigned grid_y,
                       cudaStream_t stream) {
  const int64_t rows = fp8mv::RowsPerBlock(c.lanes, c.ksplit);
  cudaLaunchConfig_t config = {};
  // As many blocks as stay resident (each loops over row groups), at most one per group.
  static int per_sm = 0;
  if (per_sm == 0 &&
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Fp8MatVecKernel<T, MB>, kThreads, 0) !=
          cudaSuccess)
    per_sm = 1;
  static int sms_of[64] = {};  // per device ordinal, read once
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  if (device >= 0 && device < 64) {
    if (sms_of[device] == 0)
      cudaDeviceGetAttribute(&sms_of[device], cudaDevAttrMultiProcessorCount, device);
    sms = sms_of[device];
  }
  const int64_t groups = (c.n + rows - 1) / rows;
  const int64_t resident = static_cast<int64_t>(std::max(per_sm, 1)) * std::max(sms, 1);
  const int64_t per_y = std::max<int64_t>(1, resident / grid_y);
  config.gridDim = dim3(static_cast<unsigned>(std::min(groups, per_y)), grid_y, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = c.pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, Fp8MatVecKernel<T, MB>, a);
}

template <typename T>
cudaError_t Launch(const Fp8MatVecCall& c, cudaStream_t stream) {
  const Fp8Args a{c.x, c.w, c.scale, c.ids, c.y, c.m, c.k, c.n, c.e, c.sn, c.sk, c.block_n,
                  c.block_k, static_cast<int>(c.lanes), static_cast<int>(c.ksplit),
                  c.prefetch ? 1 : 0};
  if (c.e > 1) return LaunchRows<T, 1>(c, a, static_cast<unsigned>(c.m), stream);
  // One weight: every x row a warp multiplies by each weight row it reads.
  const unsigned groups8 = static_cast<unsigned>((c.m + 7) / 8);
  if (c.m == 1) return LaunchRows<T, 1>(c, a, 1, stream);
  if (c.m == 2) return LaunchRows<T, 2>(c, a, 1, stream);
  if (c.m <= 4) return LaunchRows<T, 4>(c, a, 1, stream);
  return LaunchRows<T, 8>(c, a, groups8, stream);
}

template <typename T>
void LoadKernels() {
  cudaFuncAttributes attr;
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, Fp8MatVecKernel<T, 1>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, Fp8MatVecKernel<T, 2>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, Fp8MatVecKernel<T, 4>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, Fp8MatVecKernel<T, 8>));
}

}  // namespace
}  // namespace cuda

namespace {

ffi::Error CudaFp8MatVecImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                             ffi::AnyBuffer w, ffi::AnyBuffer scale, ffi::AnyBuffer ids,
                             ffi::Result<ffi::AnyBuffer> y, int64_t block_n, int64_t block_k,
                             int64_t lanes, int64_t ksplit, int64_t pdl, int64_t prefetch) {
  Fp8MatVecCall call;
  ffi::Error err = PlanFp8MatVec(x, w, scale, ids, *y, block_n, block_k, lanes, ksplit, pdl,
                                 prefetch, &call);
  if (err.failure()) return err;
  err = UseDevice(ordinal);
  if (err.failure()) return err;
  switch (call.elem) {
    case Elem::kF32: return Launched(cuda::Launch<float>(call, stream));
    case Elem::kBf16: return Launched(cuda::Launch<__nv_bfloat16>(call, stream));
    case Elem::kF16: return Launched(cuda::Launch<__half>(call, stream));
    default: return Invalid("fp8_matvec: x must be float32, bfloat16 or float16");
  }
}

}  // namespace

void PreloadFp8MatVecKernels() {
  cuda::LoadKernels<float>();
  cuda::LoadKernels<__nv_bfloat16>();
  cuda::LoadKernels<__half>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaFp8MatVec, CudaFp8MatVecImpl,
                              WithFp8MatVecOperands(ffi::Ffi::Bind()
                                                        .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                        .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace sifar
