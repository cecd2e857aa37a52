// The FFI handler symbols exported to Python, the checks every backend runs
// before an all-reduce (one place, so CPU and GPU users see the same words),
// and the error messages they share.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "core/elem_type.h"
#include "runtime/comm.h"
#include "xla/ffi/api/ffi.h"

namespace sifar {

// sifar_allreduce: x -> y, on the communicator's internal dual slots.
// sifar_allreduce_into: (x, buf, prev) -> (y, buf), on user buffers (buf
// aliased in place, prev kept alive so the alternation is visible to XLA).
// sifar_psum_add_rmsnorm: (x, residual, weight) -> (normed, new_residual),
// the all-reduce with the residual add and RMSNorm as its epilogue.
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuAllReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuAllReduceInto);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuPsumAddRmsNorm);
#ifdef SIFAR_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudaAllReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudaAllReduceInto);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudaPsumAddRmsNorm);
#endif

// The attributes every all-reduce call carries (sifar_jax/psum.py, _Plan.attrs),
// appended to a handler's binding.
template <typename Binding>
auto WithAllReduceAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<int32_t>("axis_key")
      .template Attr<int32_t>("nranks")
      .template Attr<int32_t>("algorithm")
      .template Attr<int32_t>("repeat")
      .template Attr<int32_t>("chain");
}

// The XLA element types with a kernel (Elem: elem_type.h), and their names for Python.
bool ElemOf(xla::ffi::DataType t, Elem* out);
const char* const* SupportedDtypeNames();  // null-terminated numpy names

const char* AlgorithmName(int algorithm);

// One rank's all-reduce call, checked and resolved by PlanCall.
struct RankCall {
  Comm* comm = nullptr;
  // Holds the communicator while the call runs: its teardown waits for that.
  std::shared_ptr<Comm> hold;
  int group = -1, rank = -1;
  Elem elem = Elem::kF32;
  int algorithm = -1;
  int repeat = 1;
  uint32_t chain = 0;
  size_t lane_at = 0;  // offset of the chain's lane in every workspace
  const void* in = nullptr;
  void* out = nullptr;
  size_t nbytes = 0;
  bool explicit_buffers = false;
  char* slots[kMaxRanks] = {};  // every rank's copy of the explicit buffer
};

// Everything a handler checks before it runs: element type, the rank's
// communicator, the traced axis size, payload size and alignment, an earlier
// failure of the group, the explicit buffer (buf may be null).
// `in_run_order`: this rank's calls reach the handler in the order they run
// (false while a CUDA graph is recorded; see Comm::FindBuffer).
xla::ffi::Error PlanCall(int ordinal, xla::ffi::AnyBuffer x, xla::ffi::AnyBuffer y,
                         const xla::ffi::AnyBuffer* buf, int32_t axis_key, int32_t nranks,
                         int32_t algorithm, int32_t repeat, int32_t chain, RankCall* call,
                         bool in_run_order = true);

// The fused call's operands beyond the all-reduce's (RankCall: x -> the new
// residual), checked and resolved by PlanFusedCall.
struct FusedCall {
  const void* residual = nullptr;
  const void* weight = nullptr;
  void* normed = nullptr;
  size_t hidden = 0;     // elements per row (weight's size)
  size_t row_bytes = 0;  // hidden * element size
  int row_blocks = 0;    // FusedRowBlocks(row_bytes)
  float eps = 0.f;
  // The operand the next operation reads (a weight): its first
  // prefetch_bytes are prefetched into L2 while the all-reduce waits for its
  // peers. Never read by the kernel; no effect on the results.
  const void* prefetch = nullptr;
  size_t prefetch_bytes = 0;
};

// PlanCall's checks plus the fused ones: float types, one dtype and size for
// x, residual and both outputs, weight one row, a row layout the kernel
// supports (FusedRowBlocks), algorithm sifar; with prefetch_bytes > 0, the
// first of `rest` is the operand to prefetch, at least that large and
// 16-byte aligned (the others in `rest` only order the call).
xla::ffi::Error PlanFusedCall(int ordinal, xla::ffi::AnyBuffer x, xla::ffi::AnyBuffer residual,
                              xla::ffi::AnyBuffer weight, const xla::ffi::RemainingArgs& rest,
                              xla::ffi::AnyBuffer normed, xla::ffi::AnyBuffer new_residual,
                              int32_t axis_key, int32_t nranks, int32_t algorithm, int32_t repeat,
                              int32_t chain, float eps, int64_t prefetch_bytes, RankCall* call,
                              FusedCall* fused);

// The CPU backend's all-reduce of a planned call (cpu_allreduce.cc): the
// fused handler runs it, then its epilogue.
xla::ffi::Error RunCpuAllReduce(const RankCall& call);

// "... timed out on axis 'tp' (communicator 3, group 0, rank 1, epoch 57,
// algorithm sifar): rank 0 never arrived within the timeout", or "" if none.
std::string DescribeFailure(const Comm& comm);
xla::ffi::Error FailedError(const Comm& comm);

}  // namespace sifar
