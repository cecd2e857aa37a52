// The persistent step's weight stream: one producer warp per block copies the block's share of
// every projection, layer after layer, into a ring of shared-memory stages with bulk copies
// (TMA, completing on an mbarrier), bounded only by the ring, never by the data (the weights do
// not depend on the activations): it keeps the memory busy while the consumers wait at a grid
// barrier, run the attention or a norm. The consumers (the block's kWarps warps) multiply each
// stage by the input in shared memory and release it.
//
// A stage holds kRingRows weight rows' next kSlab bytes (one bulk copy per row): warp w owns the
// rows in slots kWarpRows * w + i for a round of stages (K / kSlab of them), and lane l adds up the
// chunks l, l + 32, ... of each row across the round, so a row's sum is fp8_matvec's lanes-32
// order (the same bits as the row kernel; kSlab is a multiple of 32 chunks). A block takes the
// items b, b + g, ... of a projection (b: the block among the g blocks of its rank); an item is one row (kWarpRows items per warp
// and round) or, for gate_up, a (gate, up) pair of rows (in slots 2i, 2i + 1).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "step/device_math.cuh"

namespace sifar {
namespace cuda {
namespace phase {

constexpr int kWarpRows = 2;                           // rows per consumer warp and stage
constexpr int kRingRows = kWarpRows * kWarps;          // rows per stage
constexpr int kStageBytes = 32 * 1024;                 // bytes per stage
constexpr int kSlab = kStageBytes / kRingRows;         // one row's bytes per stage
constexpr int kSlabChunks = kSlab / 16;                // 16-byte chunks of a row per stage
static_assert(kSlabChunks % 32 == 0, "lane l's chunks of a row must stay l + 32 i");
static_assert(kWarpRows % 2 == 0 && kRingRows <= 32, "gate_up's pairs in a warp; a lane per row");

// The ring in this block's shared memory, and this thread's place in its stage sequence.
struct Ring {
  unsigned char* buf;  // stages x kStageBytes, 128-aligned
  uint64_t* full;      // [stages]: the copies landed (1 arrival + the bytes)
  uint64_t* empty;     // [stages]: every consumer thread is done with it (kThreads arrivals)
  int stages;
  unsigned n;          // stages passed so far
};

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One thread: the ring's barriers (before any other thread of the block uses them).
__device__ __forceinline__ void RingInit(const Ring& r) {
  for (int s = 0; s < r.stages; ++s) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(SmemAddr(r.full + s)));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddr(r.empty + s)),
                 "r"(kThreads));
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Waits for the phase of `bar` with this parity to complete (bounded: Deadline).
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  const uint32_t a = SmemAddr(bar);
  Deadline d;
  while (true) {
    uint32_t ok;
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(ok) : "r"(a), "r"(parity) : "memory");
    if (ok) return;
    d.Tick();
  }
}

// This block's part of projection m: items m.b, m.b + m.g, ...; `per_round` items per round
// of stages, `slabs` stages per round.
struct Part {
  int n, per_round, rounds, slabs;
};
__device__ __forceinline__ Part PartOf(const Mat& m) {
  const int g = m.g, b = m.b;
  Part p;
  p.n = b < m.items ? (m.items - b + g - 1) / g : 0;
  p.per_round = m.rows == 2 ? kRingRows / 2 : kRingRows;
  p.rounds = (p.n + p.per_round - 1) / p.per_round;
  p.slabs = (m.k + kSlab - 1) / kSlab;
  return p;
}
// The item slot q of round r belongs to (-1: none), and the weight row it holds.
__device__ __forceinline__ int SlotItem(const Mat& m, const Part& p, int r, int q) {
  const int t = r * p.per_round + (m.rows == 2 ? q / 2 : q);
  return t < p.n ? m.b + t * m.g : -1;
}
__device__ __forceinline__ int SlotRow(const Mat& m, int item, int q) {
  return m.rows == 2 ? item + (q & 1) * m.pair : item;
}

// The producer warp's L2 policy for the weights: read once per step, first out of L2.
__device__ __forceinline__ uint64_t EvictFirst() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// The producer warp: every stage of projection m, in the consumers' order. Lane q < kRingRows
// copies slot q's row.
__device__ __forceinline__ void ProduceMat(const Mat& m, Ring& ring, uint64_t policy) {
  const int lane = threadIdx.x % 32;
  const Part p = PartOf(m);
  for (int r = 0; r < p.rounds; ++r) {
    const int item = lane < kRingRows ? SlotItem(m, p, r, lane) : -1;
    const uint8_t* src = item >= 0 ? m.w + static_cast<size_t>(SlotRow(m, item, lane)) * m.ld
                                   : nullptr;
    const unsigned rows = __popc(__ballot_sync(0xffffffffu, item >= 0));
    for (int s = 0; s < p.slabs; ++s, ++ring.n) {
      const int st = static_cast<int>(ring.n % ring.stages);
      MbarWait(ring.empty + st, ((ring.n / ring.stages) & 1) ^ 1);
      const uint32_t bytes = static_cast<uint32_t>(min(kSlab, m.k - s * kSlab));
      const uint32_t full = SmemAddr(ring.full + st);
      if (lane == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(full),
                     "r"(rows * bytes) : "memory");
      __syncwarp();
      if (item >= 0)
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
            " [%0], [%1], %2, [%3], %4;" ::"r"(SmemAddr(ring.buf + st * kStageBytes + lane * kSlab)),
            "l"(src + s * kSlab), "r"(bytes), "r"(full), "l"(policy) : "memory");
    }
  }
}

// The producer warp: every stage of every projection mat_at(l, p), l < layers, p < 4, in the
// consumers' order.
template <class MatAt>
__device__ __forceinline__ void Produce(MatAt mat_at, int layers, Ring& ring) {
  const uint64_t policy = EvictFirst();
  for (int l = 0; l < layers; ++l)
    for (int pj = 0; pj < 4; ++pj) ProduceMat(mat_at(l, pj), ring, policy);
}

// A consumer GEMV phase: projection m times xs (swizzled floats, XQuad) from the ring, its
// weights e4m3 or (kBf16) bf16: a 16-byte chunk is 16 or 8 weights, 4 or 2 of xs's quads (a
// bf16 chunk c is half h = c & 1 of the 16-input group c >> 1: its quads XQuad(c >> 1, 2h),
// XQuad(c >> 1, 2h + 1), which a warp's 8-lane phases also read from distinct banks). m.k (in
// bytes) is a multiple of 16 (PlanLlamaStep checks it): a slab is whole chunks. Warp w owns the
// slots kWarpRows * w + i of each round. Per item, lane 0 calls pre(item) -> float2 when the item's
// round starts (what its epilogue reads from global memory: a scale, the residual; the loads'
// latency hides under the round) and epi(item, sum of its row, sum of its second row (gate_up's
// up) or 0, pre's value) when the round ends. A full slab's chunks are one branch-free block
// with every shared load issued first; a slot past the block's items sums stale bytes that are
// never stored. The e4m3 decode is Chunk's conversions (integer decodes measured slower:
// docs/performance.md, Ideas tried, 2026-12-06).
template <bool kBf16, class Pre, class Epi>
__device__ __forceinline__ void RingGemv(const Mat& m, Ring& ring, const float4* xs, Pre pre,
                                         Epi epi) {
  constexpr int R = kWarpRows, kU = kSlabChunks / 32;  // rows per warp, chunks per lane and row
  constexpr int kQ = kBf16 ? 2 : 4;                     // input quads per chunk
  const Part p = PartOf(m);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sw = (lane >> 1) & 3;
  for (int r = 0; r < p.rounds; ++r) {
    int item[R];
    float2 pr[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      item[i] = SlotItem(m, p, r, R * warp + i);
      pr[i] = make_float2(0.0f, 0.0f);
      if (lane == 0 && item[i] >= 0 && (m.rows == 1 || i % 2 == 0)) pr[i] = pre(item[i]);
    }
    float acc[R];
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.0f;
    for (int s = 0; s < p.slabs; ++s, ++ring.n) {
      const int st = static_cast<int>(ring.n % ring.stages);
      MbarWait(ring.full + st, (ring.n / ring.stages) & 1);
      const int chunks = min(kSlab, m.k - s * kSlab) / 16;
      const uint4* w = reinterpret_cast<const uint4*>(ring.buf + st * kStageBytes + R * warp * kSlab);
      // The slab's inputs: its first group, kQ * s * kSlabChunks / 4, is a multiple of 8
      // (kSlabChunks % 32 == 0, asserted above), so a local group's swizzle is the global one's.
      const float4* x = xs + kQ * s * kSlabChunks;
      // Chunk c's input quad j (the kernel's bf16 rows read a half group each).
      const auto quad = [&](int c, int j) {
        return kBf16 ? x[XQuad(c >> 1, 2 * (c & 1) + j)] : x[4 * c + (j ^ sw)];
      };
      const auto dot = [](const uint4& v, const float4* q) {
        if constexpr (kBf16) return ChunkBf16(v, q);
        else return Chunk(v, q);
      };
      if (chunks == kSlabChunks) {
        float4 q[kU][kQ];
        uint4 a[kU][R];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int c = lane + 32 * u;
#pragma unroll
          for (int j = 0; j < kQ; ++j) q[u][j] = quad(c, j);
#pragma unroll
          for (int i = 0; i < R; ++i) a[u][i] = w[i * kSlabChunks + c];
        }
#pragma unroll
        for (int u = 0; u < kU; ++u)
#pragma unroll
          for (int i = 0; i < R; ++i) acc[i] = __fadd_rn(acc[i], dot(a[u][i], q[u]));
      } else {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int c = lane + 32 * u;
          if (c >= chunks) break;
          float4 q[kQ];
#pragma unroll
          for (int j = 0; j < kQ; ++j) q[j] = quad(c, j);
#pragma unroll
          for (int i = 0; i < R; ++i) acc[i] = __fadd_rn(acc[i], dot(w[i * kSlabChunks + c], q));
        }
      }
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddr(ring.empty + st))
                   : "memory");
    }
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = WarpSum(acc[i]);
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if (item[i] < 0) continue;
        if (m.rows == 1) epi(item[i], acc[i], 0.0f, pr[i]);
        else if (i % 2 == 0) epi(item[i], acc[i], acc[i + 1], pr[i]);
      }
    }
  }
}

}  // namespace phase
}  // namespace cuda
}  // namespace sifar
