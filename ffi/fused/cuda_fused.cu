// psum_add_rmsnorm on CUDA: the fused all-reduce + residual add + RMSNorm
// kernel, its launch and its FFI handler.  The kernel runs the sifar pull of
// epoch-tagged words exactly as AllReduceKernel runs it (the same lines,
// blocks, per-block epochs, tags, wrap and failure rules), then an epilogue
// on each row of `hidden` elements:
//
//   new_residual = round(float(sum) + float(residual))
//   ss           = fp32 sum of float(new_residual)^2 over the row, in a fixed
//                  order (the same bits on every rank)
//   s            = rsqrt(ss / hidden + eps)
//   normed       = round(float(weight) * float(round(float(new_residual) * s)))
//
// A row is data_lines LL lines (8 payload bytes each), laid out in the
// payload padded to row_lines, the next power of two (FusedPaddedRowBytes):
// the padding lines are zero on every rank, pulled like any line (so the
// padded payload keeps BlockOfLine's ownership), add nothing to the sum of
// squares and are never stored.  Rows of at most one block's lines lie in
// aligned segments of one block (a segmented reduction: warp shuffles, then
// the row's warps through shared memory).  Longer rows span row_blocks whole blocks, launched as one
// thread-block cluster: each block stores its sum into every block's shared
// memory (distributed shared memory), one cluster barrier, and every block adds
// them in cluster-rank order.  Since a round of kMaxBlocks blocks
// holds whole clusters, the line -> block ownership stays BlockOfLine's.
#include <cuda_runtime.h>

#include "allreduce/launch.h"
#include "core/cuda_check.h"
#include "core/device.cuh"
#include "fused/fused.h"
#include "xla/ffi/api/ffi.h"

namespace sifar {
namespace cuda {

struct FusedArgs {
  KernelArgs a;  // in: x, out: the new residual, nbytes: the padded payload
  const void* residual;
  const void* weight;
  void* normed;
  size_t data_bytes;    // the buffers' size: x, residual and both outputs
  uint32_t data_lines;  // LL lines of data per row
  uint32_t row_lines;   // LL lines per padded row, a power of two >= data_lines
  uint32_t row_shift;   // log2(row_lines)
  uint32_t row_blocks;  // blocks per row: the cluster size (1: rows within a block)
  uint32_t hidden;      // elements per row
  float eps;
  const char* prefetch;  // the next operation's operand (never read here), or null
  size_t prefetch_bytes;
  uint32_t ar_blocks;    // the all-reduce's blocks; the grid's others only prefetch
};

// ------------------------------------------------------------- numbers ----
// The elements of one LL line (two 32-bit words) as fp32, and back, rounded.
template <typename T>
constexpr int kLineElems = 2 * Elem<T>::kPerWord;
template <typename T>
__device__ __forceinline__ void Unpack(uint2 w, float* v) {
  Elem<T>::Add(v, w.x, true);
  Elem<T>::Add(v + Elem<T>::kPerWord, w.y, true);
}
template <typename T>
__device__ __forceinline__ uint2 Pack(const float* v) {
  return make_uint2(Elem<T>::Round(v), Elem<T>::Round(v + Elem<T>::kPerWord));
}

// Line `line` of the padded payload: whether it holds data, and where in the
// (unpadded) buffers.
__device__ __forceinline__ bool DataLine(const FusedArgs& f, size_t line, size_t& at) {
  const uint32_t j = static_cast<uint32_t>(line) & (f.row_lines - 1);
  at = (line >> f.row_shift) * f.data_lines + j;
  return j < f.data_lines;
}

// One thread's line of the three inputs (zero on a padding line).
struct FusedIn {
  uint2 x, residual, weight;
};
__device__ __forceinline__ FusedIn LoadFusedIn(const FusedArgs& f, size_t line) {
  size_t at;
  if (!DataLine(f, line, at)) return FusedIn{};
  return {static_cast<const uint2*>(f.a.in)[at], static_cast<const uint2*>(f.residual)[at],
          static_cast<const uint2*>(f.weight)[line & (f.row_lines - 1)]};
}

// ----------------------------------------------------------- prefetch ----
// While the all-reduce waits for its peers the GPU's memory is idle, and the
// operation after it (the next matmul) is bound by reading its weight.  Extra
// blocks after the all-reduce's (ar_blocks on) own no lines: each hands its
// share of the weight's first prefetch_bytes to its copy engine as bulk L2
// prefetches and exits, so those bytes are in L2 when the matmul starts.  A
// block's prefetches run at a fraction of HBM's bandwidth, hence several
// blocks (too many lengthen the call).  Results are unaffected: nothing is
// read into the SM.
// evict_last, so that the matmul's own misses replace other lines first: in
// the device comparison (2x H200) it gained as much as the default
// policy and more than evict_normal; per-line prefetch instructions from every
// thread made the call longer.
constexpr uint32_t kPrefetchChunk = 64 * 1024;
__device__ __forceinline__ void PrefetchL2(const char* p, uint32_t bytes) {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;"
               ::"l"(p), "r"(bytes), "l"(policy) : "memory");
}
// Block-uniform: a prefetch block's lanes of warp 0 take contiguous shares.
__device__ __forceinline__ void PrefetchShare(const FusedArgs& f) {
  if (threadIdx.x >= 32) return;
  const size_t lanes = static_cast<size_t>(gridDim.x - f.ar_blocks) * 32;
  const size_t lane = static_cast<size_t>(blockIdx.x - f.ar_blocks) * 32 + threadIdx.x;
  const size_t share = (f.prefetch_bytes / lanes + 16) & ~static_cast<size_t>(15);
  const size_t begin = lane * share;
  const size_t end = begin + share < f.prefetch_bytes ? begin + share : f.prefetch_bytes;
  for (size_t at = begin; at < end; at += kPrefetchChunk) {
    const size_t left = end - at;  // a multiple of 16, as the size must be
    PrefetchL2(f.prefetch + at, static_cast<uint32_t>(left < kPrefetchChunk ? left : kPrefetchChunk));
  }
}

// ----------------------------------------------------------- clusters ----
// barrier.cluster split in its two halves: the release/acquire pair orders
// the (distributed) shared-memory writes before the arrive with the reads
// after the wait, in every block of the cluster.  All threads of every block
// execute both.
__device__ __forceinline__ void ClusterArrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void ClusterArriveRelaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void ClusterWait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Stores a 32-bit word into block `rank`'s copy of `local` (distributed
// shared memory).
__device__ __forceinline__ void StoreClusterShared(const void* local, uint32_t rank, uint32_t v) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(local));
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(remote), "r"(v) : "memory");
}

// The shared memory of the row reduction, double-buffered by exchange parity:
// a block writes exchange k + 2's words only after exchange k + 1's barrier,
// which every thread (of every block of the cluster) passes after reading
// exchange k's.
struct RowShared {
  float warp_sums[2][kThreads / 32];
  float part[2][kMaxRowBlocks];        // the cluster's blocks' row sums, by cluster rank
  uint32_t part_ok[2][kMaxRowBlocks];  // and whether each block's lines all succeeded
};

// The sum of `v` over this thread's row within the block, in a fixed order
// (butterfly over the row's lanes of a warp: both partners of each step add
// the same two numbers, so every lane ends with the same bits; then the row's
// warps in order); `ok` becomes the block's AND, in the same barrier.
// Block-uniform: all threads call it.
__device__ __forceinline__ float BlockRowSum(float v, uint32_t row_lines, float* warp_sums,
                                             bool& ok) {
  const uint32_t width = row_lines < 32u ? row_lines : 32u;
  for (uint32_t o = 1; o < width; o <<= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (row_lines <= 32u) {
    ok = __syncthreads_and(ok) != 0;
    return v;
  }
  const uint32_t warps = (row_lines < kThreads ? row_lines : kThreads) / 32;  // the row's, here
  const uint32_t warp = threadIdx.x / 32;
  if ((threadIdx.x & 31u) == 0) warp_sums[warp] = v;
  ok = __syncthreads_and(ok) != 0;
  const uint32_t first = warp & ~(warps - 1);
  float t = warp_sums[first];
  for (uint32_t k = 1; k < warps; ++k) t = __fadd_rn(t, warp_sums[first + k]);
  return t;
}

// Rows of several blocks: thread b sends this block's sum and outcome into
// block b's shared memory, one cluster barrier, then every block adds the
// sums in cluster-rank order (the blocks' order along the row) from its own
// memory.  Returns the row's sum; `ok` becomes the cluster's AND.
__device__ __forceinline__ float ClusterRowSum(float total, uint32_t row_blocks, RowShared& sh,
                                               uint32_t parity, bool& ok) {
  const uint32_t me = blockIdx.x % row_blocks;  // cluster rank (1-D clusters along the grid)
  if (threadIdx.x < row_blocks) {
    StoreClusterShared(&sh.part[parity][me], threadIdx.x, __float_as_uint(total));
    StoreClusterShared(&sh.part_ok[parity][me], threadIdx.x, ok ? 1u : 0u);
  }
  ClusterArrive();
  ClusterWait();
  float t = sh.part[parity][0];
  bool all_ok = sh.part_ok[parity][0] != 0;
  for (uint32_t b = 1; b < row_blocks; ++b) {
    t = __fadd_rn(t, sh.part[parity][b]);
    all_ok = all_ok && sh.part_ok[parity][b] != 0;
  }
  ok = all_ok;
  return t;
}

// ------------------------------------------------------------- launch ----
// A launch configuration in 1-D clusters of `cluster` blocks (none for 1):
// the fused kernels' rows span that many blocks.  `attr` must outlive the
// cudaLaunchKernelEx (CUDA graphs capture it like any launch).
inline cudaLaunchConfig_t RowClusterLaunch(int grid, uint32_t cluster, cudaStream_t stream,
                                           cudaLaunchAttribute& attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  if (cluster > 1) {
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = cluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
  }
  return cfg;
}

// ------------------------------------------------------------- kernel ----
// The calls of one all-reduce block (blockIdx.x < ar_blocks): both outputs of
// its lines written, NaN if the block (its cluster) failed.  Returns whether
// they succeeded.  Block-uniform; every block of a cluster calls it.
template <typename T, int NR>
__device__ __forceinline__ bool FusedBlock(const FusedArgs& f) {
  constexpr int K = kLineElems<T>;
  const KernelArgs& a = f.a;
  const Ws w{a};
  __shared__ BlockStart b0;
  __shared__ RowShared sh;
  const size_t nlines = a.nbytes / 8;
  const bool cluster = f.row_blocks > 1;
  // This thread's first line of every input, loaded while thread 0's control
  // words are in flight.
  FusedIn first{};
  if (static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x < nlines)
    first = LoadFusedIn(f, static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x);
  if (threadIdx.x == 0) ReadBlockStart(w, kSifar, b0);
  __syncthreads();
  const BlockStart st = b0;
  // A dropped block (testing.drop_rank) pulls nothing and takes its own
  // partial for the sum; a block of a failed communicator pulls nothing and
  // fails.  Either way it keeps its part in every cluster exchange: the
  // blocks of a cluster always meet at the same barriers, whatever each one
  // read from Control or met while waiting.
  const bool dropped = st.dropped();
  bool ok = dropped || !st.failed();  // block-uniform; cluster-uniform after each exchange
  bool go = true;                     // cluster-uniform: every exchange so far was ok
  uint32_t epoch = st.epoch;
  CallState s{};
  s.timeout_ns = st.timeout_ns;
  s.failed_peer = -1;
  bool warp0_retried = false;
  // A block may write into another's shared memory only once that block runs:
  // every block arrives now and waits before its first exchange (by then the
  // barrier has long completed), or at exit if it never exchanged.
  bool started_pending = cluster;
  if (cluster) ClusterArriveRelaxed();
  uint32_t exchange = 0;  // row exchanges so far: the parity of RowShared's buffers
  for (int i = 0; i < a.repeat && go; ++i) {
    if (ok && !dropped) {
      const bool wraps = NextCall(w, st, epoch, s);
      InjectSkew(w, st, epoch);
      if (wraps) ok = ClearTaggedAtWrap(w, s);  // block-wide
      if (!ok && s.failed_peer >= 0) RecordFailure(w, kSifar, s);
    }
    // Rounds of kRoundLines: the same count for every block of a cluster (the
    // payload is whole rows, a round whole clusters).
    for (size_t base = static_cast<size_t>(blockIdx.x) * kThreads; base < nlines;
         base += kRoundLines) {
      const size_t line = base + threadIdx.x;
      const bool mine = line < nlines;  // rows within a block: the last block may be partial
      const FusedIn in = base < kRoundLines ? first : mine ? LoadFusedIn(f, line) : FusedIn{};
      uint2 sum = in.x;
      if (mine && ok && !dropped) {
        const bool pulled = PullLine<T, NR, false>(w, s, line, in.x, st.c1.x, st.c1.y, sum);
        if (!pulled && s.failed_peer >= 0) RecordFailure(w, kSifar, s);
        ok = pulled;
      }
      // The new residual and this line's squares.
      float v[K], r[K];
      Unpack<T>(sum, v);
      Unpack<T>(in.residual, r);
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] = __fadd_rn(v[k], r[k]);
      const uint2 new_residual = Pack<T>(v);
      Unpack<T>(new_residual, v);  // the rounded value is what the norm sees
      float ss = 0.f;
      if (mine) {
#pragma unroll
        for (int k = 0; k < K; ++k) ss = __fadd_rn(ss, __fmul_rn(v[k], v[k]));
      }
      const uint32_t parity = exchange++ & 1u;
      float total = BlockRowSum(ss, f.row_lines, sh.warp_sums[parity], ok);
      if (cluster) {
        if (started_pending) {
          ClusterWait();
          started_pending = false;
        }
        total = ClusterRowSum(total, f.row_blocks, sh, parity, ok);
      }
      go = ok;
      if (!go) break;
      size_t at;
      if (mine && DataLine(f, line, at)) {
        const float mean = __fdiv_rn(total, static_cast<float>(f.hidden));
        const float scale = rsqrtf(__fadd_rn(mean, f.eps));
        float g[K];
        Unpack<T>(in.weight, g);
#pragma unroll
        for (int k = 0; k < K; ++k) v[k] = __fmul_rn(v[k], scale);
        Unpack<T>(Pack<T>(v), v);  // y rounded to the payload type, as the model does
#pragma unroll
        for (int k = 0; k < K; ++k) v[k] = __fmul_rn(g[k], v[k]);
        static_cast<uint2*>(a.out)[at] = new_residual;
        static_cast<uint2*>(f.normed)[at] = Pack<T>(v);
      }
    }
    if (!dropped) warp0_retried |= EndCall(w, kSifar, s);
  }
  if (!go) {  // the block (the cluster) failed: both outputs NaN, every line
    FillNaN<T>(a.out, f.data_bytes, threadIdx.x, kThreads);
    FillNaN<T>(f.normed, f.data_bytes, threadIdx.x, kThreads);
  } else if (!dropped) {
    CommitBlock(w, kSifar, st, epoch, warp0_retried);
  }
  if (started_pending) ClusterWait();  // every arrive is waited for
  return go;
}

template <typename T, int NR>
__global__ void __launch_bounds__(kThreads) FusedKernel(FusedArgs f) {
  if (blockIdx.x >= f.ar_blocks) {  // whole clusters of their own: no barrier to meet
    PrefetchShare(f);
    return;
  }
  FusedBlock<T, NR>(f);
}

}  // namespace cuda
}  // namespace sifar

// ------------------------------------------------------- launch, handler ----
// One instance per element type and rank bound; rows longer than a block
// launched as thread-block clusters (cudaLaunchKernelEx, which CUDA graphs
// capture like any launch).
namespace ffi = xla::ffi;

namespace sifar {
namespace {

using cuda::FusedArgs;
using cuda::kThreads;

// Blocks that only prefetch (PrefetchShare). Measured in the decode step
// (2x H200): 16 gained most; 32 a little less; 64 made the call 5 -> 7.7 us,
// a loss.
constexpr int kPrefetchBlocks = 16;

template <typename T, int NR>
cudaError_t LaunchNR(const FusedArgs& f, int grid, cudaStream_t stream) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cuda::RowClusterLaunch(grid, f.row_blocks, stream, attr);
  return cudaLaunchKernelEx(&cfg, cuda::FusedKernel<T, NR>, f);
}
template <typename T>
cudaError_t Launch(const FusedArgs& f, int grid, cudaStream_t stream) {
  if (f.a.nranks <= 2) return LaunchNR<T, 2>(f, grid, stream);
  if (f.a.nranks <= 4) return LaunchNR<T, 4>(f, grid, stream);
  return LaunchNR<T, 8>(f, grid, stream);
}

template <typename T>
void LoadRow() {
  cudaFuncAttributes attr;
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, cuda::FusedKernel<T, 2>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, cuda::FusedKernel<T, 4>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, cuda::FusedKernel<T, 8>));
}

// Enqueues the fused kernel of a call planned by PlanFusedCall (no host
// synchronisation; CUDA-graph safe).
cudaError_t LaunchRankFused(const RankCall& c, const FusedCall& fused, cudaStream_t stream) {
  if (c.comm == nullptr || c.algorithm != kSifar || c.nbytes % fused.row_bytes != 0 ||
      fused.row_blocks != FusedRowBlocks(fused.row_bytes) || fused.row_blocks == 0 ||
      fused.padded_row_bytes != FusedPaddedRowBytes(fused.row_bytes))
    return cudaErrorInvalidValue;
  FusedArgs f{};
  f.a = MakeKernelArgs(c);
  f.a.nbytes = c.nbytes / fused.row_bytes * fused.padded_row_bytes;  // the padded payload
  f.residual = fused.residual;
  f.weight = fused.weight;
  f.normed = fused.normed;
  f.data_bytes = c.nbytes;
  f.data_lines = static_cast<uint32_t>(fused.row_bytes / 8);
  f.row_lines = static_cast<uint32_t>(fused.padded_row_bytes / 8);
  f.row_shift = 0;
  while ((1u << f.row_shift) < f.row_lines) ++f.row_shift;
  f.row_blocks = static_cast<uint32_t>(fused.row_blocks);
  f.hidden = static_cast<uint32_t>(fused.hidden);
  f.eps = fused.eps;
  f.prefetch = static_cast<const char*>(fused.prefetch);
  f.prefetch_bytes = fused.prefetch != nullptr ? fused.prefetch_bytes : 0;
  // The plain kernel's grid for the padded payload: a multiple of the cluster
  // size, since the payload is whole rows and kMaxBlocks whole clusters.
  const int grid = BlocksFor(f.a.nbytes / 8, kThreads);
  f.ar_blocks = static_cast<uint32_t>(grid);
  // Prefetch blocks: whole clusters after the all-reduce's.
  const int extra = f.prefetch_bytes == 0 ? 0
                    : (kPrefetchBlocks + f.row_blocks - 1) / f.row_blocks * f.row_blocks;
  switch (c.elem) {
    case Elem::kF32: return Launch<float>(f, grid + extra, stream);
    case Elem::kBf16: return Launch<__nv_bfloat16>(f, grid + extra, stream);
    case Elem::kF16: return Launch<__half>(f, grid + extra, stream);
    default: return cudaErrorInvalidValue;
  }
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

void PreloadFusedKernels() {
  LoadRow<float>();
  LoadRow<__nv_bfloat16>();
  LoadRow<__half>();
}

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

}  // namespace sifar
