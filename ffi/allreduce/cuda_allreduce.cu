// The CUDA FFI handlers: PlanCall's (PlanFusedCall's) checks, then the
// algorithm's (the fused) kernel on XLA's stream.  Command-buffer compatible:
// nothing here depends on host state that changes between calls (epochs live
// in device memory and are advanced by the kernels).  The launch and preload tables come from the one list of
// algorithms in protocol.h.
#include <cuda_runtime.h>

#include <string>

#include "allreduce/launch.h"
#include "allreduce/plan.h"
#include "core/cuda_check.h"
#include "core/device.cuh"
#include "multicast/multicast.h"
#include "runtime/comm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sifar {
namespace {

using cuda::KernelArgs;
using cuda::kThreads;
// Blocks of every algorithm share the per-block epochs.
static_assert(kThreads == kMulticastLinesPerBlock, "one line-to-block ownership for all kernels");

using LaunchFn = void (*)(const KernelArgs&, int, cudaStream_t);

// Tagged algorithms keep their polling loads in registers: the ranks are
// bounded at compile time (2, 4 or 8).
template <typename T, int ALG, int NR>
void LaunchNR(const KernelArgs& a, int grid, cudaStream_t stream) {
  cuda::AllReduceKernel<T, ALG, NR><<<grid, kThreads, 0, stream>>>(a);
}
template <typename T, int ALG>
void Launch(const KernelArgs& a, int grid, cudaStream_t stream) {
  if constexpr (TaggedAlgorithm(ALG)) {
    if (a.nranks <= 2) LaunchNR<T, ALG, 2>(a, grid, stream);
    else if (a.nranks <= 4) LaunchNR<T, ALG, 4>(a, grid, stream);
    else LaunchNR<T, ALG, 8>(a, grid, stream);
  } else {
    LaunchNR<T, ALG, kMaxRanks>(a, grid, stream);
  }
}

template <typename T, int ALG, int NR>
void LoadOne() {
  cudaFuncAttributes attr;
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, cuda::AllReduceKernel<T, ALG, NR>));
}
template <typename T, int ALG>
void Load() {
  if constexpr (TaggedAlgorithm(ALG)) {
    LoadOne<T, ALG, 2>();
    LoadOne<T, ALG, 4>();
    LoadOne<T, ALG, 8>();
  } else {
    LoadOne<T, ALG, kMaxRanks>();
  }
}

template <typename T, int ALG, bool PORTABLE>
constexpr LaunchFn LaunchOrNull() {
  if constexpr (PORTABLE) return Launch<T, ALG>;
  else return nullptr;
}

// One row per element type, one entry per algorithm (null: no kernel here).
#define SIFAR_LAUNCH_ENTRY(e, id, name, line, tagged, exact, portable, ...) \
  LaunchOrNull<T, e, portable>(),
#define SIFAR_LOAD_ENTRY(e, id, name, line, tagged, exact, portable, ...) \
  if constexpr (portable) Load<T, e>();
template <typename T>
constexpr LaunchFn kLaunchRow[kNumAlgorithms] = {SIFAR_ALGORITHMS(SIFAR_LAUNCH_ENTRY)};
template <typename T>
void LoadRow() {
  SIFAR_ALGORITHMS(SIFAR_LOAD_ENTRY)
}
#undef SIFAR_LAUNCH_ENTRY
#undef SIFAR_LOAD_ENTRY

// Indexed by Elem.
const LaunchFn* const kLaunch[kNumElems] = {kLaunchRow<float>, kLaunchRow<__nv_bfloat16>,
                                            kLaunchRow<__half>, kLaunchRow<uint32_t>};

ffi::Error CudaError(const char* what, cudaError_t e) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("sifar_jax: ") + what + ": " + cudaGetErrorString(e));
}

ffi::Error LaunchMulticast(const RankCall& c, cudaStream_t stream) {
  const Group& g = c.comm->group(c.group);
  if (!g.multicast)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "sifar_jax: algorithm 'multicast' refused: " + g.multicast_refusal);
  if (c.elem == Elem::kU32)
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "sifar_jax: multicast reduces floating-point types only");
  MulticastCall call;
  call.rank = c.rank;
  call.elem_type = static_cast<int>(c.elem);  // same order: f32, bf16, f16
  call.in = c.in;
  call.out = c.out;
  call.bytes = c.nbytes;
  call.repeat = c.repeat;
  for (int r = 0; r < c.comm->nranks(); ++r) call.workspaces[r] = g.workspaces[r];
  call.err = g.errors_device[c.rank];
  call.layout = c.comm->layout();
  cudaError_t e = LaunchMulticastAllReduce(*g.multicast, call, stream);
  return e == cudaSuccess ? ffi::Error::Success() : CudaError("kernel launch failed", e);
}

// The handler's thread runs on the call's device.
ffi::Error UseDevice(int32_t ordinal) {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == ordinal) return ffi::Error::Success();
  cudaError_t e = cudaSetDevice(ordinal);
  return e == cudaSuccess ? ffi::Error::Success() : CudaError("cudaSetDevice failed", e);
}
ffi::Error Launched(cudaError_t e) {
  return e == cudaSuccess ? ffi::Error::Success() : CudaError("kernel launch failed", e);
}

ffi::Error RunCuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer y,
                   const ffi::AnyBuffer* buf, int32_t axis_key, int32_t nranks, int32_t algorithm,
                   int32_t repeat, int32_t chain) {
  // While XLA records a command buffer, handler calls do not follow the run order.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) cudaGetLastError();
  RankCall call;
  ffi::Error err = PlanCall(ordinal, x, y, buf, axis_key, nranks, algorithm, repeat, chain, &call,
                            capture == cudaStreamCaptureStatusNone);
  if (err.failure()) return err;
  if (call.nbytes == 0) return ffi::Error::Success();
  err = UseDevice(ordinal);
  if (err.failure()) return err;
  if (algorithm == kMulticast) return LaunchMulticast(call, stream);
  return Launched(LaunchRankAllReduce(call, stream));
}

ffi::Error CudaAllReduceImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                             ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> y,
                             int32_t axis_key, int32_t nranks, int32_t algorithm, int32_t repeat,
                             int32_t chain) {
  return RunCuda(stream, ordinal, x, *y, nullptr, axis_key, nranks, algorithm, repeat, chain);
}

ffi::Error CudaAllReduceIntoImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                                 ffi::AnyBuffer buf, ffi::AnyBuffer /*prev*/,
                                 ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> y,
                                 ffi::Result<ffi::AnyBuffer> /*buf_out: aliases buf*/,
                                 int32_t axis_key, int32_t nranks, int32_t algorithm,
                                 int32_t repeat, int32_t chain) {
  return RunCuda(stream, ordinal, x, *y, &buf, axis_key, nranks, algorithm, repeat, chain);
}

ffi::Error CudaPsumAddRmsNormImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                                  ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                                  ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> normed,
                                  ffi::Result<ffi::AnyBuffer> new_residual, int32_t axis_key,
                                  int32_t nranks, int32_t algorithm, int32_t repeat, int32_t chain,
                                  float eps, int64_t prefetch_bytes) {
  RankCall call;
  FusedCall fused;
  ffi::Error err = PlanFusedCall(ordinal, x, residual, weight, rest, *normed, *new_residual,
                                 axis_key, nranks, algorithm, repeat, chain, eps, prefetch_bytes,
                                 &call, &fused);
  if (err.failure()) return err;
  if (call.nbytes == 0) return ffi::Error::Success();
  err = UseDevice(ordinal);
  if (err.failure()) return err;
  return Launched(LaunchRankFused(call, fused, stream));
}

}  // namespace

KernelArgs MakeKernelArgs(const RankCall& c) {
  const Comm& comm = *c.comm;
  const Group& g = comm.group(c.group);
  KernelArgs a{};
  a.in = c.in;
  a.out = c.out;
  a.nbytes = c.nbytes;
  a.rank = c.rank;
  a.nranks = comm.nranks();
  a.repeat = c.repeat < 1 ? 1 : c.repeat;
  a.chain = c.chain;
  a.lane_at = c.lane_at;
  for (int r = 0; r < a.nranks; ++r) {
    a.ws[r] = g.workspaces[r];
    if (c.explicit_buffers) a.slots[r] = c.slots[r];
  }
  a.err = g.errors_device[c.rank];
  a.lay = comm.layout();
  return a;
}

cudaError_t LaunchRankAllReduce(const RankCall& c, cudaStream_t stream) {
  if (!ValidAlgorithm(c.algorithm) || c.comm == nullptr || c.nbytes % 16 != 0) return cudaErrorInvalidValue;
  const LaunchFn launch = kLaunch[static_cast<int>(c.elem)][c.algorithm];
  if (launch == nullptr) return cudaErrorInvalidValue;
  const int grid = BlocksFor(c.nbytes / LineBytes(c.algorithm), kThreads);
  launch(MakeKernelArgs(c), grid, stream);
  return cudaGetLastError();
}

void PreloadCudaKernelsOnCurrentDevice() {
  LoadRow<float>();
  LoadRow<__nv_bfloat16>();
  LoadRow<__half>();
  LoadRow<uint32_t>();
  PreloadFusedKernels();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaAllReduce, CudaAllReduceImpl,
                              WithAllReduceAttrs(ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()  // "after": ordering only, never read
                                  .Ret<ffi::AnyBuffer>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaPsumAddRmsNorm, CudaPsumAddRmsNormImpl,
                              WithAllReduceAttrs(ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // residual
                                  .Arg<ffi::AnyBuffer>()  // weight
                                  // [prefetch target], then "after": never read
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()  // normed
                                  .Ret<ffi::AnyBuffer>())  // new residual
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("prefetch_bytes"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaAllReduceInto, CudaAllReduceIntoImpl,
                              WithAllReduceAttrs(ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()  // "after": ordering only, never read
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace sifar
