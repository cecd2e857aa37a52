// What every phase of the persistent step shares: block geometry, bf16 rounding, the weight
// loads and the FP8 chunk product (fp8_matvec's order), the input's shared-memory swizzle, the
// warp butterfly. (Device functions only; the kernel is ffi/step/cuda_llama_step.cu.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "step/llama_step.h"

namespace sifar {
namespace cuda {
namespace phase {

using bf16 = __nv_bfloat16;
using step::kHeadDim;
using step::kMaxSplits;
using step::kThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kU = 8;  // 16-byte loads per lane per batch

__device__ __forceinline__ float F(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float Rb(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float LoadBf(const bf16* p) {
  return __uint_as_float(static_cast<uint32_t>(__ldcg(reinterpret_cast<const unsigned short*>(p)))
                         << 16);
}

__device__ __forceinline__ uint4 LoadW(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// 16 weights times 16 inputs, one fma chain from 0 (fp8_matvec's chunk order).
__device__ __forceinline__ float Chunk(const uint4& v, const float4* q) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
  float w[16];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(words[i] >> (16 * h));
      const float2 fv = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
      w[4 * i + 2 * h] = fv.x;
      w[4 * i + 2 * h + 1] = fv.y;
    }
  const float4 a = q[0], b = q[1], c = q[2], d = q[3];
  const float x[16] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w,
                       c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
  float p = 0.0f;
#pragma unroll
  for (int j = 0; j < 16; ++j) p = __fmaf_rn(x[j], w[j], p);
  return p;
}

// The input vector in shared memory as float4s, swizzled so that a warp's 16-byte chunk
// reads hit distinct banks: chunk c's quad q at 4c + (q ^ ((c >> 1) & 3)).
__device__ __forceinline__ int XQuad(int c, int q) { return 4 * c + (q ^ ((c >> 1) & 3)); }

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

}  // namespace phase
}  // namespace cuda
}  // namespace sifar
