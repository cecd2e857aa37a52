// The fused kernels' arguments and their epilogues (fused/cuda_fused.cu).  The
// fused kernels run the sifar pull of epoch-tagged words with the call framing
// every kernel shares (core/device.cuh), then an epilogue on each line's
// rank-order sum, with one fp32 reduction over each row between its two
// halves.  An epilogue is a struct of static hooks:
//
//   Early       the line's operands loaded with x (zero on a padding line)
//   Late        those needed only after the row's reduction (loaded before it)
//   Line<T>     (sum, Early) -> the line's kept value and its term of the row's sum
//   Row         the row's total -> the factor Finish applies to each line
//   Finish<T>   stores a data line's outputs
//   Fail<T>     fills every output with NaN (the block, or its cluster, failed)
//
// A new epilogue is one such struct, its CPU reference (fused.cc) and one row
// of SIFAR_FUSED_EPILOGUES (fused.h).
#pragma once

#include <cuda_runtime.h>

#include "core/device.cuh"

namespace sifar {
namespace cuda {

struct FusedArgs {
  KernelArgs a;  // in: x, out: the epilogue's kept value (the new residual), nbytes: the padded payload
  // The epilogue's operands (AddRmsNorm's names).
  const void* residual;
  const void* weight;
  void* normed;
  float eps;
  size_t data_bytes;    // the buffers' size: x, residual and both outputs
  uint32_t data_lines;  // LL lines of data per row
  uint32_t row_lines;   // LL lines per padded row, a power of two >= data_lines
  uint32_t row_shift;   // log2(row_lines)
  uint32_t row_blocks;  // blocks per row (1: rows within a block); up to 8, the cluster size
  uint32_t hidden;      // elements per row
  const char* prefetch;  // the next operation's operand (never read here), or null
  size_t prefetch_bytes;
  uint32_t ar_blocks;    // the all-reduce's thread blocks; the grid's others only prefetch
  uint32_t group;        // the protocol's blocks per thread block: 1, or 2-8 (FusedWideBlock)
};

// ------------------------------------------------------------- numbers ----
// The elements of one LL line (two 32-bit words) as fp32, and back, rounded.
template <typename T>
constexpr int kLineElems = 2 * Elem<T>::kPerWord;
template <typename T>
__device__ __forceinline__ void Unpack(uint2 w, float* v) {
  Elem<T>::Add(v, w.x, true);
  Elem<T>::Add(v + Elem<T>::kPerWord, w.y, true);
}
template <typename T>
__device__ __forceinline__ uint2 Pack(const float* v) {
  return make_uint2(Elem<T>::Round(v), Elem<T>::Round(v + Elem<T>::kPerWord));
}

// Line `line` of the padded payload: whether it holds data, and where in the
// (unpadded) buffers.
__device__ __forceinline__ bool DataLine(const FusedArgs& f, size_t line, size_t& at) {
  const uint32_t j = static_cast<uint32_t>(line) & (f.row_lines - 1);
  at = (line >> f.row_shift) * f.data_lines + j;
  return j < f.data_lines;
}

// ----------------------------------------------------------- epilogues ----
// psum_add_rmsnorm: residual add, then RMSNorm of each row of `hidden`:
//   new_residual = round(float(sum) + float(residual))           (kept, into a.out)
//   ss           = fp32 sum of float(new_residual)^2 over the row, in a fixed
//                  order (the same bits on every rank)
//   s            = rsqrt(ss / hidden + eps)
//   normed       = round(float(weight) * float(round(float(new_residual) * s)))
struct AddRmsNorm {
  struct Early {
    uint2 residual;
  };
  struct Late {
    uint2 weight;
  };
  __device__ static Early LoadEarly(const FusedArgs& f, size_t at) {
    return {static_cast<const uint2*>(f.residual)[at]};
  }
  __device__ static Late LoadLate(const FusedArgs& f, size_t line) {
    return {static_cast<const uint2*>(f.weight)[line & (f.row_lines - 1)]};
  }
  template <typename T>
  __device__ static float Line(uint2 sum, const Early& e, uint2& kept) {
    constexpr int K = kLineElems<T>;
    float v[K], r[K];
    Unpack<T>(sum, v);
    Unpack<T>(e.residual, r);
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = __fadd_rn(v[k], r[k]);
    kept = Pack<T>(v);
    Unpack<T>(kept, v);  // the rounded value is what the norm sees
    float q = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) q = __fadd_rn(q, __fmul_rn(v[k], v[k]));
    return q;
  }
  __device__ static float Row(const FusedArgs& f, float total) {
    const float mean = __fdiv_rn(total, static_cast<float>(f.hidden));
    return rsqrtf(__fadd_rn(mean, f.eps));
  }
  template <typename T>
  __device__ static void Finish(const FusedArgs& f, size_t at, uint2 kept, const Late& l,
                                float scale) {
    constexpr int K = kLineElems<T>;
    float v[K], g[K];
    Unpack<T>(kept, v);
    Unpack<T>(l.weight, g);
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = __fmul_rn(v[k], scale);
    Unpack<T>(Pack<T>(v), v);  // y rounded to the payload type, as the model does
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = __fmul_rn(g[k], v[k]);
    static_cast<uint2*>(f.a.out)[at] = kept;
    static_cast<uint2*>(f.normed)[at] = Pack<T>(v);
  }
  template <typename T>
  __device__ static void Fail(const FusedArgs& f) {  // block-wide
    FillNaN<T>(f.a.out, f.data_bytes, threadIdx.x, kThreads);
    FillNaN<T>(f.normed, f.data_bytes, threadIdx.x, kThreads);
  }
};

// One thread's line of x and of the epilogue's operands (zero on a padding line).
template <typename E>
struct FusedLine {
  uint2 x;
  typename E::Early early;
  typename E::Late late;
};
template <typename E>
__device__ __forceinline__ FusedLine<E> LoadFusedLine(const FusedArgs& f, size_t line) {
  size_t at;
  if (!DataLine(f, line, at)) return FusedLine<E>{};
  return {static_cast<const uint2*>(f.a.in)[at], E::LoadEarly(f, at), E::LoadLate(f, line)};
}
// Line `line` of x, and of the epilogue's early and late operands: zero on a padding line.
__device__ __forceinline__ uint2 LoadXLine(const FusedArgs& f, size_t line) {
  size_t at;
  return DataLine(f, line, at) ? static_cast<const uint2*>(f.a.in)[at] : make_uint2(0u, 0u);
}
template <typename E>
__device__ __forceinline__ typename E::Early LoadEarlyLine(const FusedArgs& f, size_t line) {
  size_t at;
  return DataLine(f, line, at) ? E::LoadEarly(f, at) : typename E::Early{};
}
template <typename E>
__device__ __forceinline__ typename E::Late LoadLateLine(const FusedArgs& f, size_t line) {
  size_t at;
  return DataLine(f, line, at) ? E::LoadLate(f, line) : typename E::Late{};
}

}  // namespace cuda
}  // namespace sifar
