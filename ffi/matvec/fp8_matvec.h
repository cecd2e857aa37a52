// The batch-1 product of a decoding step with FP8 weights:
//   y[m, n] = sum_k x[m, k] * dequant(w[ids[m], n, k])
// x [M, K] and y [M, N] in float32, bfloat16 or float16; w [E, N, K] float8_e4m3fn in the
// checkpoint's own layout (one output channel per contiguous row of K bytes, as nn.Linear and
// the hub's FP8 files store it); E = 1 for a dense weight, else an MoE layer's expert stack and
// ids [M] picks each row's expert (clamped to [0, E)).  The scale is float32 [E, SN, SK] over a
// grid of (block_n x block_k) blocks: per tensor (SN = SK = 1), per output channel (block_n = 1,
// SK = 1) or 128 x 128 blocks; any block_n >= 1, and block_k a multiple of 16 or >= K, so a
// tensor-parallel shard whose rows start inside a checkpoint block is served by a finer grid
// (src/sifar_jax/fp8_matvec.py, regrid_scale).
//
// Work split and summation order (the CPU handler runs the same, so both give the same bits):
//   - K is read in chunks of 16 weights (16 bytes); chunk c holds k = 16c .. 16c + 15.
//   - `lanes` consecutive threads of a warp share one output row n (32 / lanes rows a warp);
//     the chunks are cut into `ksplit` contiguous ranges of ceil(C / ksplit) chunks, one per
//     warp of a row group (C = K / 16).  Lane l of split s takes chunks
//     s * ceil(C / ksplit) + l + i * lanes, i = 0, 1, ... in order.
//   - Per chunk, p = fma over its 16 weights in order, from 0 (16 independent chains per
//     batch of loads, not one long one); then acc = fma(p, scale[n / block_n, 16c / block_k],
//     acc) when the scale is K-blocked (block_k < K), else acc = acc + p; acc from 0.
//   - The lanes of a row are added by a butterfly: for off = lanes/2, ..., 1:
//     v[i] = v[i] + v[i ^ off] (every lane ends with lane 0's value).
//   - The splits' values are added in split order; then, when the scale is not K-blocked, the
//     sum is multiplied by scale[n / block_n, 0]; rounded to y's dtype once.
#pragma once

#include <cstdint>
#include <utility>

#include "core/elem_type.h"
#include "xla/ffi/api/ffi.h"

namespace sifar {

namespace fp8mv {

constexpr int kThreads = 256;     // threads per block: 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 16;        // weights (bytes) per load
constexpr int kMaxRowsPerWarp = 8;  // x rows one warp multiplies by the same weight row

inline bool ValidLanes(int64_t v) { return v == 4 || v == 8 || v == 16 || v == 32; }
inline bool ValidSplit(int64_t v) { return v == 1 || v == 2 || v == 4 || v == 8; }
// Output rows one block computes.
inline int64_t RowsPerBlock(int64_t lanes, int64_t ksplit) {
  return (kWarps / ksplit) * (32 / lanes);
}

}  // namespace fp8mv

// One call, checked (PlanFp8MatVec).
struct Fp8MatVecCall {
  Elem elem = Elem::kF32;
  int64_t m = 0, k = 0, n = 0, e = 0;
  int64_t sn = 1, sk = 1, block_n = 1, block_k = 1;
  int64_t lanes = 32, ksplit = 1;
  bool pdl = false, prefetch = false;
  const void* x = nullptr;
  const uint8_t* w = nullptr;
  const float* scale = nullptr;
  const int32_t* ids = nullptr;
  void* y = nullptr;
  bool KBlocked() const { return block_k < k; }
};

// Operands and attributes both backends bind (src/sifar_jax/fp8_matvec.py, _kernel); the
// CUDA binding starts with its stream and device.
template <typename Binding>
auto WithFp8MatVecOperands(Binding binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()  // x [M, K]
      .template Arg<xla::ffi::AnyBuffer>()  // w [E, N, K] float8_e4m3fn
      .template Arg<xla::ffi::AnyBuffer>()  // scale [E, SN, SK] float32
      .template Arg<xla::ffi::AnyBuffer>()  // ids [M] int32
      .template Ret<xla::ffi::AnyBuffer>()  // y [M, N]
      .template Attr<int64_t>("block_n")
      .template Attr<int64_t>("block_k")
      .template Attr<int64_t>("lanes")
      .template Attr<int64_t>("ksplit")
      .template Attr<int64_t>("pdl")        // CUDA: programmatic dependent launch
      .template Attr<int64_t>("prefetch");  // CUDA: the block's weights into L2 first
}

// The checks both backends run (dtypes, shapes, scale grid, alignment); fills *call.
xla::ffi::Error PlanFp8MatVec(xla::ffi::AnyBuffer x, xla::ffi::AnyBuffer w,
                              xla::ffi::AnyBuffer scale, xla::ffi::AnyBuffer ids,
                              xla::ffi::AnyBuffer y, int64_t block_n, int64_t block_k,
                              int64_t lanes, int64_t ksplit, int64_t pdl, int64_t prefetch,
                              Fp8MatVecCall* call);

}  // namespace sifar
