// The fused kernels (psum_add_rmsnorm today), their launch and their FFI
// handler.  A fused kernel runs the sifar pull of epoch-tagged words with the
// call framing of AllReduceKernel (core/device.cuh: the same lines, blocks,
// per-block epochs, tags, wrap and failure rules), then its epilogue
// (fused/epilogue.cuh, a template parameter) on each row of `hidden`
// elements, with one fp32 reduction over the row in a fixed order (the same
// bits on every rank).
//
// A row is data_lines LL lines (8 payload bytes each), laid out in the
// payload padded to row_lines, the next power of two (FusedPaddedRowBytes):
// the padding lines are zero on every rank, pulled like any line (so the
// padded payload keeps BlockOfLine's ownership), add nothing to the row's
// reduction and are never stored.  Rows of at most one block's lines lie in
// aligned segments of one block (a segmented reduction: warp shuffles, then
// the row's warps through shared memory).  Rows of 2-8 blocks span row_blocks
// whole blocks, launched as one thread-block cluster: each block stores its
// sum into every block's shared memory (distributed shared memory), one
// cluster barrier, and every block adds them in cluster-rank order.  Rows of
// 16-64 blocks (over 16 KB) are one cluster of 8 thread blocks too, each
// running `group` consecutive blocks of the protocol (FusedWideBlock).  Since
// a round of kMaxBlocks blocks holds whole rows, the line -> block ownership
// stays BlockOfLine's.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "allreduce/launch.h"
#include "core/cuda_check.h"
#include "core/device.cuh"
#include "fused/epilogue.cuh"
#include "fused/fused.h"
#include "fused/launch.h"
#include "xla/ffi/api/ffi.h"

namespace sifar {
namespace cuda {

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
  float part[2][kMaxClusterBlocks];        // the cluster's blocks' row sums, by cluster rank
  uint32_t part_ok[2][kMaxClusterBlocks];  // and whether each block's lines all succeeded
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
// The calls of one all-reduce block (blockIdx.x < ar_blocks): the epilogue's
// outputs of its lines written, NaN if the block (its cluster) failed.
// Returns whether they succeeded.  Block-uniform; every block of a cluster
// calls it.
template <typename T, int NR, typename E>
__device__ __forceinline__ bool FusedBlock(const FusedArgs& f) {
  const KernelArgs& a = f.a;
  const Ws w{a};
  __shared__ BlockStart b0;
  __shared__ RowShared sh;
  const size_t nlines = a.nbytes / 8;
  const bool cluster = f.row_blocks > 1;
  // This thread's first line of every input, loaded while thread 0's control
  // words are in flight.
  FusedLine<E> first{};
  if (static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x < nlines)
    first = LoadFusedLine<E>(f, static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x);
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
    if (ok && !dropped) {  // block-uniform: BeginCall's agreement has every thread
      BeginCall<false>(w, st, epoch, s, ok, blockIdx.x);
      if (!ok && s.failed_peer >= 0) RecordFailure(w, kSifar, s);
    }
    // Rounds of kRoundLines: the same count for every block of a cluster (the
    // payload is whole rows, a round whole clusters).
    for (size_t base = static_cast<size_t>(blockIdx.x) * kThreads; base < nlines;
         base += kRoundLines) {
      const size_t line = base + threadIdx.x;
      const bool mine = line < nlines;  // rows within a block: the last block may be partial
      const FusedLine<E> in =
          base < kRoundLines ? first : mine ? LoadFusedLine<E>(f, line) : FusedLine<E>{};
      uint2 sum = in.x;
      if (mine && ok && !dropped) {
        const bool pulled = PullLine<T, NR, false, true>(w, s, line, in.x, sum);
        if (!pulled && s.failed_peer >= 0) RecordFailure(w, kSifar, s);
        ok = pulled;
      }
      // The epilogue's kept value and this line's term of the row's reduction.
      uint2 kept = make_uint2(0u, 0u);
      const float term = mine ? E::template Line<T>(sum, in.early, kept) : 0.f;
      const uint32_t parity = exchange++ & 1u;
      float total = BlockRowSum(term, f.row_lines, sh.warp_sums[parity], ok);
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
      if (mine && DataLine(f, line, at))
        E::template Finish<T>(f, at, kept, in.late, E::Row(f, total));
    }
    if (!dropped) warp0_retried |= EndCall(w, kSifar, s);
  }
  if (!go) {  // the block (the cluster) failed: every output NaN, every line
    E::template Fail<T>(f);
  } else if (!dropped) {
    CommitBlock(w, kSifar, st, epoch, warp0_retried);
  }
  if (started_pending) ClusterWait();  // every arrive is waited for
  return go;
}

// ---------------------------------------------------------- wide rows ----
// Rows of 16-64 blocks' lines (32-128 KB padded: float32 hidden 8192-32768,
// 16-bit 12288-65536).  Every line keeps its owning block (BlockOfLine), so
// such a row's lines belong to 16-64 of the protocol's blocks: more than a
// portable cluster holds (8 thread blocks).  So each thread block runs
// `group` = row_blocks / 8 consecutive blocks of the protocol (from block0 =
// blockIdx.x * group), each with its own epoch, tag, wrap, barriers, drop and
// commit, exactly as a thread block of its own would: one line of each per
// thread and round, published together and polled together (PollLines, in
// chunks of kPollChunk lines); the row's 8 thread blocks are one cluster.
// A block whose lines are all padding (hidden 12288: a quarter of its 32 KB)
// still publishes and pulls them: each call of a block must see its peers'
// words, or its next call could overwrite a slot they still read.
// The row's sum has the narrower rows' order (the CPU reference's): per
// protocol block, its warps' butterflies added in order, then the row's blocks
// in order, every block's sum exchanged through distributed shared memory.
constexpr uint32_t kMaxGroup = kMaxRowBlocks / kMaxClusterBlocks;
constexpr uint32_t kPollChunk = 4;  // lines polled together: v[4][NR][2] registers
static_assert(kMaxGroup % kPollChunk == 0, "whole chunks");

struct WideShared {
  BlockStart start[kMaxGroup];                   // each protocol block's start
  float warp_sums[2][kMaxGroup][kThreads / 32];  // by exchange parity, as RowShared's
  float part[2][kMaxRowBlocks];                  // the row's blocks' sums, in row order
  uint32_t part_ok[2][kMaxClusterBlocks];        // each thread block's outcome, by cluster rank
};

// The row's sum for FusedWideBlock, in the narrower rows' order: each
// protocol block's lanes' butterfly and then its warps in order, every
// block's sum sent through distributed shared memory to every thread block of
// the cluster at its place along the row, one cluster barrier, then the row's
// blocks added in order.  `ok` becomes the cluster's AND.  Block-uniform;
// every thread block of the cluster calls it.
__device__ __forceinline__ float WideRowSum(const float (&term)[kMaxGroup], uint32_t group,
                                            uint32_t cluster_rank, WideShared& sh,
                                            uint32_t parity, bool& ok, bool& started_pending) {
#pragma unroll
  for (uint32_t i = 0; i < kMaxGroup; ++i) {
    if (i >= group) break;
    float v = term[i];
#pragma unroll
    for (uint32_t o = 1; o < 32; o <<= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31u) == 0) sh.warp_sums[parity][i][threadIdx.x / 32] = v;
  }
  ok = __syncthreads_and(ok) != 0;
  if (started_pending) {
    ClusterWait();
    started_pending = false;
  }
  // Thread i * 8 + b sends block block0 + i's sum (and thread b this thread
  // block's outcome) into cluster block b's shared memory.
  if (threadIdx.x < group * kMaxClusterBlocks) {
    const uint32_t i = threadIdx.x / kMaxClusterBlocks, to = threadIdx.x % kMaxClusterBlocks;
    float t = sh.warp_sums[parity][i][0];
    for (uint32_t k = 1; k < kThreads / 32; ++k) t = __fadd_rn(t, sh.warp_sums[parity][i][k]);
    StoreClusterShared(&sh.part[parity][cluster_rank * group + i], to, __float_as_uint(t));
    if (i == 0) StoreClusterShared(&sh.part_ok[parity][cluster_rank], to, ok ? 1u : 0u);
  }
  ClusterArrive();
  ClusterWait();
  float total = sh.part[parity][0];
  for (uint32_t b = 1; b < group * kMaxClusterBlocks; ++b) total = __fadd_rn(total, sh.part[parity][b]);
  bool all_ok = sh.part_ok[parity][0] != 0;
  for (uint32_t b = 1; b < kMaxClusterBlocks; ++b) all_ok = all_ok && sh.part_ok[parity][b] != 0;
  ok = all_ok;
  return total;
}

// FusedBlock for the wide rows: the same calls, outcomes and outputs.
// Block-uniform; every thread block of a cluster calls it.
template <typename T, int NR, typename E>
__device__ __forceinline__ bool FusedWideBlock(const FusedArgs& f) {
  const KernelArgs& a = f.a;
  const Ws w{a};
  __shared__ WideShared sh;
  const uint32_t group = f.group;
  const uint32_t block0 = blockIdx.x * group;
  const uint32_t cluster_rank = blockIdx.x % kMaxClusterBlocks;  // 1-D clusters along the grid
  const size_t nlines = a.nbytes / 8;
  // The thread's line of block block0 + i in the round from `round`: round + i * kThreads + t.
  // The first round's x, loaded while the control words are in flight.
  uint2 first[kMaxGroup];
#pragma unroll
  for (uint32_t i = 0; i < kMaxGroup; ++i)
    first[i] = i < group
                   ? LoadXLine(f, static_cast<size_t>(block0 + i) * kThreads + threadIdx.x)
                   : make_uint2(0u, 0u);
  if (threadIdx.x < group) ReadBlockStartOf(w, kSifar, sh.start[threadIdx.x], block0 + threadIdx.x);
  __syncthreads();
  // As FusedBlock, per protocol block: a dropped one pulls nothing (its sums
  // are this rank's partials), one of a failed communicator fails; every
  // thread block keeps its part in every cluster exchange.
  uint32_t epoch[kMaxGroup];
  uint32_t dropped = 0;  // bit i: block block0 + i is dropped (testing.drop_rank)
  bool ok = true;        // block-uniform; cluster-uniform after each exchange
#pragma unroll
  for (uint32_t i = 0; i < kMaxGroup; ++i) {
    epoch[i] = 0;
    if (i >= group) continue;
    epoch[i] = sh.start[i].epoch;
    if (sh.start[i].dropped_at(block0 + i)) dropped |= 1u << i;
    else if (sh.start[i].failed()) ok = false;
  }
  const bool all_dropped = dropped == (1u << group) - 1u;
  const uint32_t mask = sh.start[0].mask();  // one Control word for all blocks
  const uint32_t chain = ChainTag(a.chain);
  bool go = true;  // cluster-uniform: every exchange so far was ok
  CallState s{};
  s.timeout_ns = sh.start[0].timeout_ns;
  s.failed_peer = -1;
  bool warp0_retried = false;
  // As FusedBlock: no remote store into a thread block before it runs.
  bool started_pending = true;
  ClusterArriveRelaxed();
  uint32_t exchange = 0;
  for (int it = 0; it < a.repeat && go; ++it) {
    // Each protocol block begins its call (block-uniform, in block order: the
    // peers' thread blocks run the same blocks in the same order; one skew
    // per thread block).
#pragma unroll
    for (uint32_t i = 0; i < kMaxGroup; ++i) {
      if (i >= group || !ok || ((dropped >> i) & 1u)) continue;
      BeginCall<false>(w, sh.start[i], epoch[i], s, ok, block0 + i, i == 0);
      if (!ok && s.failed_peer >= 0) RecordFailureOf(w, kSifar, s, block0 + i, epoch[i]);
    }
    // Rounds of kRoundLines: the same count for every thread block of a
    // cluster (the payload is whole rows, a round whole rows).
    for (size_t round = static_cast<size_t>(block0) * kThreads; round < nlines;
         round += kRoundLines) {
      const bool first_round = round < kRoundLines;
      // Every block's line: x and the epilogue's early operands loaded
      // together, then x published.
      uint2 x[kMaxGroup];
      typename E::Early early[kMaxGroup];
#pragma unroll
      for (uint32_t i = 0; i < kMaxGroup; ++i) {
        x[i] = make_uint2(0u, 0u);
        early[i] = typename E::Early{};
        if (i >= group) continue;
        const size_t line = round + i * kThreads + threadIdx.x;
        x[i] = first_round ? first[i] : LoadXLine(f, line);
        early[i] = LoadEarlyLine<E>(f, line);
      }
      const bool pulling = ok;  // this thread's lines so far all succeeded
#pragma unroll
      for (uint32_t i = 0; i < kMaxGroup; ++i)
        if (i < group && pulling && !((dropped >> i) & 1u))
          PublishLine(w, round + i * kThreads + threadIdx.x, epoch[i],
                      Tag(chain, epoch[i], mask), x[i]);
      // The sums (this rank's partial on a dropped block's line), then the
      // epilogue's kept values and row terms, chunk by chunk.
      uint2 kept[kMaxGroup];
      float term[kMaxGroup];
#pragma unroll
      for (uint32_t c = 0; c < kMaxGroup; c += kPollChunk) {
        if (c >= group) break;
        size_t line[kPollChunk];
        uint32_t ep[kPollChunk], tag[kPollChunk];
        uint2 mine[kPollChunk], sum[kPollChunk];
        uint32_t want = 0;
#pragma unroll
        for (uint32_t j = 0; j < kPollChunk; ++j) {
          const uint32_t i = c + j;
          line[j] = round + i * kThreads + threadIdx.x;
          ep[j] = epoch[i];
          tag[j] = Tag(chain, epoch[i], mask);
          mine[j] = sum[j] = x[i];
          if (i < group && pulling && !((dropped >> i) & 1u)) want |= 1u << j;
        }
        if (want != 0 && ok) {
          const bool pulled = PollLines<T, NR, kPollChunk>(w, s, want, line, ep, tag, mine, sum);
          // The chunk's first polled block is named (its blocks are polled together).
          if (!pulled && s.failed_peer >= 0)
            RecordFailureOf(w, kSifar, s, block0 + c + __ffs(want) - 1, ep[__ffs(want) - 1]);
          ok = pulled;
        }
#pragma unroll
        for (uint32_t j = 0; j < kPollChunk; ++j) {
          const uint32_t i = c + j;
          if (i >= group) continue;
          term[i] = E::template Line<T>(sum[j], early[i], kept[i]);
        }
      }
      // The late operands, in flight during the exchange.
      typename E::Late late[kMaxGroup];
#pragma unroll
      for (uint32_t i = 0; i < kMaxGroup; ++i)
        late[i] = i < group ? LoadLateLine<E>(f, round + i * kThreads + threadIdx.x)
                            : typename E::Late{};
      float total = WideRowSum(term, group, cluster_rank, sh, exchange++ & 1u, ok, started_pending);
      go = ok;
      if (!go) break;
      const float factor = E::Row(f, total);
#pragma unroll
      for (uint32_t i = 0; i < kMaxGroup; ++i) {
        size_t at;
        if (i >= group || !DataLine(f, round + i * kThreads + threadIdx.x, at)) continue;
        E::template Finish<T>(f, at, kept[i], late[i], factor);
      }
    }
    if (!all_dropped) warp0_retried |= EndCall(w, kSifar, s);
  }
  if (!go) {  // the cluster failed: every output NaN, every line
    E::template Fail<T>(f);
  } else {
#pragma unroll
    for (uint32_t i = 0; i < kMaxGroup; ++i)
      if (i < group && !((dropped >> i) & 1u))
        CommitBlockOf(w, kSifar, sh.start[i], epoch[i], warp0_retried, block0 + i);
  }
  if (started_pending) ClusterWait();  // every arrive is waited for
  return go;
}

// WIDE: rows of 16-64 blocks (FusedWideBlock); else FusedBlock's rows.  E:
// the epilogue.
template <typename T, int NR, bool WIDE, typename E>
__global__ void __launch_bounds__(kThreads) FusedKernel(FusedArgs f) {
  if (blockIdx.x >= f.ar_blocks) {  // whole clusters of their own: no barrier to meet
    PrefetchShare(f);
    return;
  }
  if constexpr (WIDE) {
    FusedWideBlock<T, NR, E>(f);
  } else {
    FusedBlock<T, NR, E>(f);
  }
}

}  // namespace cuda
}  // namespace sifar

// ------------------------------------------------------- launch, handler ----
// One instance per epilogue, element type, rank bound and row width; rows
// longer than a block launched as thread-block clusters (cudaLaunchKernelEx,
// which CUDA graphs capture like any launch).
namespace ffi = xla::ffi;

namespace sifar {
namespace {

using cuda::FusedArgs;
using cuda::kThreads;

// Blocks that only prefetch (PrefetchShare). Measured in the decode step
// (2x H200): 16 gained most; 32 a little less; 64 made the call 5 -> 7.7 us,
// a loss.
constexpr int kPrefetchBlocks = 16;

template <typename T, int NR, bool WIDE, typename E>
cudaError_t LaunchNR(const FusedArgs& f, const FusedLaunch& l, cudaStream_t stream) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cuda::RowClusterLaunch(l.grid, l.cluster, stream, attr);
  return cudaLaunchKernelEx(&cfg, cuda::FusedKernel<T, NR, WIDE, E>, f);
}
template <typename T, bool WIDE, typename E>
cudaError_t LaunchWidth(const FusedArgs& f, const FusedLaunch& l, cudaStream_t stream) {
  if (f.a.nranks <= 2) return LaunchNR<T, 2, WIDE, E>(f, l, stream);
  if (f.a.nranks <= 4) return LaunchNR<T, 4, WIDE, E>(f, l, stream);
  return LaunchNR<T, 8, WIDE, E>(f, l, stream);
}
template <typename T, typename E>
cudaError_t LaunchType(const FusedArgs& f, const FusedLaunch& l, cudaStream_t stream) {
  return l.group > 1 ? LaunchWidth<T, true, E>(f, l, stream) : LaunchWidth<T, false, E>(f, l, stream);
}
template <typename E>
cudaError_t LaunchEpilogue(Elem elem, const FusedArgs& f, const FusedLaunch& l,
                           cudaStream_t stream) {
  switch (elem) {
    case Elem::kF32: return LaunchType<float, E>(f, l, stream);
    case Elem::kBf16: return LaunchType<__nv_bfloat16, E>(f, l, stream);
    case Elem::kF16: return LaunchType<__half, E>(f, l, stream);
    default: return cudaErrorInvalidValue;
  }
}

// Loads a kernel now and checks that its widest cluster can run on this
// device: clusters of 8 of its thread blocks, each with its registers and
// shared memory (a portable size on sm_90 and sm_100, so this only fails on a
// device or build that breaks that promise, and then clearly, at init).
template <typename T, int NR, bool WIDE, typename E>
void LoadKernel() {
  const auto kernel = cuda::FusedKernel<T, NR, WIDE, E>;
  cudaFuncAttributes attr;
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  cudaLaunchAttribute cluster;
  const cudaLaunchConfig_t cfg =
      cuda::RowClusterLaunch(kMaxClusterBlocks, kMaxClusterBlocks, nullptr, cluster);
  int clusters = 0;
  SIFAR_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
  if (clusters < 1)
    throw std::runtime_error(
        "sifar_jax: the fused kernel cannot run clusters of " +
        std::to_string(kMaxClusterBlocks) + " thread blocks of " + std::to_string(kThreads) +
        " threads on this device (" + std::to_string(attr.numRegs) + " registers per thread)");
}
template <typename T, typename E>
void LoadRow() {
  LoadKernel<T, 2, false, E>();
  LoadKernel<T, 4, false, E>();
  LoadKernel<T, 8, false, E>();
  LoadKernel<T, 2, true, E>();
  LoadKernel<T, 4, true, E>();
  LoadKernel<T, 8, true, E>();
}
template <typename E>
void LoadEpilogue() {
  LoadRow<float, E>();
  LoadRow<__nv_bfloat16, E>();
  LoadRow<__half, E>();
}

}  // namespace

cudaError_t LaunchRankFused(const RankCall& c, const FusedCall& fused, cudaStream_t stream,
                            FusedLaunch& l) {
  if (c.comm == nullptr || c.algorithm != kSifar || fused.row_blocks == 0 ||
      fused.epilogue < 0 || fused.epilogue >= kNumFusedEpilogues ||
      fused.row_blocks != FusedRowBlocks(fused.row_bytes) || c.nbytes % fused.row_bytes != 0 ||
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
  l.cluster = static_cast<uint32_t>(FusedClusterBlocks(fused.row_blocks));
  l.group = static_cast<uint32_t>(FusedBlocksPerThreadBlock(fused.row_blocks));
  f.row_blocks = l.group > 1 ? l.cluster : static_cast<uint32_t>(fused.row_blocks);
  f.group = l.group;
  f.hidden = static_cast<uint32_t>(fused.hidden);
  f.eps = fused.eps;
  f.prefetch = static_cast<const char*>(fused.prefetch);
  f.prefetch_bytes = fused.prefetch != nullptr ? fused.prefetch_bytes : 0;
  // The plain kernel's blocks for the padded payload (whole rows: a multiple
  // of the row's blocks, since kMaxBlocks holds whole rows), `group` of them
  // per thread block: whole clusters.
  const int blocks = BlocksFor(f.a.nbytes / 8, kThreads);
  if (l.group < 1 || l.group > cuda::kMaxGroup || l.cluster < 1 ||
      l.cluster > static_cast<uint32_t>(kMaxClusterBlocks) ||
      blocks % (l.group * l.cluster) != 0)
    return cudaErrorInvalidValue;
  const int grid = blocks / static_cast<int>(l.group);
  f.ar_blocks = static_cast<uint32_t>(grid);
  // Prefetch blocks: whole clusters after the all-reduce's.
  const int extra = f.prefetch_bytes == 0
                        ? 0
                        : (kPrefetchBlocks + static_cast<int>(l.cluster) - 1) /
                              static_cast<int>(l.cluster) * static_cast<int>(l.cluster);
  l.grid = grid + extra;
  switch (fused.epilogue) {  // the table's epilogues (fused.h)
#define SIFAR_EPILOGUE_LAUNCH(e, name) \
  case e: return LaunchEpilogue<cuda::name>(c.elem, f, l, stream);
    SIFAR_FUSED_EPILOGUES(SIFAR_EPILOGUE_LAUNCH)
#undef SIFAR_EPILOGUE_LAUNCH
    default: return cudaErrorInvalidValue;
  }
}

namespace {

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
  FusedLaunch l;
  const cudaError_t e = LaunchRankFused(call, fused, stream, l);
  if (e == cudaSuccess) return ffi::Error::Success();
  cudaGetLastError();  // a failed launch is reported here, not to the next CUDA call
  return ffi::Error(
      ffi::ErrorCode::kInternal,
      "sifar_jax: psum_add_rmsnorm: kernel launch failed (rows of " +
          std::to_string(fused.row_bytes) + " bytes, " + std::to_string(fused.row_blocks) +
          " blocks per row: " + std::to_string(l.grid) + " thread blocks in clusters of " +
          std::to_string(l.cluster) + ", " + std::to_string(l.group) +
          " blocks each): " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

}  // namespace

void PreloadFusedKernels() {
#define SIFAR_EPILOGUE_LOAD(e, name) LoadEpilogue<cuda::name>();
  SIFAR_FUSED_EPILOGUES(SIFAR_EPILOGUE_LOAD)
#undef SIFAR_EPILOGUE_LOAD
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
