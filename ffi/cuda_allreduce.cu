// The CUDA FFI handler: finds the rank's communicator, checks the payload and
// launches the algorithm's kernel on XLA's stream.  Command-buffer compatible:
// nothing here depends on host state that changes between calls (epochs live
// in device memory and are advanced by the kernels).
#include <cuda_runtime.h>

#include <string>

#include "comm.h"
#include "cuda_check.h"
#include "cuda_kernels.cuh"
#include "handlers.h"
#include "multicast.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sifar {
namespace {

using cuda::KernelArgs;
using cuda::kThreads;
// Blocks of every algorithm share the per-block epochs.
static_assert(kThreads == kMulticastLinesPerBlock, "one line-to-block ownership for all kernels");

// Algorithms with a kernel here (multicast has its own module).
constexpr bool HasKernel(int alg) { return alg >= 0 && alg < kNumAlgorithms && alg != kMulticast; }
constexpr int kElems = 3;              // f32, bf16, f16

// sifar keeps its polling loads in registers: bound the ranks at compile time.
template <typename T, int ALG>
void Launch(const KernelArgs& a, int grid, cudaStream_t stream) {
  if constexpr (ALG == kSifar || ALG == kSifarPush) {
    if (a.nranks <= 2) cuda::AllReduceKernel<T, ALG, 2><<<grid, kThreads, 0, stream>>>(a);
    else if (a.nranks <= 4) cuda::AllReduceKernel<T, ALG, 4><<<grid, kThreads, 0, stream>>>(a);
    else cuda::AllReduceKernel<T, ALG, 8><<<grid, kThreads, 0, stream>>>(a);
  } else {
    cuda::AllReduceKernel<T, ALG><<<grid, kThreads, 0, stream>>>(a);
  }
}

template <typename T>
constexpr void (*kLaunchRow[kNumAlgorithms])(const KernelArgs&, int, cudaStream_t) = {
    Launch<T, kOneshot>, Launch<T, kTwoshot>, Launch<T, kOneshotDB>, Launch<T, kSifarFlag>,
    Launch<T, kSifar>,   nullptr,             Launch<T, kSifarPush>};

using LaunchFn = void (*)(const KernelArgs&, int, cudaStream_t);
const LaunchFn* const kLaunch[kElems] = {kLaunchRow<float>, kLaunchRow<__nv_bfloat16>,
                                         kLaunchRow<__half>};

template <typename T, int ALG, int NR = kMaxRanks>
void LoadOne() {
  cudaFuncAttributes attr;
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, cuda::AllReduceKernel<T, ALG, NR>));
}
template <typename T>
void LoadRow() {
  LoadOne<T, kOneshot>();
  LoadOne<T, kTwoshot>();
  LoadOne<T, kOneshotDB>();
  LoadOne<T, kSifarFlag>();
  LoadOne<T, kSifar, 2>();
  LoadOne<T, kSifar, 4>();
  LoadOne<T, kSifar, 8>();
  LoadOne<T, kSifarPush, 2>();
  LoadOne<T, kSifarPush, 4>();
  LoadOne<T, kSifarPush, 8>();
}

int ElemIndex(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return 0;
    case ffi::DataType::BF16: return 1;
    case ffi::DataType::F16: return 2;
    default: return -1;
  }
}

// Bytes one thread moves per line: LL lines carry 8 payload bytes.
size_t LineBytes(int algorithm) { return algorithm == kSifar || algorithm == kSifarPush ? 8 : 16; }

ffi::Error LaunchFailed(cudaError_t e) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("sifar_jax: kernel launch failed: ") + cudaGetErrorString(e));
}

ffi::Error LaunchMulticast(const Group& g, int rank, int elem, ffi::AnyBuffer x,
                           ffi::Result<ffi::AnyBuffer>& y, int32_t repeat, const Comm& comm,
                           cudaStream_t stream) {
  if (!g.multicast)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "sifar_jax: algorithm 'multicast' refused: " + g.multicast_refusal);
  MulticastCall call;
  call.rank = rank;
  call.elem_type = elem;  // same order: f32, bf16, f16
  call.in = x.untyped_data();
  call.out = y->untyped_data();
  call.bytes = x.size_bytes();
  call.repeat = repeat < 1 ? 1 : repeat;
  for (int r = 0; r < comm.nranks(); ++r) call.workspaces[r] = g.workspaces[r];
  call.err = g.errors_device[rank];
  call.layout = comm.layout();
  cudaError_t e = LaunchMulticastAllReduce(*g.multicast, call, stream);
  return e == cudaSuccess ? ffi::Error::Success() : LaunchFailed(e);
}

ffi::Error RunCuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                   ffi::Result<ffi::AnyBuffer>& y, int32_t axis_key, int32_t nranks,
                   int32_t algorithm, int32_t repeat, const ffi::AnyBuffer* buf) {
  const int elem = ElemIndex(x.element_type());
  if (elem < 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "sifar_jax: only float32, bfloat16 and float16 are supported");
  RankRef ref = Registry::Get().Lookup(axis_key, ordinal);
  if (ref.comm == nullptr) return NotInitialisedError(axis_key, ordinal);
  Comm& comm = *ref.comm;
  ffi::Error err = CheckPayload(comm, nranks, x.size_bytes(), y->size_bytes());
  if (err.failure()) return err;
  // A failure seen by any rank of the group surfaces at the next call (when
  // XLA replays a command buffer this host code does not run: check() does).
  for (int r = 0; r < comm.nranks(); ++r)
    if (comm.RankFailed(ref.group, r)) return FailedError(comm);
  const Group& g = comm.group(ref.group);
  if (algorithm == kMulticast) return LaunchMulticast(g, ref.rank, elem, x, y, repeat, comm, stream);
  if (!HasKernel(algorithm))
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string("sifar_jax: algorithm '") + AlgorithmName(algorithm) +
                          "' has no CUDA kernel in this build");
  const size_t nbytes = x.size_bytes();
  if (nbytes == 0) return ffi::Error::Success();
  if (reinterpret_cast<uintptr_t>(x.untyped_data()) % 16 ||
      reinterpret_cast<uintptr_t>(y->untyped_data()) % 16)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "sifar_jax: buffers must be 16-byte aligned");

  KernelArgs a{};
  a.in = x.untyped_data();
  a.out = y->untyped_data();
  a.nbytes = nbytes;
  a.rank = ref.rank;
  a.nranks = comm.nranks();
  a.repeat = repeat < 1 ? 1 : repeat;
  for (int r = 0; r < a.nranks; ++r) a.ws[r] = g.workspaces[r];
  if (buf != nullptr) {
    if (algorithm == kMulticast)
      return ffi::Error(ffi::ErrorCode::kUnimplemented,
                        "sifar_jax: explicit buffers are not supported with multicast");
    // While XLA records a command buffer, handler calls do not follow the run order.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) cudaGetLastError();
    err = ResolveBuffer(comm, ref.group, ref.rank, buf->untyped_data(), buf->size_bytes(), a.slots,
                        capture == cudaStreamCaptureStatusNone);
    if (err.failure()) return err;
  }
  a.err = g.errors_device[ref.rank];
  a.lay = comm.layout();

  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != ordinal) cudaSetDevice(ordinal);
  const int grid = BlocksFor(nbytes / LineBytes(algorithm), kThreads);
  kLaunch[elem][algorithm](a, grid, stream);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ffi::Error::Success() : LaunchFailed(e);
}

ffi::Error CudaAllReduceImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                             ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> y, int32_t axis_key, int32_t nranks,
                             int32_t algorithm, int32_t repeat) {
  return RunCuda(stream, ordinal, x, y, axis_key, nranks, algorithm, repeat, nullptr);
}

ffi::Error CudaAllReduceIntoImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                                 ffi::AnyBuffer buf, ffi::AnyBuffer /*prev*/,
                                 ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> y,
                                 ffi::Result<ffi::AnyBuffer> /*buf_out: aliases buf*/,
                                 int32_t axis_key, int32_t nranks, int32_t algorithm,
                                 int32_t repeat) {
  return RunCuda(stream, ordinal, x, y, axis_key, nranks, algorithm, repeat, &buf);
}

}  // namespace

void PreloadCudaKernelsOnCurrentDevice() {
  LoadRow<float>();
  LoadRow<__nv_bfloat16>();
  LoadRow<__half>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaAllReduce, CudaAllReduceImpl,
                              WithAllReduceAttrs(ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()  // "after": ordering only, never read
                                  .Ret<ffi::AnyBuffer>()),
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
