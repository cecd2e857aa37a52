// L2 prefetch as an op of its own: (weight, after...) -> token.  Brings the
// first nbytes of `weight` into the GPU's L2 once the `after` operands are
// ready (they are never read), and writes the token: one int32 zero.  The
// caller folds the token into a late result, so that the op is kept and
// ordered, and runs it where XLA's command buffers may run it beside the
// latency-bound kernels between two weight-streaming matmuls (a decode
// step's attention, its norms): the memory is otherwise idle there.  On the
// CPU the token is written and nothing else happens.
#pragma once

#include <cstddef>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace sifar {

struct PrefetchCall {
  const char* weight = nullptr;
  size_t nbytes = 0;  // a multiple of 16, at most the weight's size
  int32_t* token = nullptr;
};

// Checks one call (both backends run them) and fills `call`.
xla::ffi::Error PlanPrefetch(xla::ffi::AnyBuffer weight, xla::ffi::AnyBuffer token,
                             int64_t nbytes, PrefetchCall* call);

}  // namespace sifar
