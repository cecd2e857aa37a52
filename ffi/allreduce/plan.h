// The checks every handler runs before an all-reduce (one place, so CPU and
// GPU users see the same words), the call they resolve, the attributes every
// all-reduce call carries, and the error messages they share.  Every op built
// on the all-reduce (fused/) runs PlanCall first.
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

// The attributes every all-reduce call carries (src/sifar_jax/plan.py, Plan.attrs),
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

// An invalid-argument error, "sifar_jax: " + msg: a call the handler refuses.
xla::ffi::Error Invalid(const std::string& msg);

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

// The CPU backend's all-reduce of a planned call (cpu_allreduce.cc): the
// CPU handlers of the ops built on it run it, then their epilogue.
xla::ffi::Error RunCpuAllReduce(const RankCall& call);

// "... timed out on axis 'tp' (communicator 3, group 0, rank 1, epoch 57,
// algorithm sifar): rank 0 never arrived within the timeout", or "" if none.
std::string DescribeFailure(const Comm& comm);
xla::ffi::Error FailedError(const Comm& comm);

}  // namespace sifar
