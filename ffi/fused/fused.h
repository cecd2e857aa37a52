// psum_add_rmsnorm, the all-reduce with the residual add and RMSNorm as its
// epilogue: the rows it supports, the operands it resolves beyond the
// all-reduce's, and its checks (run by both backends: fused.cc, cuda_fused.cu).
#pragma once

#include <cstddef>
#include <cstdint>

#include "allreduce/plan.h"
#include "core/protocol.h"
#include "xla/ffi/api/ffi.h"

namespace sifar {

// The fused call runs the sifar pull over rows of `hidden` elements
// (row_bytes, whole 16-byte lines), each laid out in the payload padded to
// FusedPaddedRowBytes: the next power of two of its 8-byte LL lines, the
// lines past the row's data zero on every rank (masked lanes: they are
// pulled like any line, add nothing to the sum of squares, and are never
// stored).  The padded payload keeps protocol.h's line -> block ownership
// (BlockOfLine), so a padded row lies in a power-of-two fraction of one
// block, or over a power-of-two number of whole blocks, at most one round of
// them (kMaxRowBlocks: 64 blocks of 256 lines, 128 KB).  A row's sum of
// squares is reduced where it lies: a segmented in-block reduction; or one
// thread-block cluster of FusedClusterBlocks thread blocks (2-8, at most the
// portable cluster size), each running FusedBlocksPerThreadBlock of the
// protocol's blocks: 1 for rows of up to 8 blocks (16 KB), 2-8 for rows of
// 16-64 blocks (32-128 KB; their epochs, tags and barriers, one line of each
// per thread).
// FusedRowBlocks returns the protocol's blocks one row spans (1: the row lies
// within one block), or 0 where the fused kernel cannot run (the caller falls
// back to the unfused composition).  The CPU backend accepts the same rows, so
// both decide alike.
constexpr int kMaxClusterBlocks = 8;
constexpr int kMaxRowBlocks = kMaxBlocks;
static_assert(kMaxBlocks % kMaxClusterBlocks == 0, "a round of blocks holds whole clusters");
// The longest row the fused kernel holds, padded: one round of blocks.
constexpr size_t kMaxFusedRowBytes = static_cast<size_t>(kMaxRowBlocks) * kLinesPerBlock * 8;
SIFAR_HD size_t FusedPaddedRowBytes(size_t row_bytes) {
  if (row_bytes == 0 || row_bytes % 16 != 0) return 0;  // whole 16-byte lines per row
  size_t lines = 2;
  while (lines * 8 < row_bytes) lines <<= 1;
  return lines * 8;
}
SIFAR_HD int FusedRowBlocks(size_t row_bytes) {
  const size_t lines = FusedPaddedRowBytes(row_bytes) / 8;
  if (lines == 0) return 0;
  if (lines <= static_cast<size_t>(kLinesPerBlock)) return 1;
  const size_t blocks = lines / kLinesPerBlock;
  return blocks <= static_cast<size_t>(kMaxRowBlocks) ? static_cast<int>(blocks) : 0;
}
// Thread blocks per cluster for rows of `row_blocks` protocol blocks (1: no
// cluster), and protocol blocks per thread block (1 but for rows over 16 KB).
SIFAR_HD int FusedClusterBlocks(int row_blocks) {
  return row_blocks < kMaxClusterBlocks ? row_blocks : kMaxClusterBlocks;
}
SIFAR_HD int FusedBlocksPerThreadBlock(int row_blocks) {
  return row_blocks / FusedClusterBlocks(row_blocks);
}

// The fused ops' epilogues, one row each: X(enum, name), the CUDA epilogue
// struct cuda::name (fused/epilogue.cuh, its kernels generated from this
// table) and its CPU reference cpu::name (fused.cc).  A new fused op adds its
// row here, its struct and reference, and its FFI target (targets.h).
#define SIFAR_FUSED_EPILOGUES(X) \
  X(kAddRmsNorm, AddRmsNorm) /* psum_add_rmsnorm: residual add, then RMSNorm */

enum FusedEpilogue : int {
#define SIFAR_EPILOGUE_ENUM(e, name) e,
  SIFAR_FUSED_EPILOGUES(SIFAR_EPILOGUE_ENUM)
#undef SIFAR_EPILOGUE_ENUM
  kNumFusedEpilogues
};

// The fused call's operands beyond the all-reduce's (RankCall: x -> the new
// residual), checked and resolved by PlanFusedCall.
struct FusedCall {
  int epilogue = kAddRmsNorm;  // FusedEpilogue
  const void* residual = nullptr;
  const void* weight = nullptr;
  void* normed = nullptr;
  size_t hidden = 0;     // elements per row (weight's size)
  size_t row_bytes = 0;         // hidden * element size
  size_t padded_row_bytes = 0;  // a row's share of the payload: FusedPaddedRowBytes(row_bytes)
  int row_blocks = 0;           // FusedRowBlocks(row_bytes): the protocol's blocks per row
  float eps = 0.f;
  // The operand the next operation reads (a weight): its first
  // prefetch_bytes are prefetched into L2 while the all-reduce waits for its
  // peers. Never read by the kernel; no effect on the results.
  const void* prefetch = nullptr;
  size_t prefetch_bytes = 0;
};

// PlanCall's checks plus the fused ones: float types, one dtype and size for
// x, residual and both outputs, weight one row, a row layout the kernel
// supports (FusedRowBlocks) whose padded payload fits the slot, algorithm sifar; with prefetch_bytes > 0, the
// first of `rest` is the operand to prefetch, at least that large and
// 16-byte aligned (the others in `rest` only order the call).
xla::ffi::Error PlanFusedCall(int ordinal, xla::ffi::AnyBuffer x, xla::ffi::AnyBuffer residual,
                              xla::ffi::AnyBuffer weight, const xla::ffi::RemainingArgs& rest,
                              xla::ffi::AnyBuffer normed, xla::ffi::AnyBuffer new_residual,
                              int32_t axis_key, int32_t nranks, int32_t algorithm, int32_t repeat,
                              int32_t chain, float eps, int64_t prefetch_bytes, RankCall* call,
                              FusedCall* fused);

// The CPU backend of a planned fused call: the sifar all-reduce into the kept
// output, then the epilogue's CPU reference (every output NaN on a failure).
xla::ffi::Error RunCpuFused(const RankCall& call, const FusedCall& fused);

}  // namespace sifar
