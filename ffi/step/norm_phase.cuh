// Staging a phase's input in shared memory: as it is (StageX) or through RMSNorm (StageNorm),
// every block computing the norm of the whole vector itself (no barrier of its own).
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

// xs <- in[0, k) (bf16 written by this launch: read through L2).
__device__ inline void StageX(float4* xs, const bf16* in, int k) {
  for (int i = threadIdx.x; i < k / 4; i += kThreads) {
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(in) + i);
    xs[XQuad(i >> 2, i & 3)] =
        make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                    __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
  }
  BlockSync();
}

// 1 / rms from each thread's partial sum of squares: each warp's butterfly, the warps in
// order (the CPU handler's order).
__device__ inline float FinishRms(float ss, int n, float eps, float* red) {
  ss = WarpSum(ss);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
  BlockSync();
  float tot = 0.0f;
  for (int w = 0; w < kWarps; ++w) tot = __fadd_rn(tot, red[w]);
  BlockSync();  // red is reused by the next call
  return __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(tot, static_cast<float>(n)), eps)));
}

// 1 / rms(r[0, n)): thread t's fma sum over the quads t, t + 256, ... (each quad's 4 in
// order), then FinishRms.
__device__ inline float InvRms(const bf16* r, int n, float eps, float* red) {
  float ss = 0.0f;
#pragma unroll 4
  for (int i = threadIdx.x; i < n / 4; i += kThreads) {
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(r) + i);
    const float e[4] = {__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                        __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u)};
#pragma unroll
    for (int k = 0; k < 4; ++k) ss = __fmaf_rn(e[k], e[k], ss);
  }
  return FinishRms(ss, n, eps, red);
}

// xs <- bf16(bf16(r * inv) * scale), models' RMSNorm.
__device__ inline void StageNorm(float4* xs, const bf16* r, const uint16_t* scale, int n, float eps,
                          float* red) {
  const float inv = InvRms(r, n, eps, red);
  const bf16* sc = reinterpret_cast<const bf16*>(scale);
#pragma unroll 4
  for (int i = threadIdx.x; i < n / 4; i += kThreads) {
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(r) + i);
    const float e[4] = {__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                        __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u)};
    float y[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) y[k] = Rb(__fmul_rn(Rb(__fmul_rn(e[k], inv)), F(sc[4 * i + k])));
    xs[XQuad(i >> 2, i & 3)] = make_float4(y[0], y[1], y[2], y[3]);
  }
  BlockSync();
}

}  // namespace phase
}  // namespace cuda
}  // namespace sifar
