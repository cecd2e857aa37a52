// The fused all-reduce + residual add + RMSNorm kernel (psum_add_rmsnorm):
// the sifar pull of epoch-tagged words exactly as AllReduceKernel runs it
// (the same lines, blocks, per-block epochs, tags, wrap and failure rules),
// then an epilogue on each row of `hidden` elements:
//
//   new_residual = round(float(sum) + float(residual))
//   ss           = fp32 sum of float(new_residual)^2 over the row, in a fixed
//                  order (the same bits on every rank)
//   s            = rsqrt(ss / hidden + eps)
//   normed       = round(float(weight) * float(round(float(new_residual) * s)))
//
// A row is row_lines LL lines (8 payload bytes each), a power of two.  Rows
// of at most one block's lines lie in aligned segments of one block (a
// segmented reduction: warp shuffles, then the row's warps through shared
// memory).  Longer rows span row_blocks whole blocks, launched as one
// thread-block cluster, whose per-block sums meet in distributed shared
// memory, added in cluster-rank order.  Since a round of kMaxBlocks blocks
// holds whole clusters, the line -> block ownership stays BlockOfLine's.
#pragma once

#include "cuda_kernels.cuh"

namespace sifar {
namespace cuda {

struct FusedArgs {
  KernelArgs a;  // in: x, out: the new residual, nbytes: the payload
  const void* residual;
  const void* weight;
  void* normed;
  uint32_t row_lines;   // LL lines per row, a power of two
  uint32_t row_blocks;  // blocks per row: the cluster size (1: rows within a block)
  uint32_t hidden;      // elements per row
  float eps;
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

// One thread's line of the three inputs.
struct FusedIn {
  uint2 x, residual, weight;
};
__device__ __forceinline__ FusedIn LoadFusedIn(const FusedArgs& f, size_t line) {
  return {static_cast<const uint2*>(f.a.in)[line], static_cast<const uint2*>(f.residual)[line],
          static_cast<const uint2*>(f.weight)[line & (f.row_lines - 1)]};
}

// ----------------------------------------------------------- clusters ----
// barrier.cluster split in its two halves: the release/acquire pair orders
// the shared-memory writes before the arrive with the reads after the wait,
// in every block of the cluster.  All threads of every block execute both.
__device__ __forceinline__ void ClusterArrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void ClusterWait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// A 32-bit word of block `rank`'s shared memory (distributed shared memory).
__device__ __forceinline__ uint32_t LoadClusterShared(const void* local, uint32_t rank) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(local));
  uint32_t remote, v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(remote) : "memory");
  return v;
}

// The shared memory of the row reduction.
struct RowShared {
  float warp_sums[kThreads / 32];
  float block_sum;   // read by the other blocks of the cluster
  uint32_t block_ok;
};

// The sum of `v` over this thread's row within the block, in a fixed order
// (butterfly over the row's lanes of a warp: both partners of each step add
// the same two numbers, so every lane ends with the same bits; then the row's
// warps in order).  Rows of at most 32 lines never touch shared memory.
// Block-uniform: all threads call it.
__device__ __forceinline__ float BlockRowSum(float v, uint32_t row_lines, RowShared& sh) {
  const uint32_t width = row_lines < 32u ? row_lines : 32u;
  for (uint32_t o = 1; o < width; o <<= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (row_lines <= 32u) return v;
  const uint32_t warps = (row_lines < kThreads ? row_lines : kThreads) / 32;  // the row's, here
  const uint32_t warp = threadIdx.x / 32;
  if ((threadIdx.x & 31u) == 0) sh.warp_sums[warp] = v;
  __syncthreads();
  const uint32_t first = warp & ~(warps - 1);
  float t = sh.warp_sums[first];
  for (uint32_t k = 1; k < warps; ++k) t = __fadd_rn(t, sh.warp_sums[first + k]);
  return t;
}

// ------------------------------------------------------------- kernel ----
template <typename T, int NR>
__global__ void __launch_bounds__(kThreads) FusedKernel(FusedArgs f) {
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
  bool warp0_retried = false, pending = false;  // pending: a cluster arrive not yet waited for
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
      float total = BlockRowSum(ss, f.row_lines, sh);
      ok = __syncthreads_and(ok) != 0;  // also: warp_sums are read before anyone rewrites them
      if (cluster) {
        if (pending) ClusterWait();  // every block has read the previous exchange
        if (threadIdx.x == 0) {
          sh.block_sum = total;
          sh.block_ok = ok;
        }
        ClusterArrive();
        ClusterWait();
        // In cluster-rank order, which is the blocks' order along the row.
        total = __uint_as_float(LoadClusterShared(&sh.block_sum, 0));
        bool all_ok = LoadClusterShared(&sh.block_ok, 0) != 0;
        for (uint32_t b = 1; b < f.row_blocks; ++b) {
          total = __fadd_rn(total, __uint_as_float(LoadClusterShared(&sh.block_sum, b)));
          all_ok = all_ok && LoadClusterShared(&sh.block_ok, b) != 0;
        }
        ClusterArrive();  // done reading; waited for before the next write or the exit
        pending = true;
        ok = all_ok;
      }
      go = ok;
      if (!go) break;
      if (mine) {
        const float mean = __fdiv_rn(total, static_cast<float>(f.hidden));
        const float scale = rsqrtf(__fadd_rn(mean, f.eps));
        float g[K];
        Unpack<T>(in.weight, g);
#pragma unroll
        for (int k = 0; k < K; ++k) v[k] = __fmul_rn(v[k], scale);
        Unpack<T>(Pack<T>(v), v);  // y rounded to the payload type, as the model does
#pragma unroll
        for (int k = 0; k < K; ++k) v[k] = __fmul_rn(g[k], v[k]);
        static_cast<uint2*>(a.out)[line] = new_residual;
        static_cast<uint2*>(f.normed)[line] = Pack<T>(v);
      }
    }
    if (!dropped) warp0_retried |= EndCall(w, kSifar, s);
  }
  if (!go) {  // the block (the cluster) failed: both outputs NaN, every line
    FillNaN<T>(a.out, a.nbytes, threadIdx.x, kThreads);
    FillNaN<T>(f.normed, a.nbytes, threadIdx.x, kThreads);
  } else if (!dropped) {
    CommitBlock(w, kSifar, st, epoch, warp0_retried);
  }
  if (pending) ClusterWait();  // no block leaves while another may read its shared memory
}

}  // namespace cuda
}  // namespace sifar
