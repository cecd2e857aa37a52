// The element types the kernels add, in the one order that the CUDA launch
// tables, the CPU reference and the multicast kernels index.  kU32 serves
// int32 and uint32 alike (two's-complement sums are the same bits).
#pragma once

namespace sifar {

enum class Elem : int { kF32 = 0, kBf16 = 1, kF16 = 2, kU32 = 3 };
constexpr int kNumElems = 4;

}  // namespace sifar
