// The L2 prefetch op on CUDA (prefetch.h): one kernel whose block 0 writes
// the token and whose other blocks' first warps hand contiguous shares of the
// weight's first nbytes to the copy engine as bulk L2 prefetches
// (core/l2_prefetch.cuh).  A plain launch on the call's stream (CUDA-graph
// safe); nothing is read into the SMs, so the kernel takes few of them from
// the kernels it runs beside.
#include <cuda_runtime.h>

#include "allreduce/launch.h"  // UseDevice, Launched
#include "core/cuda_check.h"
#include "core/l2_prefetch.cuh"
#include "prefetch/prefetch.h"
#include "targets.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sifar {
namespace {

// Prefetching blocks: as the fused call's (fused/cuda_fused.cu), where 16
// gained most in the decode step.
constexpr int kPrefetchBlocks = 16;

__global__ void PrefetchKernel(PrefetchCall c) {
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) *c.token = 0;
    return;
  }
  if (threadIdx.x >= 32) return;
  cuda::PrefetchLaneShare(c.weight, c.nbytes,
                          static_cast<size_t>(blockIdx.x - 1) * 32 + threadIdx.x,
                          static_cast<size_t>(gridDim.x - 1) * 32);
}

ffi::Error CudaPrefetchImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer weight,
                            ffi::RemainingArgs after, ffi::Result<ffi::AnyBuffer> token,
                            int64_t nbytes) {
  (void)after;  // ordering only: never read
  PrefetchCall call;
  ffi::Error err = PlanPrefetch(weight, *token, nbytes, &call);
  if (err.failure()) return err;
  err = UseDevice(ordinal);
  if (err.failure()) return err;
  const int grid = call.nbytes == 0 ? 1 : 1 + kPrefetchBlocks;
  PrefetchKernel<<<grid, 32, 0, stream>>>(call);
  return Launched(cudaGetLastError());
}

}  // namespace

void PreloadPrefetchKernels() {
  cudaFuncAttributes attr;
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, PrefetchKernel));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaPrefetch, CudaPrefetchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // weight
                                  .RemainingArgs()        // after: never read
                                  .Ret<ffi::AnyBuffer>()  // token
                                  .Attr<int64_t>("nbytes"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace sifar
