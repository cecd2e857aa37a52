// The FFI handler symbols exported to Python, and the error messages every
// backend shares, so a user sees the same words on CPU and GPU.
#pragma once

#include <cstddef>
#include <string>

#include "comm.h"
#include "xla/ffi/api/ffi.h"

namespace sifar {

XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuAllReduce);
#ifdef SIFAR_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudaAllReduce);
#endif

const char* AlgorithmName(int algorithm);

// "... timed out on axis 'tp' (communicator 3, group 0, rank 1, epoch 57,
// algorithm sifar): rank 0 never arrived within the timeout", or "" if none.
std::string DescribeFailure(const Comm& comm);

xla::ffi::Error FailedError(const Comm& comm);
xla::ffi::Error NotInitialisedError(int axis_key, int ordinal);
// The call was traced for an axis of `nranks` devices and its payload fits.
xla::ffi::Error CheckPayload(const Comm& comm, int nranks, size_t in_bytes, size_t out_bytes);

}  // namespace sifar
