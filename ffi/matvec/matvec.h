// The batch-1 matrix-vector product of a decoding step: y[m] = x[m] @ w[ids[m]]
// for a few rows m (M = tokens x chosen experts: 1 for a dense projection, 8
// for an MoE layer's top-8), each against one matrix of a stack w [E, K, N]
// (E = 1 for a dense weight), read where it lies: no gathered copy of the
// chosen experts is ever made.
//
// Why our own: at one row XLA:GPU emits a multiply + reduce fusion or a GEMM
// tuned for more rows, streaming the weight below the memory's speed, and an
// MoE step first copies the chosen experts' slices (a gather) before its dots.
// This is a plain streaming kernel: every weight byte is read once, 16 bytes
// per thread, in long coalesced rows.
//
// Work split (the same on the CPU reference, so both give the same bits):
//   - a block of kThreads threads is `groups` = kThreads / lanes row groups of
//     `lanes` threads; a tile is lanes x Vec<T> columns (one 16-byte vector
//     per thread of a group: lanes x 16 contiguous bytes of each weight row);
//     one block per (tile, split of K, row m);
//   - row group g of a block sums rows k0 + g, k0 + g + groups, ... in order
//     (one fma per element, float32);
//   - the block adds its groups' sums in group order: the split's partial sum;
//   - a second pass adds the splits' partial sums in split order and rounds to
//     T once (splits == 1: the block writes y itself).
#pragma once

#include <cstdint>
#include <utility>

#include "core/elem_type.h"
#include "core/protocol.h"  // SIFAR_HD
#include "xla/ffi/api/ffi.h"

namespace sifar {

namespace matvec {

constexpr int kThreads = 256;  // threads per block
constexpr int kVecBytes = 16;  // bytes each thread loads per row

// Elements per 16-byte vector: the columns a thread owns.
constexpr int VecElems(int elem_bytes) { return kVecBytes / elem_bytes; }
// Threads per row group (the row's contiguous 16-byte vectors a tile reads): 32, 64, 128 or 256.
constexpr bool ValidLanes(int64_t lanes) {
  return lanes == 32 || lanes == 64 || lanes == 128 || lanes == 256;
}

// The K rows of split s: [SplitBegin(s), SplitBegin(s + 1)).
SIFAR_HD int64_t SplitRows(int64_t k, int64_t splits) { return (k + splits - 1) / splits; }

// Why (m, k, n, e, splits) cannot run, or nullptr.  N must be whole vectors
// (each row of w then starts 16-byte aligned).
inline const char* Refusal(int64_t m, int64_t k, int64_t n, int64_t e, int64_t splits,
                           int64_t lanes, int elem_bytes) {
  if (m < 1 || k < 1 || n < 1 || e < 1) return "every dimension must be at least 1";
  if (!ValidLanes(lanes)) return "lanes must be 32, 64, 128 or 256";
  if (n % VecElems(elem_bytes) != 0) return "N must be a multiple of 16 bytes of elements";
  if (splits < 1 || splits > k) return "splits must be in [1, K]";
  if (m > 65535 || splits > 65535) return "M and splits must be at most 65535";
  return nullptr;
}

}  // namespace matvec

// One call, checked: y [M, N] = x [M, K] @ w[ids] ([E, K, N]), the split
// sums in workspace [M, splits, N] (float32; unused when splits == 1).
struct MatVecCall {
  Elem elem = Elem::kF32;
  int64_t m = 0, k = 0, n = 0, e = 0, splits = 1, lanes = 32;
  const void* x = nullptr;
  const void* w = nullptr;
  const int32_t* ids = nullptr;  // clamped to [0, E) where read
  void* y = nullptr;
  float* workspace = nullptr;
};

// The operands and attributes both backends' handlers bind (src/sifar_jax/matvec.py, _kernel),
// appended to a binding (the CUDA one starts with its stream and device).
template <typename Binding>
auto WithMatVecOperands(Binding binding) {
  return std::move(binding)
      .template Arg<xla::ffi::AnyBuffer>()  // x [M, K]
      .template Arg<xla::ffi::AnyBuffer>()  // w [E, K, N]
      .template Arg<xla::ffi::AnyBuffer>()  // ids [M] int32
      .template Ret<xla::ffi::AnyBuffer>()  // y [M, N]
      .template Ret<xla::ffi::AnyBuffer>()  // workspace [M, splits, N] float32
      .template Attr<int64_t>("splits")
      .template Attr<int64_t>("lanes");
}

// The checks both backends run (shapes, dtypes, alignment); fills *call.
xla::ffi::Error PlanMatVec(xla::ffi::AnyBuffer x, xla::ffi::AnyBuffer w, xla::ffi::AnyBuffer ids,
                           xla::ffi::AnyBuffer y, xla::ffi::AnyBuffer workspace, int64_t splits,
                           int64_t lanes, MatVecCall* call);

}  // namespace sifar
