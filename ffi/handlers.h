// The FFI handler symbols exported to Python, and the error messages every
// backend shares, so a user sees the same words on CPU and GPU.
#pragma once

#include <cstddef>
#include <string>
#include <utility>

#include "comm.h"
#include "xla/ffi/api/ffi.h"

namespace sifar {

// sifar_allreduce: x -> y, on the communicator's internal dual slots.
// sifar_allreduce_into: (x, buf, prev) -> (y, buf), on user buffers (buf
// aliased in place, prev kept alive so the alternation is visible to XLA).
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuAllReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuAllReduceInto);
#ifdef SIFAR_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudaAllReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudaAllReduceInto);
#endif

// The attributes every all-reduce call carries (sifar_jax/psum.py, _Plan.attrs),
// appended to a handler's binding.
template <typename Binding>
auto WithAllReduceAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<int32_t>("axis_key")
      .template Attr<int32_t>("nranks")
      .template Attr<int32_t>("algorithm")
      .template Attr<int32_t>("repeat");
}

const char* AlgorithmName(int algorithm);

// "... timed out on axis 'tp' (communicator 3, group 0, rank 1, epoch 57,
// algorithm sifar): rank 0 never arrived within the timeout", or "" if none.
std::string DescribeFailure(const Comm& comm);

xla::ffi::Error FailedError(const Comm& comm);
xla::ffi::Error NotInitialisedError(int axis_key, int ordinal);
// The call was traced for an axis of `nranks` devices and its payload fits.
xla::ffi::Error CheckPayload(const Comm& comm, int nranks, size_t in_bytes, size_t out_bytes);

// Every rank's copy of the registered buffer `buf` (explicit dual buffering).
// `in_run_order`: see Comm::FindBuffer.
xla::ffi::Error ResolveBuffer(const Comm& comm, int group, int rank, const void* buf,
                              size_t buf_bytes, char* (&slots)[kMaxRanks],
                              bool in_run_order = true);

}  // namespace sifar
