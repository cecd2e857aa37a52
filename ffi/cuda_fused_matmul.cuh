// psum_add_rmsnorm_matmul: the fused all-reduce + residual add + RMSNorm of
// cuda_fused.cuh, and the matmul that reads its normalised row, in one launch
// (batch-1 decode: one row).
//
// Why: a decode step's layer tail is all-reduce, add, norm, then a matmul
// whose time is reading its weight from HBM.  In two kernels the weight reads
// start only when the all-reduce has finished; here the matmul blocks issue
// their first weight loads at kernel start and wait for the normalised row
// while those loads are in flight, so the all-reduce's round trip to the
// peers overlaps the weight streaming instead of preceding it.
//
// The grid (fixed for the process: MatmulGrid in cuda_fused_matmul.cu):
//   blocks [0, ar_blocks)   the fused call's all-reduce blocks, unchanged
//                           (FusedBlock); each publishes in `ready` the count
//                           of the call whose rows it has written;
//   the others              the matmul's work items (protocol.h,
//                           MatmulSplitOf): a tile of 512 bytes of columns
//                           times a range of rows.  Each warp reads 512
//                           contiguous bytes of a row per load (whole DRAM
//                           bursts), its rows w, w + 8, ... of the range.
// Every block reads the lane's call number at start; the last block of the
// launch to finish advances it (after every block has read it, whatever the
// grid), and the matmul blocks wait for ready[b] == that number.
//
//   y[c] = round(sum over k of float(normed[k]) * float(matrix[k][c]))
// in fp32, in a fixed order: per split, each warp's rows ascending (fused
// multiply-adds), then the 8 warps in order; then the splits in order (the
// last item of a tile to finish adds the others' partials).  The CPU backend
// (cpu_fused.cc) runs that order.
#pragma once

#include "cuda_fused.cuh"

namespace sifar {
namespace cuda {

// A ready word's value for a call that failed (NaN outputs): the readers
// write NaN too.
constexpr uint32_t kReadyFailed = 0x80000000u;
#ifndef SIFAR_MATMUL_BATCH
#define SIFAR_MATMUL_BATCH 8
#endif

constexpr int kMatmulWarps = kThreads / 32;
constexpr int kMatmulBatch = SIFAR_MATMUL_BATCH;  // 16-byte loads in flight per thread
// Blocks resident per SM (launch bounds): two leave the all-reduce blocks the
// 128 registers their fast path uses (cuda_fused.cuh) without spilling.
constexpr int kMatmulBlocksPerSM = 2;
constexpr int kMaxTileCols = kMatmulTileBytes / 2;  // 2-byte elements
constexpr int kMaxHidden = 8192;                    // the largest row FusedRowBlocks takes (16 KB)

struct MatmulArgs {
  FusedArgs f;         // the fused call: normed is what the matmul reads
  const void* matrix;  // [hidden][cols], row-major
  void* y;             // [cols]
  uint32_t cols;       // a multiple of the elements in 16 bytes
  MatmulSplit split;   // MatmulSplitOf(hidden, cols, element size)
};

// The weight is read once per call: not kept in L1.
__device__ __forceinline__ uint4 LoadStreaming16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// [0]: the lane's generation (calls completed), [1]: blocks of this launch that exited.
__device__ __forceinline__ uint32_t* MatmulCalls(const Ws& w) {
  return reinterpret_cast<uint32_t*>(w.lane(w.a.rank) + w.a.lay.lane.matmul_calls);
}
// A ready word's call number: 1 .. 2^31 - 1 (never 0, the zeroed word; never the failed bit).
__device__ __forceinline__ uint32_t CallNumber(uint32_t generation) {
  return generation % kReadyFailed % (kReadyFailed - 1u) + 1u;
}
// The block's last act: the launch's last block to exit advances the
// generation (the next launch, ordered after this one, reads the new value).
__device__ __forceinline__ void ExitBlock(const Ws& w, uint32_t generation) {
  __syncthreads();  // every thread of the block read the generation
  if (threadIdx.x != 0) return;
  uint32_t* calls = MatmulCalls(w);
  if (atomicAdd(calls + 1, 1u) == gridDim.x - 1) {
    calls[1] = 0;
    calls[0] = generation + 1;
  }
}
__device__ __forceinline__ uint32_t* MatmulReady(const Ws& w) {
  return reinterpret_cast<uint32_t*>(w.lane(w.a.rank) + w.a.lay.lane.matmul_ready);
}
__device__ __forceinline__ uint32_t* MatmulCount(const Ws& w) {
  return reinterpret_cast<uint32_t*>(w.lane(w.a.rank) + w.a.lay.lane.matmul_count);
}
__device__ __forceinline__ float* MatmulPartial(const Ws& w) {
  return reinterpret_cast<float*>(w.lane(w.a.rank) + w.a.lay.lane.matmul_partial);
}

// Elements in 16 bytes of a weight row (AddLine unpacks them to fp32).
template <typename T>
constexpr int kColsPerLoad = 4 * Elem<T>::kPerWord;
template <typename T>
__device__ __forceinline__ void StoreElem(void* y, uint32_t i, float v);
template <>
__device__ __forceinline__ void StoreElem<float>(void* y, uint32_t i, float v) {
  static_cast<float*>(y)[i] = v;
}
template <>
__device__ __forceinline__ void StoreElem<__nv_bfloat16>(void* y, uint32_t i, float v) {
  static_cast<__nv_bfloat16*>(y)[i] = __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ void StoreElem<__half>(void* y, uint32_t i, float v) {
  static_cast<__half*>(y)[i] = __float2half_rn(v);
}

// Thread b < ar_blocks of a matmul block: waits until all-reduce block b has
// written call n's rows (one word per thread, so the block sees the last of
// them one L2 latency after it lands).  `failed` becomes true when that
// block's call failed.  The all-reduce blocks report their own timeouts; this
// wait gives up (recording a failure) only past twice the timeout plus the
// injected skew, longer than any all-reduce that succeeds may take, or at
// once when the communicator has failed.
__device__ inline bool WaitRowsReady(const Ws& w, uint32_t n, uint64_t timeout_ns, bool& failed) {
  const uint32_t* ready = MatmulReady(w) + threadIdx.x;
  CallState s{};
  s.timeout_ns = timeout_ns;
  s.failed_peer = -1;
  s.epoch = n;
  uint32_t v;
  for (uint32_t spins = 0; ((v = LoadAcquireGpu(ready)) & ~kReadyFailed) != n; ++spins) {
    if (Expired(w, s, w.a.rank, spins)) {  // this rank's own blocks never wrote the rows
      if (s.failed_peer >= 0) RecordFailure(w, kSifar, s);
      return false;
    }
  }
  failed = (v & kReadyFailed) != 0;
  return true;
}

// Rows [r0, r1) of the normed row into shared memory as fp32, 16 bytes per
// thread (r0 and r1 - r0 are multiples of the elements in 16 bytes).
template <typename T>
__device__ __forceinline__ void StageRows(const void* normed, uint32_t r0, uint32_t r1, float* x) {
  constexpr uint32_t E = kColsPerLoad<T>;
  for (uint32_t v = threadIdx.x; v * E < r1 - r0; v += kThreads) {
    const uint4 line = __ldcg(reinterpret_cast<const uint4*>(static_cast<const T*>(normed) + r0) + v);
    AddLine<T>(x + r0 + v * E, line, true);  // the 16 bytes as fp32
  }
}

// The shared memory of the matmul blocks.
struct MatmulShared {
  float x[kMaxHidden];                          // the normed row
  float warp_part[kMatmulWarps][kMaxTileCols];  // [warp][tile column]
  uint32_t last;
};

template <typename T, int NR>
__global__ void __launch_bounds__(kThreads, kMatmulBlocksPerSM) FusedMatmulKernel(MatmulArgs m) {
  const FusedArgs& f = m.f;
  const Ws w{f.a};
  // This call's number on the lane: the same in every block of the launch.
  const uint32_t generation = MatmulCalls(w)[0];
  const uint32_t n = CallNumber(generation);
  if (blockIdx.x < f.ar_blocks) {
    const bool ok = FusedBlock<T, NR>(f);
    __syncthreads();  // the block's rows are written before thread 0's release
    if (threadIdx.x == 0) StoreReleaseGpu(MatmulReady(w) + blockIdx.x, n | (ok ? 0u : kReadyFailed));
    ExitBlock(w, generation);
    return;
  }
  constexpr int C = kColsPerLoad<T>;
  __shared__ MatmulShared sh;
  const MatmulSplit sp = m.split;
  const uint32_t items = sp.tiles * sp.splits;
  const uint32_t blocks = gridDim.x - f.ar_blocks;
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x & 31u;
  const uint32_t hidden = f.hidden;
  const uint4* mat = static_cast<const uint4*>(m.matrix);
  const uint32_t row_loads = m.cols / C;  // 16-byte loads per weight row
  bool waited = false, go = true;
  for (uint32_t item = blockIdx.x - f.ar_blocks; item < items; item += blocks) {
    const uint32_t tile = item / sp.splits, split = item % sp.splits;
    const uint32_t r0 = split * sp.chunk;
    const uint32_t r1 = min(r0 + sp.chunk, hidden);
    const uint32_t col_load = tile * 32 + lane;  // this thread's 16 bytes of every row
    const bool col_ok = col_load < row_loads;
    const uint32_t steps = (r1 - r0 + kMatmulWarps * kMatmulBatch - 1) / (kMatmulWarps * kMatmulBatch);
    float acc[C];
#pragma unroll
    for (int c = 0; c < C; ++c) acc[c] = 0.f;
    // Two batches of loads in flight: step s + 1's loads are issued before step s's
    // multiply-adds (registers in two named sets: no dynamically indexed array).
    auto load = [&](uint4 (&wv)[kMatmulBatch], uint32_t step) {
      const uint32_t rb = r0 + step * kMatmulWarps * kMatmulBatch + warp;
#pragma unroll
      for (int b = 0; b < kMatmulBatch; ++b) {
        const uint32_t r = rb + b * kMatmulWarps;
        wv[b] = go && col_ok && step < steps && r < r1
                    ? LoadStreaming16(mat + static_cast<size_t>(r) * row_loads + col_load)
                    : make_uint4(0u, 0u, 0u, 0u);
      }
    };
    auto accumulate = [&](const uint4 (&wv)[kMatmulBatch], uint32_t step) {
      const uint32_t rb = r0 + step * kMatmulWarps * kMatmulBatch + warp;
#pragma unroll
      for (int b = 0; b < kMatmulBatch; ++b) {
        const uint32_t r = rb + b * kMatmulWarps;
        if (step < steps && r < r1) {
          float wf[C];
          AddLine<T>(wf, wv[b], true);  // the 16 bytes as fp32
          const float xv = sh.x[r];
#pragma unroll
          for (int c = 0; c < C; ++c) acc[c] = __fmaf_rn(xv, wf[c], acc[c]);
        }
      }
    };
    uint4 wa[kMatmulBatch], wb[kMatmulBatch];
    load(wa, 0);
    load(wb, 1);
    if (!waited) {  // block-uniform: the block's first loads are in flight while it waits
      bool ok = true;
      if (threadIdx.x < f.ar_blocks) {
        bool failed = false;
        const Control* ctl = w.ctl(w.a.rank);
        const uint64_t timeout_ns = 2 * LoadLLWord(&ctl->timeout_ns) + LoadStrong(&ctl->skew_max_ns);
        ok = WaitRowsReady(w, n, timeout_ns, failed) && !failed;
      }
      go = __syncthreads_and(ok) != 0;
      waited = true;
    }
    if (go) {  // this item's rows of the normed row (the previous item's readers are done)
      StageRows<T>(f.normed, r0, r1, sh.x);
      __syncthreads();
    }
    if (go) {
      for (uint32_t step = 0; step < steps; step += 2) {
        accumulate(wa, step);
        load(wa, step + 2);
        accumulate(wb, step + 1);
        load(wb, step + 3);
      }
    }
    // The warps' sums of each column, in warp order.
#pragma unroll
    for (int c = 0; c < C; ++c) sh.warp_part[warp][lane * C + c] = acc[c];
    __syncthreads();
    const uint32_t tc = sp.tile_cols;
    float part = 0.f;
    if (threadIdx.x < tc) {
      part = sh.warp_part[0][threadIdx.x];
      for (int k = 1; k < kMatmulWarps; ++k) part = __fadd_rn(part, sh.warp_part[k][threadIdx.x]);
    }
    if (!go) part = __int_as_float(0x7fc00000);  // NaN: a failed call never looks plausible
    const uint32_t col = tile * tc + threadIdx.x;
    if (sp.splits == 1) {
      if (threadIdx.x < tc && col < m.cols) StoreElem<T>(m.y, col, part);
    } else {
      // Publish this split's partial; the tile's last item adds them all in split order.
      float* partial = MatmulPartial(w);
      if (threadIdx.x < tc) partial[static_cast<size_t>(item) * kMaxTileCols + threadIdx.x] = part;
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();  // the partial before the count (the classic last-block reduction)
        const uint32_t done = atomicAdd(MatmulCount(w) + tile, 1u);
        sh.last = done == sp.splits - 1 ? 1u : 0u;
      }
      __syncthreads();
      if (sh.last) {
        __threadfence();
        if (threadIdx.x < tc && col < m.cols) {
          const float* p = partial + static_cast<size_t>(tile) * sp.splits * kMaxTileCols + threadIdx.x;
          // Loads in groups (one L2 latency each), added in split order.
          constexpr uint32_t G = 8;
          float t = 0.f;
          for (uint32_t k0 = 0; k0 < sp.splits; k0 += G) {
            float v[G];
#pragma unroll
            for (uint32_t j = 0; j < G; ++j)
              v[j] = k0 + j < sp.splits ? __ldcg(p + (k0 + j) * kMaxTileCols) : 0.f;
#pragma unroll
            for (uint32_t j = 0; j < G; ++j)
              if (k0 + j < sp.splits) t = k0 + j == 0 ? v[j] : __fadd_rn(t, v[j]);
          }
          StoreElem<T>(m.y, col, t);
        }
        if (threadIdx.x == 0) MatmulCount(w)[tile] = 0;  // the next call counts from zero
      }
    }
    __syncthreads();  // warp_part and sh.last are written again by the next item
  }
  ExitBlock(w, generation);
}

}  // namespace cuda
}  // namespace sifar
