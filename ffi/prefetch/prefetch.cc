// The L2 prefetch op's checks (PlanPrefetch: both backends run them) and its
// CPU backend, which only writes the token: a CPU has no L2 to fill for a
// later kernel.
#include <string>

#include "allreduce/plan.h"  // Invalid
#include "prefetch/prefetch.h"
#include "targets.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sifar {

ffi::Error PlanPrefetch(ffi::AnyBuffer weight, ffi::AnyBuffer token, int64_t nbytes,
                        PrefetchCall* call) {
  if (token.element_type() != ffi::DataType::S32 || token.element_count() != 1)
    return Invalid("l2_prefetch: the token must be one int32");
  if (nbytes < 0 || nbytes % 16 != 0)
    return Invalid("l2_prefetch: nbytes must be a non-negative multiple of 16, got " +
                   std::to_string(nbytes));
  if (static_cast<size_t>(nbytes) > weight.size_bytes())
    return Invalid("l2_prefetch: nbytes (" + std::to_string(nbytes) + ") exceeds the weight's " +
                   std::to_string(weight.size_bytes()) + " bytes");
  call->weight = static_cast<const char*>(weight.untyped_data());
  if (nbytes > 0 && reinterpret_cast<uintptr_t>(call->weight) % 16 != 0)
    return Invalid("l2_prefetch: the weight must be 16-byte aligned");
  call->nbytes = static_cast<size_t>(nbytes);
  call->token = static_cast<int32_t*>(token.untyped_data());
  return ffi::Error::Success();
}

namespace {

ffi::Error CpuPrefetchImpl(ffi::AnyBuffer weight, ffi::RemainingArgs after,
                           ffi::Result<ffi::AnyBuffer> token, int64_t nbytes) {
  (void)after;  // ordering only: never read
  PrefetchCall call;
  ffi::Error err = PlanPrefetch(weight, *token, nbytes, &call);
  if (err.failure()) return err;
  *call.token = 0;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuPrefetch, CpuPrefetchImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // weight
                                  .RemainingArgs()        // after: never read
                                  .Ret<ffi::AnyBuffer>()  // token
                                  .Attr<int64_t>("nbytes"));

}  // namespace sifar
