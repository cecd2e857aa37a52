// What every phase of the persistent step shares: block geometry, a GEMV's descriptor and
// scale, bf16 rounding, the FP8 and bf16 chunk products (fp8_matvec's order), the input's
// shared-memory swizzle, bounded waits, the consumers' block barrier, the warp butterfly. (Device functions only; the kernel is ffi/step/cuda_llama_step.cu.)
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

// One GEMV phase's weights: `items` outputs of `rows` weight rows each (row item, and item +
// pair: gate_up's gate and up rows) of k bytes, ld bytes apart (a rank's columns: ld > k),
// taken by the g blocks of its rank (b: this block among them).
struct Mat {
  const uint8_t* w;
  int items, k, rows, pair, ld, b, g;
};

// A projection's scale for output row `row`: per channel or per tensor.
__device__ __forceinline__ float Scale(const float* s, unsigned per_channel, int row) {
  return per_channel ? __ldg(s + row) : __ldg(s);
}

__device__ __forceinline__ float F(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float Rb(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float LoadBf(const bf16* p) {
  return __uint_as_float(static_cast<uint32_t>(__ldcg(reinterpret_cast<const unsigned short*>(p)))
                         << 16);
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

// 8 bf16 weights times 8 inputs, one fma chain from 0 (the same order as Chunk, a 16-byte
// chunk holding 8 weights instead of 16).
__device__ __forceinline__ float ChunkBf16(const uint4& v, const float4* q) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
  const float4 a = q[0], b = q[1];
  const float x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  float p = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t w = words[j / 2];
    p = __fmaf_rn(x[j], __uint_as_float(j % 2 == 0 ? w << 16 : w & 0xffff0000u), p);
  }
  return p;
}

// The input vector in shared memory as float4s, swizzled so that a warp's 16-byte chunk
// reads hit distinct banks: chunk c's quad q at 4c + (q ^ ((c >> 1) & 3)).
__device__ __forceinline__ int XQuad(int c, int q) { return 4 * c + (q ^ ((c >> 1) & 3)); }

// Bounded waits: a wait that has lasted kWaitNs (a block or warp that will never arrive: a
// trap in it, a lost launch) traps, a failed launch that XLA reports, never a hang. The clock
// is read once per 1024 polls, after the first 1024 (an uncontended wait never reads it).
constexpr unsigned long long kWaitNs = 10ull * 1000 * 1000 * 1000;
__device__ __forceinline__ unsigned long long GlobalNs() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
struct Deadline {
  unsigned n = 0;
  unsigned long long t0 = 0;
  __device__ __forceinline__ void Tick() {
    if ((++n & 1023u) != 0) return;
    const unsigned long long t = GlobalNs();
    if (t0 == 0) t0 = t;
    else if (t - t0 > kWaitNs) __trap();
  }
};

// The block barrier of the step's phases: the kThreads consumer threads only (barrier 1), so
// that a producer warp beside them (ring_gemv.cuh) never has to join; the same memory ordering
// as __syncthreads among the threads that take part.
__device__ __forceinline__ void BlockSync() { asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory"); }

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

}  // namespace phase
}  // namespace cuda
}  // namespace sifar
