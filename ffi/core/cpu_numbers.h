// Element conversions of the CPU backend: bf16/f16 <-> fp32 with round to
// nearest even (what the CUDA intrinsics do), and the word a failed call
// fills its outputs with.  Shared by the all-reduce and the fused epilogue.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/elem_type.h"

namespace sifar {
namespace cpu {

inline float Bf16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t F32ToBf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float F16ToF32(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}
inline uint16_t F32ToF16(float f) {
  _Float16 v = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; S.1111.111 NaN.
inline float E4m3ToF32(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
  float v;
  if (exp == 15 && man == 7) return std::nanf("");
  if (exp == 0)
    v = std::ldexp(static_cast<float>(man), -9);
  else
    v = std::ldexp(static_cast<float>(8 + man), exp - 10);
  return sign ? -v : v;
}

// A 16-bit element of type t (bf16 or f16) as fp32, and back, rounded once.
inline float HalfToF32(Elem t, uint16_t h) { return t == Elem::kBf16 ? Bf16ToF32(h) : F16ToF32(h); }
inline uint16_t F32ToHalf(Elem t, float f) { return t == Elem::kBf16 ? F32ToBf16(f) : F32ToF16(f); }

// The 32-bit word a failed call writes: NaN in every element (integers have
// no NaN: INT32_MIN).
inline uint32_t FailWord(Elem t) {
  switch (t) {
    case Elem::kF32: return 0x7fc00000u;
    case Elem::kBf16: return 0x7fc07fc0u;
    case Elem::kF16: return 0x7e007e00u;
    default: return 0x80000000u;
  }
}
inline void FillFailed(Elem t, void* out, size_t nbytes) {
  const uint32_t w = FailWord(t);
  uint32_t* o = static_cast<uint32_t*>(out);
  for (size_t i = 0; i < nbytes / 4; ++i) o[i] = w;
}

}  // namespace cpu
}  // namespace sifar
