// Probe (leaves the tree with ring_stream.cu): the e4m3 decodes on trial against the
// product's CvtDot (ffi/step/device_math.cuh), as Dot policies of RingGemv. ring_step.sh
// builds the product with the winner by putting it in ffi/step/cuda_llama_step.cu.
#pragma once

#include "step/device_math.cuh"

namespace sifar {
namespace cuda {
namespace phase {

// 16 weights times 16 inputs, one fma chain from 0 (Chunk's order).
__device__ __forceinline__ float Dot16(const float (&w)[16], const float4* q) {
  const float4 a = q[0], b = q[1], c = q[2], d = q[3];
  const float x[16] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w,
                       c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
  float p = 0.0f;
#pragma unroll
  for (int j = 0; j < 16; ++j) p = __fmaf_rn(x[j], w[j], p);
  return p;
}

// The decodes on trial. Each yields w * 2^-120 (kXLog2 = 100: the input staged x 2^100).
// Bits: byte j on top of a word, an arithmetic shift by 4 and a mask (sign to bit 31, the
// other 7 bits to 26..20).
struct BitsDot {
  static constexpr int kXLog2 = 100;
  __device__ __forceinline__ float operator()(const uint4& v, const float4* q) const {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
    float w[16];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int32_t t = static_cast<int32_t>(words[i] << (24 - 8 * j));
        w[4 * i + j] = __int_as_float((t >> 4) & static_cast<int32_t>(0x87f00000u));
      }
    return Dot16(w, q);
  }
};
// Pairs: bytes 1 and 3 as a bf16 pair in one mask (sign bits in place, the rest >> 4), bytes 0
// and 2 likewise from the word << 8; each half to a float by a shift or a mask.
__device__ __forceinline__ void PairsWord(uint32_t w, float* f) {
  const uint32_t h13 = (w & 0x80008000u) | ((w >> 4) & 0x07f007f0u);
  const uint32_t h02 = ((w << 8) & 0x80008000u) | ((w << 4) & 0x07f007f0u);
  f[0] = __uint_as_float(h02 << 16), f[1] = __uint_as_float(h13 << 16);
  f[2] = __uint_as_float(h02 & 0xffff0000u), f[3] = __uint_as_float(h13 & 0xffff0000u);
}
struct PairsDot {
  static constexpr int kXLog2 = 100;
  __device__ __forceinline__ float operator()(const uint4& v, const float4* q) const {
    float w[16];
    PairsWord(v.x, w), PairsWord(v.y, w + 4), PairsWord(v.z, w + 8), PairsWord(v.w, w + 12);
    return Dot16(w, q);
  }
};
// PairsMul: Pairs, each weight then times 2^120 (exact: a float multiply of a value with at
// most 4 significant bits into the normal range), so the true weights: no input scaling, every
// x exact. One float multiply per weight beside the integer ops, on the other pipe.
struct PairsMulDot {
  static constexpr int kXLog2 = 0;
  __device__ __forceinline__ float operator()(const uint4& v, const float4* q) const {
    float w[16];
    PairsWord(v.x, w), PairsWord(v.y, w + 4), PairsWord(v.z, w + 8), PairsWord(v.w, w + 12);
#pragma unroll
    for (int j = 0; j < 16; ++j) w[j] = __fmul_rn(w[j], 0x1p120f);
    return Dot16(w, q);
  }
};
// HybridMul: the first word by conversions, the rest as PairsMul: the conversion pipe and the
// integer pipe at once.
struct HybridMulDot {
  static constexpr int kXLog2 = 0;
  __device__ __forceinline__ float operator()(const uint4& v, const float4* q) const {
    float w[16];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(v.x >> (16 * h));
      const float2 fv = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
      w[2 * h] = fv.x, w[2 * h + 1] = fv.y;
    }
    PairsWord(v.y, w + 4), PairsWord(v.z, w + 8), PairsWord(v.w, w + 12);
#pragma unroll
    for (int j = 4; j < 16; ++j) w[j] = __fmul_rn(w[j], 0x1p120f);
    return Dot16(w, q);
  }
};

}  // namespace phase
}  // namespace cuda
}  // namespace sifar
