// The all-reduce on CUDA: one kernel template per algorithm (the bodies
// below, on the shared device primitives of core/device.cuh), the launch and
// preload tables generated from the one list of algorithms in protocol.h, and
// the FFI handlers (PlanCall's checks, then the algorithm's kernel on XLA's
// stream).  Command-buffer compatible: nothing here depends on host state
// that changes between calls (epochs live in device memory and are advanced
// by the kernels).
#include <cuda_runtime.h>

#include <string>

#include "allreduce/launch.h"
#include "allreduce/plan.h"
#include "core/cuda_check.h"
#include "core/device.cuh"
#include "multicast/multicast.h"
#include "runtime/comm.h"
#include "xla/ffi/api/ffi.h"

namespace sifar {
namespace cuda {

// ------------------------------------------------------------- bodies ----
// One body per portable algorithm of the table (protocol.h), each an overload
// on Alg<id>: AllReduceKernel<T, ALG> calls Body<T, NR>(Alg<ALG>{}, ...).
// `first`: this thread's input line of the first round (tagged algorithms),
// loaded at kernel start.
//
// oneshot / oneshot_db: publish, top barrier, pull-reduce [, bottom barrier].
template <typename T>
__device__ bool Oneshot(const Ws& w, CallState& s, bool bottom) {
  const KernelArgs& a = w.a;
  const size_t nlines = a.nbytes / 16;
  const uint4* in = static_cast<const uint4*>(a.in);
  SIFAR_FOR_EACH_LINE(line, nlines) { w.plain(a.rank, s.epoch)[line] = in[line]; }
  if (!AllRanksReached(w, s, kTop)) return false;
  SIFAR_FOR_EACH_LINE(line, nlines) {
    Acc<T> acc[4 * Elem<T>::kPerWord];
#pragma unroll
    for (int p = 0; p < kMaxRanks; ++p) {
      if (p >= a.nranks) break;
      uint4 v = p == a.rank ? in[line] : LoadStrong16(w.plain(p, s.epoch) + line);
      AddLine<T>(acc, v, p == 0);
    }
    static_cast<uint4*>(a.out)[line] = RoundLine<T>(acc);
  }
  return bottom ? AllRanksReached(w, s, kBottom) : true;
}

// twoshot: rank r reduces the r-th piece of each block's run of lines and
// publishes it; the others gather it.
template <typename T>
__device__ bool Twoshot(const Ws& w, CallState& s) {
  const KernelArgs& a = w.a;
  const size_t nlines = a.nbytes / 16;
  const uint4* in = static_cast<const uint4*>(a.in);
  uint4* out = static_cast<uint4*>(a.out);
  SIFAR_FOR_EACH_LINE(line, nlines) { w.plain(a.rank, s.epoch)[line] = in[line]; }
  if (!AllRanksReached(w, s, kTop)) return false;
  auto owner = [&](size_t line) {
    size_t run_begin = line - threadIdx.x;
    size_t run_end = min(run_begin + kThreads, nlines);
    size_t per = (run_end - run_begin + a.nranks - 1) / a.nranks;
    return static_cast<int>((line - run_begin) / per);
  };
  SIFAR_FOR_EACH_LINE(line, nlines) {
    if (owner(line) != a.rank) continue;
    Acc<T> acc[4 * Elem<T>::kPerWord];
#pragma unroll
    for (int p = 0; p < kMaxRanks; ++p) {
      if (p >= a.nranks) break;
      uint4 v = p == a.rank ? in[line] : LoadStrong16(w.plain(p, s.epoch) + line);
      AddLine<T>(acc, v, p == 0);
    }
    uint4 r = RoundLine<T>(acc);
    w.tmp(a.rank, s.epoch)[line] = r;
    out[line] = r;
  }
  if (!AllRanksReached(w, s, kMid)) return false;
  SIFAR_FOR_EACH_LINE(line, nlines) {
    int q = owner(line);
    if (q != a.rank) out[line] = LoadStrong16(w.tmp(q, s.epoch) + line);
  }
  return AllRanksReached(w, s, kBottom);
}

// sifar_flag (the paper's validation, made correct): publish the payload,
// then a per-block flag with release; acquire every peer's flag (the loads
// issued together, speculating that they are fresh) and only then pull the
// payloads.  The paper issued payload and flag loads together, and relaxed
// loads of different lines are unordered under the PTX memory model: a stale
// payload with a fresh flag could pass.  Acquiring first costs a second round
// trip, which is the price of flag validation.
template <typename T>
__device__ bool SifarFlag(const Ws& w, CallState& s) {
  const KernelArgs& a = w.a;
  const size_t nlines = a.nbytes / 16;
  const uint4* in = static_cast<const uint4*>(a.in);
  SIFAR_FOR_EACH_LINE(line, nlines) { w.plain(a.rank, s.epoch)[line] = in[line]; }
  __syncthreads();
  if (threadIdx.x == 0) StoreReleaseSys(w.flags(a.rank, s.epoch) + blockIdx.x, s.tag);
  // Thread p acquires peer p's flag; flags are never ahead of this epoch in
  // this slot, so equality with our tag means "fresh".
  bool ok = true;
  const int t = threadIdx.x;
  if (t < a.nranks && t != a.rank) {
    const uint32_t* f = w.flags(t, s.epoch) + blockIdx.x;
    for (uint32_t spins = 0; LoadAcquireSys(f) != s.tag; ++spins) {
      s.retried = true;
      if (Expired(w, s, t, spins)) {
        ok = false;
        break;
      }
    }
  }
  // The barrier below orders the other threads' payload loads after thread
  // p's acquire (bar.sync is a CTA-scope fence; acquire.sys then covers them).
  if (!__syncthreads_and(ok)) return false;
  SIFAR_FOR_EACH_LINE(line, nlines) {
    Acc<T> acc[4 * Elem<T>::kPerWord];
#pragma unroll
    for (int p = 0; p < kMaxRanks; ++p) {
      if (p >= a.nranks) break;
      uint4 v = p == a.rank ? in[line] : LoadStrong16(w.plain(p, s.epoch) + line);
      AddLine<T>(acc, v, p == 0);
    }
    static_cast<uint4*>(a.out)[line] = RoundLine<T>(acc);
  }
  return true;
}

// sifar / sifar_push: the whole payload, line by line.
template <typename T, int NR, bool PUSH>
__device__ bool Sifar(const Ws& w, CallState& s, uint2 first) {
  const size_t nlines = w.a.nbytes / 8;  // an LL line carries 8 payload bytes
  const uint2* in = static_cast<const uint2*>(w.a.in);
  SIFAR_FOR_EACH_LINE(line, nlines) {
    uint2 sum;
    if (!PullLine<T, NR, PUSH>(w, s, line, line < kRoundLines ? first : in[line], sum))
      return false;
    static_cast<uint2*>(w.a.out)[line] = sum;
  }
  return true;
}

// The table's bodies.
template <typename T, int NR>
__device__ __forceinline__ bool Body(Alg<kOneshot>, const Ws& w, CallState& s, uint2) {
  return Oneshot<T>(w, s, true);
}
template <typename T, int NR>
__device__ __forceinline__ bool Body(Alg<kOneshotDB>, const Ws& w, CallState& s, uint2) {
  return Oneshot<T>(w, s, false);
}
template <typename T, int NR>
__device__ __forceinline__ bool Body(Alg<kTwoshot>, const Ws& w, CallState& s, uint2) {
  return Twoshot<T>(w, s);
}
template <typename T, int NR>
__device__ __forceinline__ bool Body(Alg<kSifarFlag>, const Ws& w, CallState& s, uint2) {
  return SifarFlag<T>(w, s);
}
template <typename T, int NR>
__device__ __forceinline__ bool Body(Alg<kSifar>, const Ws& w, CallState& s, uint2 first) {
  return Sifar<T, NR, false>(w, s, first);
}
template <typename T, int NR>
__device__ __forceinline__ bool Body(Alg<kSifarPush>, const Ws& w, CallState& s, uint2 first) {
  return Sifar<T, NR, true>(w, s, first);
}

// --------------------------------------------------------------- kernel ----
template <typename T, int ALG, int NR = kMaxRanks>
__global__ void __launch_bounds__(kThreads) AllReduceKernel(KernelArgs a) {
  const Ws w{a};
  __shared__ BlockStart b0;
  // Tagged algorithms: every thread loads its first input line now, while
  // thread 0's control words are in flight (one memory latency less at the
  // start of every call).  The others: start fetching the block's first line.
  uint2 first = make_uint2(0u, 0u);
  const size_t line0 = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (TaggedAlgorithm(ALG)) {
    if (line0 < a.nbytes / 8) first = static_cast<const uint2*>(a.in)[line0];
  } else if (threadIdx.x == 0) {
    const size_t at = static_cast<size_t>(blockIdx.x) * kThreads * LineBytes(ALG);
    if (at < a.nbytes)
      asm volatile("prefetch.global.L1 [%0];" ::"l"(static_cast<const char*>(a.in) + at));
  }
  if (threadIdx.x == 0) ReadBlockStart(w, ALG, b0);
  __syncthreads();
  const BlockStart st = b0;
  if (st.dropped()) {
    SIFAR_FOR_EACH_LINE(line, a.nbytes / 16) {
      static_cast<uint4*>(a.out)[line] = static_cast<const uint4*>(a.in)[line];
    }
    return;
  }
  if (st.failed()) {  // the communicator failed earlier: never return a plausible result
    FillNaN<T>(a.out, a.nbytes);
    return;
  }
  uint32_t epoch = st.epoch;
  CallState s{};
  s.timeout_ns = st.timeout_ns;
  bool ok = true, warp0_retried = false;
  for (int i = 0; i < a.repeat; ++i) {
    // Where the call has block-wide barriers (barrier algorithms, the wrap's
    // clearing) every warp must agree first; a failed warp keeps looping
    // (doing nothing) so it still takes part.  Tagged calls have no block
    // barrier: their warps run ahead independently.
    if (!BeginCall<!TaggedAlgorithm(ALG)>(w, st, epoch, s, ok, blockIdx.x)) continue;
    if (ok) ok = Body<T, NR>(Alg<ALG>{}, w, s, first);
    if (!ok && s.failed_peer >= 0) RecordFailure(w, ALG, s);
    warp0_retried |= EndCall(w, ALG, s);
    ok = __all_sync(0xffffffffu, ok);  // the warp agrees on the outcome
  }
  if (!ok) {
    FillNaN<T>(a.out, a.nbytes);
    return;
  }
  CommitBlock(w, ALG, st, epoch, warp0_retried);
}

}  // namespace cuda
}  // namespace sifar

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

}  // namespace

ffi::Error UseDevice(int32_t ordinal) {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == ordinal) return ffi::Error::Success();
  cudaError_t e = cudaSetDevice(ordinal);
  return e == cudaSuccess ? ffi::Error::Success() : CudaError("cudaSetDevice failed", e);
}

ffi::Error Launched(cudaError_t e) {
  return e == cudaSuccess ? ffi::Error::Success() : CudaError("kernel launch failed", e);
}

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

void PreloadAllReduceKernels() {
  LoadRow<float>();
  LoadRow<__nv_bfloat16>();
  LoadRow<__half>();
  LoadRow<uint32_t>();
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
