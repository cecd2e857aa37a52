// Probe: does one persistent kernel that streams all of a layer's projection weights back to
// back (the "megakernel" setting) beat XLA's chain of separate dots on Llama-8B's TP=1 shapes?
// The hypothesis: XLA pays each kernel's launch ramp and tail (4 matmuls + ~10 small fusions per
// layer, ~19 us per layer of idle memory), while a kernel whose loads never depend on the
// activations can fetch the next projection's weights while its blocks wait for each other.
//
// The kernel (one block per multiprocessor, all resident: a cooperative launch):
//   - one producer thread per block copies its share of each projection's weight, in 16 KiB
//     chunks, into a ring of shared-memory stages with bulk copies (TMA, mbarrier-tracked); it
//     runs ahead across projections and layers, bounded only by the ring, never by the data;
//     each consumer thread releases a stage with its own arrival;
//   - the consumer warps multiply each chunk by the activation vector in shared memory;
//   - a projection's output is complete once every block has added its part: a grid barrier
//     (a counter, release/acquire at gpu scope) between projections, 4 per layer;
//   - per layer, in order: RMSNorm -> qkv -> o (q stands in for the attention output) ->
//     residual add -> RMSNorm -> gate_up -> SwiGLU -> down -> residual add; bf16 activations
//     rounded where XLA's decoder rounds them, float32 sums.
// The weights are stored tiled: 8 columns x K rows contiguous (16-byte vectors), gate and up
// columns interleaved, so a block's share is one contiguous byte range (stream-K: ranges of
// whole 16 KiB chunks, each block within one chunk of the others; a column split between two
// blocks is added up by its reader from two partial sums, deterministic).
//
// Each configuration is checked first on 2 layers against a float64 reference (the host
// applies the same bf16 roundings) with its output poisoned, then timed on 32 layers (14 GB of
// weights) as the median of 15 launches. The variants (template parameters): the inputs read
// in a loop or batched; no run-ahead (the producer waits for the barrier); no fence before the
// barrier's release; L2 prefetches ahead of the ring (PF); the values carrying their
// projection's tag instead of a barrier (SYNC 2); each norm's scale preloaded (FIX bit 0);
// gate_up split at any chunk (FIX bit 1); and four timing-only modes that run one part of the
// kernel (MODE 1-4). ATTN: the decode step's attention as a phase between qkv and o
// (attention_phase.cuh: RoPE, the new key and value into the cache, split-K attention over KV
// 1024 whose keys and values come through the ring, a merge by each head's last block, one more
// grid barrier per layer), checked against the float64 reference with the attention and the
// cache slots it writes. XLA's side: bench/probes/layer_stream_xla.py (the same math, and the
// layers with the decoder's own attention).
//
// Then the best configuration as one launch, one launch per layer and two launches per layer
// (qkv, then the rest: where XLA's attention would sit), each a CUDA graph; and per-block stamps
// of the middle layer's projections for a few configurations.
//
// Measured on H200s (docs/performance.md, 2026-12-02): 108.5 us per layer with the norm scales
// preloaded (110.6-111.6 without) against XLA's 116.6-117.4 for the same math and 112.0-113.4
// for its four dots alone; the weights alone stream at 95.6-99.9 us per layer; the barriers and
// the work between projections cost the rest (the stamps of the middle layer say where). One
// launch per layer: 114.2; two per layer: 119.1 (slower than XLA). With the attention inside:
// 115.7-116.0 against 125.2 for XLA's layers with the decoder's attention (same call).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a bench/probes/layer_stream.cu -o /tmp/ls
//   /tmp/ls                 # one H200 (~15 GB, ~20 s): every variant
//   /tmp/ls --attention     # the best configuration without and with the attention
//   bash bench/probes/sanitize_layer_stream.sh   # --sanitize under compute-sanitizer
//   python -m bench.probes.layer_stream_xla
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "probe_util.cuh"
#include "attention_phase.cuh"


// One rank's Llama-8B shapes at LS_TP (-DLS_TP=2: TP=2's per-rank shapes, no all-reduce).
constexpr int kHidden = 4096, kQkv = attn::kKv * attn::kPerHead, kFfn = 14336 / LS_TP;
constexpr int kQ = attn::kKv * attn::kGroup * attn::kD;  // the attention's output: o's K
// The projection input's elements in shared memory (also the attention phase's scratch).
constexpr int kXs = std::max(std::max(kFfn, kHidden), 2 * attn::kScratch);
constexpr int kMaxCols = 32;  // column vectors one block may touch in one projection
constexpr float kEps = 1e-5f;
constexpr long long kSpinLimit = 1ll << 26;  // a lost arrival traps instead of hanging

// The four projections of a layer, in order: (K, N).
__host__ __device__ constexpr int ProjK(int p) { return p == 3 ? kFfn : p == 1 ? kQ : kHidden; }
__host__ __device__ constexpr int ProjN(int p) {
  return p == 0 ? kQkv : p == 1 ? kHidden : p == 2 ? 2 * kFfn : kHidden;
}
// Ranges are split in units of this many chunks: gate_up keeps a gate column and its up column
// in one block (its SwiGLU is then the block's own epilogue), the rest split anywhere.
// fine: gate_up split at any chunk too (a pair split between two blocks is finished by its
// readers, FIX bit 1).
__host__ __device__ constexpr int ProjUnit(int p, int cv, bool fine) {
  return p == 2 && !fine ? 2 * (kHidden / cv) : 1;
}

// Block b's chunks (of cv 16-byte vectors) of projection p: [q0, q1).
__host__ __device__ inline void BlockRange(int p, int cv, int b, int nb, int& q0, int& q1,
                                           bool fine = false) {
  const int unit = ProjUnit(p, cv, fine);
  const long long units = (long long)(ProjN(p) / 8) * (ProjK(p) / cv) / unit;
  q0 = (int)(units * b / nb) * unit;
  q1 = (int)(units * (b + 1) / nb) * unit;
}

struct Params {
  const uint4* const* w;  // [layers * 4] tiled weights
  const bf16* norm;       // [layers][2][kHidden] RMSNorm scales (attention, mlp)
  const bf16* x_in;       // [kHidden]
  bf16* x_out;            // [kHidden]
  float* part;            // [2 sets][2 halves][2 * kFfn] partial sums (set = projection parity)
  bf16* act;              // [kFfn] SwiGLU output
  unsigned* counter;      // grid barrier arrivals: base at launch
  int layers;
  // This launch runs projections [i_begin, i_end) of the 4 * layers (a whole layer's or a
  // layer's first one, qkv, or its last three), its barriers counting from base. A launch that
  // starts a layer reads the residual stream from x_in, one that ends a layer writes it to
  // x_out; o's input is qkv's partial sums, left in part by the launch before.
  int i_begin, i_end;
  unsigned base;
  // SYNC 2 (no barrier): each value travels with the tag of the projection that wrote it
  // (epoch * layers * 4 + i + 1) in one 64-bit word, and its readers poll until it is theirs.
  unsigned long long* tpart;  // [2 sets][2 halves][2 * kFfn]: float bits | tag << 32
  unsigned long long* tact;   // [kFfn / 2]: two bf16 | tag << 32
  unsigned epoch;
  // Not null: consumer thread 0 of each block records when each projection of layer
  // layers / 2 starts, ends its chunks, arrives at the barrier, leaves it and has its next
  // input: [block][projection][5 points][globaltimer ns, clock64].
  unsigned long long* trace;
  // FIX bit 1: a gate_up pair split between two blocks: each side's partial (gate[8], up[8]),
  // added in order by every block as it reads down's input.
  float* pair_part;  // [kFfn / 8 pairs][2 sides][16]
  // ATTN: the attention between qkv and o (attention_phase.cuh) in place of q as o's input;
  // its head counts live in `counter`'s second 128 bytes.
  attn::Args attn;
};

__device__ __forceinline__ uint32_t Smem(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ bool MbarTryWait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
  return ok;
}
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  long long n = 0;
  while (!MbarTryWait(bar, parity))
    if (++n > kSpinLimit) __trap();
}
__device__ __forceinline__ void NamedSync(int threads) {
  asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
}

// Every block's writes before it are visible to every block after it (gpu-scope release by
// one thread after a CTA barrier, acquire before the next: cumulative through bar.sync).
__device__ __forceinline__ void Stamp(unsigned long long* at) {  // at[0] ns, at[1] cycles
  if (!at) return;
  unsigned long long g;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
  at[0] = g;
  at[1] = clock64();
}

// tr (may be null): stamps at the arrival and at the release.
template <bool FENCE>
__device__ __forceinline__ void GridSync(unsigned* counter, unsigned target, int threads,
                                         unsigned long long* tr = nullptr) {
  NamedSync(threads);
  if (threadIdx.x == 32) {
    if (FENCE) __threadfence();
    Stamp(tr);
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
    unsigned v;
    long long n = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
      if (++n > kSpinLimit) __trap();
    } while (v < target);
    Stamp(tr ? tr + 2 : nullptr);
  }
  NamedSync(threads);
}

// FIX bit 0: each norm's scale loaded before the projection it follows (not after the
// barrier, one dependent load per element); bit 1: gate_up split at chunks (kFine).
template <int STAGES, int CHUNK, int CWARPS, bool RUN_AHEAD, bool EVICT_FIRST, bool BATCHED, int MODE,
          int PF, int SYNC, int FIX, bool ATTN>
__global__ void __launch_bounds__((CWARPS + 1) * 32, 1) LayerStream(Params P) {
  constexpr bool kFine = FIX & 2;
  static_assert(!ATTN || (BATCHED && SYNC != 2 && !kFine && MODE == 0 && PF == 0 &&
                          CWARPS * 32 == attn::kThreads &&
                          CHUNK == attn::kChunkBytes),
                "the attention phase runs in the batched, barrier-synchronised kernel, in xs");
  static_assert(!kFine || SYNC != 2, "split gate_up pairs are finished through the barrier");
  static_assert(SYNC != 2 || kQ == kHidden, "the tagged words carry o's input as kHidden values");
  constexpr int kChunkBytes = CHUNK, kChunkVecs = CHUNK / 16;  // 16-byte vectors per chunk
  constexpr int CT = CWARPS * 32;  // consumer threads: warps 1..CWARPS
  extern __shared__ __align__(128) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem);
  bf16* xs = reinterpret_cast<bf16*>(smem + STAGES * kChunkBytes);  // the projection's input
  bf16* resid = xs + kXs;                                             // the residual stream
  float* red = reinterpret_cast<float*>(resid + kHidden);             // [CWARPS][kMaxCols][8]
  float* scratch = red + CWARPS * kMaxCols * 8;                       // [CWARPS]
  unsigned* split_bits = reinterpret_cast<unsigned*>(scratch + 64);  // [56]: gate_up pairs split
  uint64_t* full = reinterpret_cast<uint64_t*>(scratch + 128);
  uint64_t* empty = full + STAGES;
  volatile int* go = reinterpret_cast<volatile int*>(empty + STAGES);  // projections released

  const int nb = gridDim.x, b = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int total = P.layers * 4, i0 = P.i_begin, i1 = P.i_end;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(Smem(&full[s])));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(Smem(&empty[s])), "r"(CWARPS * 32));
    }
    *go = i0 + 1;
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // kFine: which gate_up pairs a block boundary splits (every block knows every boundary).
  constexpr int kPairChunks = 2 * (kHidden / kChunkVecs);
  for (int w = threadIdx.x; w < kFfn / 8 / 32; w += blockDim.x) split_bits[w] = 0;
  __syncthreads();
  for (int bb = 1 + threadIdx.x; kFine && bb < nb; bb += blockDim.x) {
    int q0, q1;
    BlockRange(2, kChunkVecs, bb, nb, q0, q1, true);
    if (q0 % kPairChunks) atomicOr(&split_bits[q0 / kPairChunks / 32], 1u << (q0 / kPairChunks % 32));
  }
  __syncthreads();
  auto is_split = [&](int pair) { return (split_bits[pair / 32] >> (pair % 32)) & 1u; };

  if (warp == 0) {  // the producer
    if (lane != 0 || MODE == 2) return;
    uint64_t policy = 0;
    if (EVICT_FIRST) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    // Two cursors over this block's chunks, in order: the ring's loads and (PF > 0) the L2
    // prefetches, which run up to PF chunks ahead of the loads, also while the ring is full
    // (the consumers at a barrier), so that the memory keeps streaming through the pause.
    struct Cursor {
      int i, q, q1;
      const uint4* src;
      int kv;  // ATTN: the attention chunks (keys, values) queued after projection i's
    };
    auto normalize = [&](Cursor& c) {  // past an empty or finished range: the next projection
      while (c.i < i1 && c.q >= c.q1) {
        if (ATTN && c.i % 4 == 0 && c.kv < 2 && b < attn::kBlocks) {
          c.src = attn::ChunkSrc(P.attn, c.i / 4, c.kv++, b);  // one more chunk of the ring
          c.q1 = c.q + 1;
          break;
        }
        c.kv = 0;
        if (++c.i == i1) break;
        BlockRange(c.i % 4, kChunkVecs, b, nb, c.q, c.q1, kFine);
        c.src = P.w[c.i] + (size_t)c.q * kChunkVecs;
      }
    };
    auto advance = [&](Cursor& c) {
      ++c.q;
      c.src += kChunkVecs;
      normalize(c);
    };
    Cursor ld{i0, 0, 0, nullptr, 0};
    BlockRange(i0 % 4, kChunkVecs, b, nb, ld.q, ld.q1, kFine);
    ld.src = P.w[i0] + (size_t)ld.q * kChunkVecs;
    normalize(ld);
    Cursor pf = ld;
    unsigned n = 0, m = 0;  // chunks loaded, chunks prefetched (m >= n)
    auto prefetch_one = [&]() {
      if (PF && pf.i < i1 && m < n + PF) {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(pf.src), "r"(kChunkBytes)
                     : "memory");
        advance(pf);
        ++m;
        return true;
      }
      return false;
    };
    while (ld.i < i1) {
      if (!RUN_AHEAD) {
        long long spins = 0;
        while (*go <= ld.i)
          if (++spins > kSpinLimit) __trap();
      }
      const int s = n % STAGES;
      const uint32_t eb = Smem(&empty[s]), parity = ((n / STAGES) & 1) ^ 1;
      long long spins = 0;
      while (!MbarTryWait(eb, parity))
        if (!prefetch_one() && ++spins > kSpinLimit) __trap();
      const uint32_t fb = Smem(&full[s]), dst = Smem(ring + s * kChunkVecs);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(fb),
                   "r"(kChunkBytes) : "memory");
      if (EVICT_FIRST)
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
            " [%0], [%1], %2, [%3], %4;" ::"r"(dst), "l"(ld.src), "r"(kChunkBytes), "r"(fb),
            "l"(policy) : "memory");
      else
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
            " [%0], [%1], %2, [%3];" ::"r"(dst), "l"(ld.src), "r"(kChunkBytes), "r"(fb) : "memory");
      advance(ld);
      ++n;
      if (m < n) pf = ld, m = n;  // never behind the loads
      prefetch_one();
    }
    return;
  }

  // The consumers. t: 0..CT-1.
  const int t = threadIdx.x - 32, cw = warp - 1;
  // This thread is done reading ring stage s. Every consumer thread arrives (each arrival
  // releases its own reads): one arrival per warp after __syncwarp measured the same (113.98
  // against 114.01 us per layer), but compute-sanitizer's racecheck does not follow it.
  auto release_stage = [&](int s) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(Smem(&empty[s])) : "memory");
  };
  // FIX bit 0: the scale of the norm that follows this projection, in registers (8 per uint4).
  constexpr int kScaleVecs = (kHidden / 8 + CT - 1) / CT;
  uint4 scale_reg[kScaleVecs];
  auto load_scale = [&](const bf16* scale) {
#pragma unroll
    for (int u = 0; u < kScaleVecs; ++u)
      if (t + u * CT < kHidden / 8) scale_reg[u] = reinterpret_cast<const uint4*>(scale)[t + u * CT];
  };
  auto rms_inv = [&]() {  // 1 / rms(resid), over the whole block
    float ss = 0.f;
    for (int j = t; j < kHidden; j += CT) {
      const float r = __bfloat162float(resid[j]);
      ss += r * r;
    }
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) scratch[cw] = ss;
    NamedSync(CT);
    float tot = 0.f;
    for (int w = 0; w < CWARPS; ++w) tot += scratch[w];
    return rsqrtf(tot / kHidden + kEps);
  };
  auto rms_preloaded = [&]() {  // xs = RMSNorm(resid) * scale_reg
    const float inv = rms_inv();
#pragma unroll
    for (int u = 0; u < kScaleVecs; ++u) {
      const int v = t + u * CT;
      if (v >= kHidden / 8) continue;
      const bf16* sc = reinterpret_cast<const bf16*>(&scale_reg[u]);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        xs[v * 8 + e] = __float2bfloat16_rn(Bf(__bfloat162float(resid[v * 8 + e]) * inv) *
                                            __bfloat162float(sc[e]));
    }
  };
  auto rms_input = [&](const bf16* scale) {  // xs = RMSNorm(resid) * scale
    const float inv = rms_inv();
    for (int j = t; j < kHidden; j += CT)
      xs[j] = __float2bfloat16_rn(Bf(__bfloat162float(resid[j]) * inv) * __bfloat162float(scale[j]));
  };
  // The sum of a projection's two partial halves (set s), as the bf16 its dot would return.
  auto sum_parts = [&](int set, int j) {
    const float* h = P.part + (size_t)set * 4 * kFfn;
    return Bf(h[j] + h[2 * kFfn + j]);
  };

  // After o's or down's residual add: gate_up's input, or the next layer's qkv input.
  auto norm_next = [&](int p, int layer) {
    NamedSync(CT);
    if (FIX & 1) {
      if (p == 1 || layer + 1 < P.layers) rms_preloaded();
    } else if (p == 1)
      rms_input(P.norm + ((size_t)layer * 2 + 1) * kHidden);
    else if (layer + 1 < P.layers)
      rms_input(P.norm + ((size_t)layer + 1) * 2 * kHidden);
  };

  for (int j = t; j < kHidden; j += CT) resid[j] = P.x_in[j];
  NamedSync(CT);
  if (i0 % 4 == 0)
    rms_input(P.norm + (size_t)(i0 / 4) * 2 * kHidden);
  else  // o, after a launch that ran qkv
    for (int j = t; j < kQ; j += CT) xs[j] = __float2bfloat16_rn(sum_parts((i0 - 1) & 1, j));
  NamedSync(CT);

  if (ATTN && (i0 % 4 || i1 % 4)) __trap();  // whole layers only
  unsigned n = 0, syncs = 0;  // chunks consumed, grid barriers passed
  for (int i = i0; i < i1; ++i) {
    const int p = i % 4, layer = i / 4, K = ProjK(p), cpc = K / kChunkVecs;
    unsigned long long* tr = P.trace && layer == P.layers / 2 && t == 0
                                 ? P.trace + ((size_t)b * 4 + p) * 10 : nullptr;
    Stamp(tr);
    if ((FIX & 1) && p == 1) load_scale(P.norm + ((size_t)layer * 2 + 1) * kHidden);
    if ((FIX & 1) && p == 3 && layer + 1 < P.layers)
      load_scale(P.norm + ((size_t)layer + 1) * 2 * kHidden);
    int q0, q1;
    BlockRange(p, kChunkVecs, b, nb, q0, q1, kFine);
    const int c_first = q0 / cpc;
    float acc[8];
    // MODE 2 (timing only): the epilogues, barriers and inputs, no weights
    for (int q = q0; MODE != 2 && q < q1; ++q, ++n) {
      const int kc = q % cpc, s = n % STAGES;
      if (kc == 0 || q == q0)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = 0.f;
      MbarWait(Smem(&full[s]), (n / STAGES) & 1);
      const uint4* buf = ring + s * kChunkVecs;
      const bf16* xk = xs + kc * kChunkVecs;
#pragma unroll
      for (int e = t; e < kChunkVecs; e += CT) {
        const uint4 v = buf[e];
        const float xv = __bfloat162float(xk[e]);
        const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const float2 f = __bfloat1622float2(h2[u]);
          acc[2 * u] = fmaf(xv, f.x, acc[2 * u]);
          acc[2 * u + 1] = fmaf(xv, f.y, acc[2 * u + 1]);
        }
      }
      release_stage(s);
      if (kc == cpc - 1 || q == q1 - 1) {  // this block's part of column q / cpc is done
#pragma unroll
        for (int e = 0; e < 8; ++e)
          for (int o = 16; o; o >>= 1) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], o);
        const int j = q / cpc - c_first;
        if (j >= kMaxCols) __trap();
        if (lane == 0)
#pragma unroll
          for (int e = 0; e < 8; ++e) red[(cw * kMaxCols + j) * 8 + e] = acc[e];
      }
    }
    Stamp(tr ? tr + 2 : nullptr);
    if (MODE == 1) continue;  // timing only: the weights' stream, no barriers
    if (MODE == 3) {  // timing only: the weights' stream and the barriers, nothing between
      GridSync<SYNC == 0>(P.counter, P.base + (++syncs) * nb, CT);
      continue;
    }
    // The epilogue: this block's columns, summed over the warps, to the partial sums (or, for
    // gate_up, whose columns a block owns whole, SwiGLU straight to act).
    NamedSync(CT);
    const int ncols = q1 > q0 ? (q1 - 1) / cpc - c_first + 1 : 0;
    float* part = P.part + (size_t)(i & 1) * 4 * kFfn;
    const unsigned tag = P.epoch * total + i + 1;
    if (SYNC == 2) {
      unsigned long long* tp = P.tpart + (size_t)(i & 1) * 4 * kFfn;
      const unsigned long long tb = (unsigned long long)tag << 32;
      for (int x = t; x < ncols * (p == 2 ? 2 : 8); x += CT) {
        if (p == 2) {  // a (gate, up) column pair's 4 packed bf16 pairs of SwiGLU
          const int jp = x / 4, e2 = x % 4, j = 2 * jp;
          unsigned short h[2];
          for (int d = 0; d < 2; ++d) {
            const int e = 2 * e2 + d;
            float g = 0.f, u = 0.f;
            for (int w = 0; w < CWARPS; ++w) {
              g += red[(w * kMaxCols + j) * 8 + e];
              u += red[(w * kMaxCols + j + 1) * 8 + e];
            }
            g = Bf(g);
            h[d] = __bfloat16_as_ushort(__float2bfloat16_rn(g / (1.f + __expf(-g)) * Bf(u)));
          }
          const unsigned long long val = tb | h[0] | (unsigned)h[1] << 16;
          unsigned long long* dst = P.tact + ((c_first + j) / 2) * 4 + e2;
          asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(dst), "l"(val) : "memory");
        } else {
          const int j = x / 8, e = x % 8, c = c_first + j;
          float v = 0.f;
          for (int w = 0; w < CWARPS; ++w) v += red[(w * kMaxCols + j) * 8 + e];
          const bool first = c * cpc >= q0, last = (c + 1) * cpc <= q1;
          unsigned long long* dst = tp + (first ? 0 : 2 * kFfn) + c * 8 + e;
          asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(dst),
                       "l"(tb | __float_as_uint(v)) : "memory");
          if (first && last)
            asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(dst + 2 * kFfn), "l"(tb)
                         : "memory");
        }
      }
      NamedSync(CT);  // every consumer done with xs and resid before they are rewritten
    }
    if (kFine && p == 2) {  // SwiGLU of whole pairs; a split pair's side to pair_part, which
                            // down's input adds up after the barrier
      const int pf = c_first / 2, npairs = ncols ? (c_first + ncols - 1) / 2 - pf + 1 : 0;
      auto col_sum = [&](int j, int e) {
        float v = 0.f;
        if (j >= 0 && j < ncols)
          for (int w = 0; w < CWARPS; ++w) v += red[(w * kMaxCols + j) * 8 + e];
        return v;
      };
      for (int x = t; x < npairs * 8; x += CT) {
        const int pair = pf + x / 8, e = x % 8, jg = 2 * pair - c_first;
        const float g = col_sum(jg, e), u = col_sum(jg + 1, e);
        if (pair * 2 * cpc >= q0 && (pair + 1) * 2 * cpc <= q1) {
          const float gb = Bf(g);
          P.act[pair * 8 + e] = __float2bfloat16_rn(gb / (1.f + __expf(-gb)) * Bf(u));
        } else {
          float* side = P.pair_part + ((size_t)pair * 2 + (pair * 2 * cpc >= q0 ? 0 : 1)) * 16;
          side[e] = g;
          side[8 + e] = u;
        }
      }
    }
    for (int x = t; SYNC != 2 && !(kFine && p == 2) && x < ncols * 8; x += CT) {
      const int j = x / 8, e = x % 8, c = c_first + j;
      float v = 0.f;
      for (int w = 0; w < CWARPS; ++w) v += red[(w * kMaxCols + j) * 8 + e];
      if (p == 2) {
        if (c % 2 == 0) continue;  // the up column's thread writes the pair
        float g = 0.f;
        for (int w = 0; w < CWARPS; ++w) g += red[(w * kMaxCols + j - 1) * 8 + e];
        g = Bf(g);
        const float a = g / (1.f + __expf(-g)) * Bf(v);
        P.act[(c / 2) * 8 + e] = __float2bfloat16_rn(a);
      } else {
        const bool first = c * cpc >= q0, last = (c + 1) * cpc <= q1;
        part[(first ? 0 : 2 * kFfn) + c * 8 + e] = v;
        if (first && last) part[2 * kFfn + c * 8 + e] = 0.f;
      }
    }
    if (SYNC != 2 && MODE != 4)
      GridSync<SYNC == 0>(P.counter, P.base + (++syncs) * nb, CT, tr ? tr + 4 : nullptr);
    if (MODE == 4) NamedSync(CT);  // timing only: no barrier, the inputs read unsynchronised
    if (!RUN_AHEAD && t == 0) *go = i + 2;
    // The next projection's input. BATCHED: every load a thread needs in flight at once, 16
    // bytes each (the loop form waits an L2 round trip per element: ~7 us for down's input).
    auto poll = [&](const unsigned long long* a) {  // the word once it carries this tag
      unsigned long long v;
      long long spins = 0;
      do {
        asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(a) : "memory");
        if (++spins > kSpinLimit) __trap();
      } while ((unsigned)(v >> 32) != tag);
      return v;
    };
    if (ATTN && p == 0) {  // the attention, a barrier, and its output as o's input
      // its keys and values: ring stages n and n + 1 (blocks with a chunk)
      const uint32_t s0 = n % STAGES, s1 = (n + 1) % STAGES;
      unsigned long long* at = tr ? P.trace + (size_t)nb * 40 + (size_t)b * 12 : nullptr;
      if (b < attn::kBlocks) {
        MbarWait(Smem(&full[s0]), (n / STAGES) & 1);
        MbarWait(Smem(&full[s1]), ((n + 1) / STAGES) & 1);
      }
      attn::Phase(P.attn, layer, b, t, ring + s0 * kChunkVecs, ring + s1 * kChunkVecs,
                  P.part + (size_t)(i & 1) * 4 * kFfn, 2 * kFfn, reinterpret_cast<float*>(xs),
                  [&] { NamedSync(CT); },
                  [&] {
                    release_stage(s0);
                    release_stage(s1);
                  },
                  [&](int k) { Stamp(at ? at + 2 * k : nullptr); });
      if (b < attn::kBlocks) n += 2;
      GridSync<SYNC == 0>(P.counter, P.base + (++syncs) * nb, CT);
      Stamp(at ? at + 8 : nullptr);
      for (int v = t; v < kQ / 8; v += CT)
        reinterpret_cast<uint4*>(xs)[v] = __ldcg(reinterpret_cast<const uint4*>(P.attn.out) + v);
    } else if (SYNC == 2) {
      const unsigned long long* tp = P.tpart + (size_t)(i & 1) * 4 * kFfn;
      if (p == 2) {  // down: SwiGLU, two bf16 per word
        constexpr int NV = kFfn / 2, U = (NV + CT - 1) / CT;
        unsigned long long v[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (t + u * CT < NV)
            asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v[u]) : "l"(P.tact + t + u * CT) : "memory");
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (t + u * CT < NV) {
            if ((unsigned)(v[u] >> 32) != tag) v[u] = poll(P.tact + t + u * CT);
            reinterpret_cast<unsigned*>(xs)[t + u * CT] = (unsigned)v[u];
          }
      } else {
        constexpr int U = (kHidden + CT - 1) / CT;
        unsigned long long a[U], c[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (t + u * CT < kHidden) {
            asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(a[u]) : "l"(tp + t + u * CT) : "memory");
            asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(c[u]) : "l"(tp + 2 * kFfn + t + u * CT) : "memory");
          }
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (t + u * CT < kHidden) {
            const int j = t + u * CT;
            if ((unsigned)(a[u] >> 32) != tag) a[u] = poll(tp + j);
            if ((unsigned)(c[u] >> 32) != tag) c[u] = poll(tp + 2 * kFfn + j);
            const float o = Bf(__uint_as_float((unsigned)a[u]) + __uint_as_float((unsigned)c[u]));
            if (p == 0)
              xs[j] = __float2bfloat16_rn(o);
            else
              resid[j] = __float2bfloat16_rn(__bfloat162float(resid[j]) + o);
          }
        if (p != 0) norm_next(p, layer);
      }
    } else if (BATCHED) {
      const float* h = P.part + (size_t)(i & 1) * 4 * kFfn;
      if (p == 2) {  // down: SwiGLU, already bf16 (one uint4: one gate_up pair's 8 values)
        constexpr int NV = kFfn / 8, U = (NV + CT - 1) / CT;
        uint4 v[U];
        // kFine: a pair split between two blocks is finished here, from its two sides (the
        // thread's first in the same round of loads; any further one after: a thread's pairs are
        // 256 apart, block boundaries ~14, so rarely).
        float4 sd[8];
        int sm = -1;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int m = t + u * CT;
          if (m >= NV) continue;
          if (kFine && is_split(m)) {
            if (sm < 0) {
              sm = m;
#pragma unroll
              for (int k = 0; k < 8; ++k)
                sd[k] = __ldcg(reinterpret_cast<const float4*>(P.pair_part + (size_t)m * 32) + k);
            }
          } else {
            v[u] = reinterpret_cast<const uint4*>(P.act)[m];
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int m = t + u * CT;
          if (m < NV && !(kFine && is_split(m))) reinterpret_cast<uint4*>(xs)[m] = v[u];
        }
        auto finish = [&](int m, const float4* q) {  // q: side 0 gate, up; side 1 gate, up
          const float* f = reinterpret_cast<const float*>(q);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float g = Bf(f[e] + f[16 + e]), u = Bf(f[8 + e] + f[24 + e]);
            xs[m * 8 + e] = __float2bfloat16_rn(g / (1.f + __expf(-g)) * u);
          }
        };
        if (kFine) {
          if (sm >= 0) finish(sm, sd);
          for (int u = 0; u < U; ++u) {  // a further split pair: one round each
            const int m = t + u * CT;
            if (m < NV && is_split(m) && m != sm) {
              float4 q[8];
              for (int k = 0; k < 8; ++k)
                q[k] = __ldcg(reinterpret_cast<const float4*>(P.pair_part + (size_t)m * 32) + k);
              finish(m, q);
            }
          }
        }
      } else {  // the sum of the two partial halves, rounded as the dot's bf16 output
        constexpr int NV = kHidden / 4, U = (NV + CT - 1) / CT;
        const int nv = p == 0 ? kQ / 4 : NV;  // o's input (q) or the residual stream
        float4 a[U], c[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (t + u * CT < nv) {
            a[u] = reinterpret_cast<const float4*>(h)[t + u * CT];
            c[u] = reinterpret_cast<const float4*>(h + 2 * kFfn)[t + u * CT];
          }
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (t + u * CT < nv) {
            const int j = 4 * (t + u * CT);
            const float o[4] = {Bf(a[u].x + c[u].x), Bf(a[u].y + c[u].y), Bf(a[u].z + c[u].z),
                                Bf(a[u].w + c[u].w)};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              if (p == 0)  // o: q (the attention output's stand-in)
                xs[j + e] = __float2bfloat16_rn(o[e]);
              else  // gate_up, the next layer: the residual add
                resid[j + e] = __float2bfloat16_rn(__bfloat162float(resid[j + e]) + o[e]);
            }
          }
        if (p != 0) norm_next(p, layer);
      }
    } else if (p == 0) {  // o: q (the attention output's stand-in)
      for (int j = t; j < kQ; j += CT) xs[j] = __float2bfloat16_rn(sum_parts(i & 1, j));
    } else if (p == 2) {  // down: SwiGLU
      for (int j = t; j < kFfn; j += CT) xs[j] = P.act[j];
    } else {  // gate_up, the next layer: RMSNorm(resid + o or down)
      for (int j = t; j < kHidden; j += CT)
        resid[j] = __float2bfloat16_rn(__bfloat162float(resid[j]) + sum_parts(i & 1, j));
      norm_next(p, layer);
    }
    NamedSync(CT);
    Stamp(tr ? tr + 8 : nullptr);
  }
  if (b == 0 && i1 % 4 == 0)
    for (int j = t; j < kHidden; j += CT) P.x_out[j] = resid[j];
}

// Row-major W [K, N] -> tiled: column vector c (8 columns) holds K rows of 16 bytes; for
// gate_up (interleave) tiled vector c is gate vector c / 2 or up vector c / 2.
__global__ void Tile(const bf16* w, uint4* out, int K, int N, bool interleave) {
  const size_t vecs = (size_t)K * (N / 8);
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < vecs;
       i += (size_t)gridDim.x * blockDim.x) {
    const int c = (int)(i / K), k = (int)(i % K);
    const int src = interleave ? (c % 2) * (N / 16) + c / 2 : c;
    out[i] = *reinterpret_cast<const uint4*>(w + (size_t)k * N + src * 8);
  }
}

__global__ void RefDot(const bf16* x, const bf16* w, double* y, int K, int N) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  double s = 0;
  for (int k = 0; k < K; ++k) s += (double)__bfloat162float(x[k]) * __bfloat162float(w[(size_t)k * N + n]);
  y[n] = s;
}

// The same layers on the host, float64 dots on the GPU (row-major weights). attend (ATTN): o's
// input from the layer's unrounded qkv; without it, q.
using Attend = std::function<std::vector<float>(int layer, const std::vector<double>& qkv)>;
static std::vector<float> Reference(const std::vector<std::vector<bf16*>>& w_rm, const bf16* norm_dev,
                                    const std::vector<float>& x0, int layers,
                                    const Attend& attend = nullptr) {
  std::vector<bf16> norm_h((size_t)layers * 2 * kHidden);
  CK(cudaMemcpy(norm_h.data(), norm_dev, norm_h.size() * 2, cudaMemcpyDeviceToHost));
  bf16* xd;
  double* yd;
  CK(cudaMalloc(&xd, kFfn * 2));
  CK(cudaMalloc(&yd, 2 * kFfn * 8));
  auto dot = [&](const std::vector<float>& in, int l, int p) {
    std::vector<bf16> xb(in.size());
    for (size_t j = 0; j < in.size(); ++j) xb[j] = __float2bfloat16_rn(in[j]);
    CK(cudaMemcpy(xd, xb.data(), xb.size() * 2, cudaMemcpyHostToDevice));
    RefDot<<<(ProjN(p) + 127) / 128, 128>>>(xd, w_rm[l][p], yd, ProjK(p), ProjN(p));
    std::vector<double> y(ProjN(p));
    CK(cudaMemcpy(y.data(), yd, y.size() * 8, cudaMemcpyDeviceToHost));
    return y;
  };
  auto rms = [&](const std::vector<float>& r, const bf16* scale) {
    double ss = 0;
    for (float v : r) ss += (double)v * v;
    const double inv = 1.0 / std::sqrt(ss / kHidden + kEps);
    std::vector<float> o(kHidden);
    for (int j = 0; j < kHidden; ++j) o[j] = Bf(Bf(r[j] * inv) * __bfloat162float(scale[j]));
    return o;
  };
  std::vector<float> resid = x0;
  for (int l = 0; l < layers; ++l) {
    auto qkv = dot(rms(resid, &norm_h[(size_t)l * 2 * kHidden]), l, 0);
    std::vector<float> q(kQ);
    for (int j = 0; j < kQ; ++j) q[j] = Bf(qkv[j]);
    auto o = dot(attend ? attend(l, qkv) : q, l, 1);
    for (int j = 0; j < kHidden; ++j) resid[j] = Bf(resid[j] + Bf(o[j]));
    auto gu = dot(rms(resid, &norm_h[((size_t)l * 2 + 1) * kHidden]), l, 2);
    std::vector<float> a(kFfn);
    for (int j = 0; j < kFfn; ++j) {
      const double g = Bf(gu[j]);
      a[j] = Bf(g / (1.0 + std::exp(-g)) * Bf(gu[kFfn + j]));
    }
    auto d = dot(a, l, 3);
    for (int j = 0; j < kHidden; ++j) resid[j] = Bf(resid[j] + Bf(d[j]));
  }
  CK(cudaFree(xd));
  CK(cudaFree(yd));
  return resid;
}

// The largest distance of a device vector [kHidden] from the reference (a non-finite value:
// 1e30, so a poisoned output that was never written fails).
static double MaxErr(const bf16* dev, const std::vector<float>& ref) {
  std::vector<bf16> out(kHidden);
  CK(cudaMemcpy(out.data(), dev, kHidden * 2, cudaMemcpyDeviceToHost));
  double err = 0;
  for (int j = 0; j < kHidden; ++j) {
    const float v = __bfloat162float(out[j]);
    err = std::max(err, std::isfinite(v) ? std::fabs((double)v - ref[j]) : 1e30);
  }
  return err;
}

struct Config {
  std::string name;
  void (*kernel)(Params);
  size_t smem;
  int threads;
  bool checked;  // timing-only modes compute nothing meaningful
  bool attn;     // ATTN: the attention between qkv and o (one more barrier per layer)
};

// MODE 0: the layers; 1: the weights' stream alone (no barriers, no inputs); 2: the barriers,
// epilogues and input loads alone (no weights); 3: the stream and bare grid barriers (no
// epilogues, no inputs); 4: the stream, epilogues and inputs without the barriers. 1-4 time a
// part of the kernel and compute nothing meaningful.
template <int STAGES, int CHUNK, int CWARPS, bool RUN_AHEAD, bool EVICT_FIRST, int PF = 0,
          int MODE = 0, int SYNC = 0, bool BATCHED = true, int FIX = 0, bool ATTN = false>
Config MakeConfig() {
  const size_t smem = (size_t)STAGES * CHUNK + (kXs + kHidden) * 2 +
                      (CWARPS * kMaxCols * 8 + 128) * 4 + 2 * STAGES * 8 + 16;
  auto k = LayerStream<STAGES, CHUNK, CWARPS, RUN_AHEAD, EVICT_FIRST, BATCHED, MODE, PF, SYNC, FIX, ATTN>;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  char buf[128];
  snprintf(buf, sizeof buf, "%dx%dK warps%d pf%d %s%s%s%s%s%s%s", STAGES, CHUNK / 1024, CWARPS, PF,
           RUN_AHEAD ? "run-ahead" : "wait-at-barrier", EVICT_FIRST ? " evict_first" : "",
           BATCHED ? "" : " loop-loads",
           SYNC == 1 ? " no-fence" : SYNC == 2 ? " tagged" : "",
           FIX & 1 ? " norm-preload" : "", FIX & 2 ? " gate_up-fine" : "",
           MODE == 1 ? " [stream only]" : MODE == 2 ? " [barriers only]"
           : MODE == 3 ? " [stream + bare barriers]" : MODE == 4 ? " [stream + work, no barrier]"
           : ATTN ? " +attention" : "");
  return {buf, k, smem, (CWARPS + 1) * 32, MODE == 0, ATTN};
}

// --attention: only the best configuration without and with the attention phase (their checks,
// times, plans and stamps); without it, every variant as well. --sanitize: the attention
// configuration's 2-layer check alone, for compute-sanitizer (memcheck, racecheck, synccheck).
// --pos P: the new token's cache slot (default the last, 1023: every key seen; a smaller one
// masks the keys after it, whole chunks of them included).
int main(int argc, char** argv) {
  [[maybe_unused]] bool only_attention = false;  // TP=2 builds only the --attention set
  bool sanitize = false;
  int pos = attn::kCap - 1;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    if (arg == "--attention") only_attention = true;
    else if (arg == "--sanitize") sanitize = true;
    else if (arg == "--pos" && a + 1 < argc) pos = std::atoi(argv[++a]);
    else {
      printf("usage: %s [--attention | --sanitize] [--pos P (0 <= P < %d)]\n", argv[0], attn::kCap);
      return 2;
    }
  }
  if (pos < 0 || pos >= attn::kCap) {
    printf("--pos must be in [0, %d)\n", attn::kCap);
    return 2;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int nb = prop.multiProcessorCount, L = sanitize ? 2 : 32, kCheck = 2;
  printf("%s, %d SMs, %d layers, TP=%d's per-rank shapes (qkv %d, o %d, gate_up %d, down %d; "
         "%d KV heads)\n", prop.name, nb, L, LS_TP, kQkv, kQ, 2 * kFfn, kFfn, attn::kKv);
  const Config best = MakeConfig<10, 16384, 8, true, true, 0, 0, 1, true, 1>();
  const Config best_attn = MakeConfig<10, 16384, 8, true, true, 0, 0, 1, true, 1, true>();
  // 11 stages fit beside the attention's scratch; its pause is the longest the ring bridges
  const Config best11 = MakeConfig<11, 16384, 8, true, true, 0, 0, 1, true, 1>();
  const Config best11_attn = MakeConfig<11, 16384, 8, true, true, 0, 0, 1, true, 1, true>();
  std::vector<Config> cfgs = {best, best_attn, best11, best11_attn};  // TP=2: these only
#if LS_TP == 1
  if (!only_attention) cfgs = {
      MakeConfig<10, 16384, 8, true, true, 0, 0, 0, false>(),  // inputs read in a loop
      MakeConfig<10, 16384, 8, true, true>(),                   // the kernel as first measured
      MakeConfig<10, 16384, 8, false, true>(),                  // no run-ahead
      MakeConfig<10, 16384, 8, true, true, 0, 0, 1>(),          // no fence before the arrival
      MakeConfig<10, 16384, 8, true, true, 0, 0, 1, true, 1>(), // + norm scales preloaded
      MakeConfig<10, 16384, 8, true, true, 0, 0, 1, true, 2>(), // + gate_up split at chunks
      MakeConfig<10, 16384, 8, true, true, 0, 0, 1, true, 3>(), // + both
      MakeConfig<10, 16384, 8, true, true, 16, 0, 1>(),         // L2 prefetch 16 chunks ahead
      MakeConfig<10, 16384, 8, true, true, 0, 0, 2>(),          // tagged words, no barrier
      MakeConfig<10, 16384, 8, true, true, 0, 1, 1>(),
      MakeConfig<10, 16384, 8, true, true, 0, 2, 1>(),
      MakeConfig<10, 16384, 8, true, true, 0, 3, 1>(),
      MakeConfig<10, 16384, 8, true, true, 0, 4, 1>(),
      best_attn,
      best11_attn,
  };
#endif
  if (sanitize) cfgs = {best_attn};
  if (nb < attn::kBlocks) {  // a head's chunks would be counted across layers
    printf("the attention phase needs %d blocks, this GPU runs %d\n", attn::kBlocks, nb);
    return 1;
  }
  // Weights: row-major for the reference (the first kCheck layers), tiled for the kernel.
  std::vector<std::vector<bf16*>> w_rm(kCheck, std::vector<bf16*>(4));
  std::vector<uint4*> w_tiled(L * 4);
  size_t bytes = 0;
  bf16* tmp;
  CK(cudaMalloc(&tmp, (size_t)kHidden * 2 * kFfn * 2));
  for (int l = 0; l < L; ++l)
    for (int p = 0; p < 4; ++p) {
      const size_t elems = (size_t)ProjK(p) * ProjN(p);
      bf16* rm = tmp;
      if (l < kCheck) {
        CK(cudaMalloc(&rm, elems * 2));
        w_rm[l][p] = rm;
      }
      Fill<<<1024, 256>>>(rm, elems, 100 + l * 4 + p, 0.03f, 0.f);
      CK(cudaMalloc(&w_tiled[l * 4 + p], elems * 2));
      Tile<<<1024, 256>>>(rm, w_tiled[l * 4 + p], ProjK(p), ProjN(p), p == 2);
      bytes += elems * 2;
    }
  CK(cudaDeviceSynchronize());
  CK(cudaFree(tmp));
  uint4** w_dev;
  CK(cudaMalloc(&w_dev, L * 4 * sizeof(uint4*)));
  CK(cudaMemcpy(w_dev, w_tiled.data(), L * 4 * sizeof(uint4*), cudaMemcpyHostToDevice));
  bf16 *norm, *x_in, *x_out, *act;
  float* part;
  unsigned* counter;
  CK(cudaMalloc(&norm, (size_t)L * 2 * kHidden * 2));
  CK(cudaMalloc(&x_in, kHidden * 2));
  CK(cudaMalloc(&x_out, kHidden * 2));
  CK(cudaMalloc(&act, kFfn * 2));
  CK(cudaMalloc(&part, 2 * 4 * kFfn * 4));
  constexpr size_t kCounterBytes = 64 * 4;  // the grid barrier's count; ATTN's head counts
  CK(cudaMalloc(&counter, kCounterBytes));
  unsigned long long *tpart, *tact;
  CK(cudaMalloc(&tpart, 2 * 4 * kFfn * 8));
  CK(cudaMalloc(&tact, kFfn / 2 * 8));
  CK(cudaMemset(tpart, 0, 2 * 4 * kFfn * 8));  // tag 0: no projection's
  CK(cudaMemset(tact, 0, kFfn / 2 * 8));
  unsigned epoch = 0;  // one per launch: a launch never takes an earlier launch's words
  float* pair_part;
  CK(cudaMalloc(&pair_part, kFfn / 8 * 32 * 4));
  Fill<<<64, 256>>>(norm, (size_t)L * 2 * kHidden, 7, 0.2f, 1.f);
  Fill<<<64, 256>>>(x_in, kHidden, 9, 1.f, 0.f);
  CK(cudaDeviceSynchronize());
  std::vector<bf16> xh(kHidden);
  CK(cudaMemcpy(xh.data(), x_in, kHidden * 2, cudaMemcpyDeviceToHost));
  std::vector<float> x0(kHidden);
  for (int j = 0; j < kHidden; ++j) x0[j] = __bfloat162float(xh[j]);
  const std::vector<float> ref = Reference(w_rm, norm, x0, kCheck);
  auto max_abs = [](const std::vector<float>& v) {
    double m = 0;
    for (float x : v) m = std::max(m, (double)std::fabs(x));
    return m;
  };
  const double scale = max_abs(ref);

  // ATTN: the cache (random old slots), the step's rotary cos and sin (theta 500000), the new
  // token in slot pos (--pos; the last by default: KV 1024); the reference with the attention,
  // and each checked layer's new key and value as the kernel must write them.
  using attn::kCap;
  using attn::kD;
  using attn::kKv;
  const size_t layer_cache = (size_t)2 * kKv * kCap * kD;
  attn::Args aa{};
  aa.pos = pos;
  CK(cudaMalloc(&aa.cache, L * layer_cache * 2));
  Fill<<<1024, 256>>>(aa.cache, L * layer_cache, 11, 1.f, 0.f);
  std::vector<float> rot(kD);  // cos, sin of pos * inv_freq (float32 angles, as XLA's)
  for (int d = 0; d < kD / 2; ++d) {
    const float ang = (float)aa.pos * (float)(1.0 / std::pow(500000.0, 2.0 * d / kD));
    rot[d] = (float)std::cos((double)ang);
    rot[kD / 2 + d] = (float)std::sin((double)ang);
  }
  float* rot_dev;
  CK(cudaMalloc(&rot_dev, kD * 4));
  CK(cudaMemcpy(rot_dev, rot.data(), kD * 4, cudaMemcpyHostToDevice));
  aa.rot = rot_dev;
  CK(cudaMalloc(&aa.part, (size_t)attn::kBlocks * attn::kPartStride * 4));
  CK(cudaMalloc(&aa.out, kHidden * 2));
  aa.head_count = counter + 32;
  CK(cudaDeviceSynchronize());
  std::vector<std::vector<bf16>> cache_h(kCheck, std::vector<bf16>(layer_cache));
  std::vector<std::vector<float>> new_kv(kCheck), attn_ref(kCheck);
  for (int l = 0; l < kCheck; ++l)
    CK(cudaMemcpy(cache_h[l].data(), aa.cache + l * layer_cache, layer_cache * 2, cudaMemcpyDeviceToHost));
  const std::vector<float> ref_attn =
      Reference(w_rm, norm, x0, kCheck, [&](int l, const std::vector<double>& qkv) {
        return attn_ref[l] = attn::Reference(qkv, cache_h[l], rot, aa.pos, new_kv[l]);
      });
  const double scale_attn = max_abs(ref_attn);
  auto poison_new_slots = [&](cudaStream_t st) {
    for (int l = 0; l < kCheck; ++l)
      for (int kv = 0; kv < 2; ++kv)
        for (int h = 0; h < kKv; ++h)
          CK(cudaMemsetAsync(attn::Slot(aa, l, kv, h, aa.pos), 0xff, kD * 2, st));
    CK(cudaMemsetAsync(aa.part, 0xff, (size_t)attn::kBlocks * attn::kPartStride * 4, st));
    CK(cudaMemsetAsync(aa.out, 0xff, kHidden * 2, st));
  };
  // The checked layers' slot pos against the reference, in bf16 ulps of the largest value of its
  // vector: the kernel's q/k/v come from float32 sums, the reference's from float64 dots, so an
  // input of the rotation may round one ulp apart, and a rotated value near 0 then differs by
  // an ulp of its inputs (2 at most). The attention's own output is too small a part of the
  // residual stream for the output's check to see a wrong chunk or a missed key, so the last
  // checked layer's (attn.out after the run) is compared directly, in ulps of its largest.
  auto ulps_of_top = [](const float* want, const bf16* got, int n) {
    float top = 1e-3f;
    for (int d = 0; d < n; ++d) top = std::max(top, std::fabs(want[d]));
    const double ulp = std::ldexp(1.0, std::ilogb(top) - 7);
    double e = 0;
    for (int d = 0; d < n; ++d) {
      const float v = __bfloat162float(got[d]);
      e = std::max(e, std::isfinite(v) ? std::fabs(v - want[d]) / ulp : 1e30);
    }
    return e;
  };
  auto new_slot_err = [&]() {
    double e = 0;
    std::vector<bf16> got(kD);
    for (int l = 0; l < kCheck; ++l)
      for (int kv = 0; kv < 2; ++kv)
        for (int h = 0; h < kKv; ++h) {
          CK(cudaMemcpy(got.data(), attn::Slot(aa, l, kv, h, aa.pos), kD * 2, cudaMemcpyDeviceToHost));
          e = std::max(e, ulps_of_top(&new_kv[l][((size_t)h * 2 + kv) * kD], got.data(), kD));
        }
    return e;
  };
  auto attention_err = [&]() {  // (new slots, last layer's output), each in ulps of its largest
    std::vector<bf16> out(kQ);
    CK(cudaMemcpy(out.data(), aa.out, kQ * 2, cudaMemcpyDeviceToHost));
    return std::make_pair(new_slot_err(), ulps_of_top(attn_ref[kCheck - 1].data(), out.data(), kQ));
  };

  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (const Config& c : cfgs) {
    const int threads = c.threads;
    auto run = [&](int layers) {
      Params P{w_dev, norm, x_in, x_out, part, act, counter, layers, 0, 4 * layers, 0u,
               tpart, tact, epoch++, nullptr,
               pair_part};
      P.attn = aa;
      void* args[] = {&P};
      CK(cudaMemsetAsync(counter, 0, kCounterBytes, s));
      CK(cudaLaunchCooperativeKernel((void*)c.kernel, dim3(nb), dim3(threads), args, c.smem, s));
    };
    // correctness: 2 layers against float64, output and intermediates poisoned
    CK(cudaMemsetAsync(x_out, 0xff, kHidden * 2, s));
    CK(cudaMemsetAsync(part, 0xff, 2 * 4 * kFfn * 4, s));
    CK(cudaMemsetAsync(act, 0xff, kFfn * 2, s));
    CK(cudaMemsetAsync(tpart, 0xff, 2 * 4 * kFfn * 8, s));
    CK(cudaMemsetAsync(tact, 0xff, kFfn / 2 * 8, s));
    if (c.attn) poison_new_slots(s);
    run(kCheck);
    CK(cudaStreamSynchronize(s));
    CK(cudaGetLastError());
    const std::vector<float>& r = c.attn ? ref_attn : ref;
    const double err = MaxErr(x_out, r), sc = c.attn ? scale_attn : scale;
    const std::pair<double, double> ae = c.attn ? attention_err() : std::make_pair(0.0, 0.0);
    // timed: each launch with the barrier counter's reset (~2 us of ~3.5 ms)
    const std::vector<float> ms = TimeRuns([&] { run(L); }, s, sanitize ? 1 : 15, sanitize ? 0 : 3);
    const float med = ms[ms.size() / 2];
    printf("%-40s %d layers %.3f ms (min %.3f max %.3f), %.2f us per layer, %.2f TB/s; "
           "2-layer err %.2e of %.2e%s",
           c.name.c_str(), L, med, ms.front(), ms.back(), med * 1e3 / L, bytes / (med * 1e-3) / 1e12,
           err, sc, !c.checked ? "  (timing only)" : err > 2e-2 * sc ? "  WRONG" : "");
    if (c.attn)
      printf("; new cache slots %.2f, layer %d's attention %.2f bf16 ulps of their largest%s", ae.first,
             kCheck - 1, ae.second, ae.first > 2 || ae.second > 2 ? "  WRONG" : "");
    printf("\n");
    fflush(stdout);
  }
  if (sanitize) return 0;
  // Plans: the same layers as one launch, one launch per layer, or two per layer (qkv; then o,
  // gate_up and down: where XLA's attention would run between them), captured in one CUDA
  // graph, as XLA's command buffers would run them; the best configuration, and with the
  // attention as one launch and one launch per layer.
  bf16* state;
  CK(cudaMalloc(&state, kHidden * 2));
  auto build = [&](const Config& c, int layers, int plan) {
    std::vector<std::pair<int, int>> runs;
    for (int l = 0; l < layers; ++l) {
      if (plan == 0 && l == 0) runs.push_back({0, 4 * layers});
      if (plan == 1) runs.push_back({4 * l, 4 * l + 4});
      if (plan == 2) runs.push_back({4 * l, 4 * l + 1}), runs.push_back({4 * l + 1, 4 * l + 4});
    }
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CK(cudaMemcpyAsync(state, x_in, kHidden * 2, cudaMemcpyDeviceToDevice, s));
    CK(cudaMemsetAsync(counter, 0, kCounterBytes, s));
    unsigned base = 0;
    for (auto [a, z] : runs) {
      Params P{w_dev, norm, state, state, part, act, counter, layers, a, z, base, tpart, tact, 0u,
               nullptr, pair_part};
      P.attn = aa;
      void* args[] = {&P};
      CK(cudaLaunchCooperativeKernel((void*)c.kernel, dim3(nb), dim3(c.threads), args, c.smem, s));
      base += ((z - a) + (c.attn ? (z - a) / 4 : 0)) * nb;  // ATTN: one more barrier per layer
    }
    CK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t ge;
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphDestroy(g));
    return ge;
  };
  const char* plan_names[] = {"one launch", "one launch per layer", "two launches per layer"};
  const std::pair<const Config*, int> plans[] = {{&best, 0}, {&best, 1}, {&best, 2},
                                                 {&best_attn, 0}, {&best_attn, 1}};
  for (auto [cp, plan] : plans) {
    const Config& c = *cp;
    cudaGraphExec_t check = build(c, kCheck, plan), timed = build(c, L, plan);
    CK(cudaMemsetAsync(part, 0xff, 2 * 4 * kFfn * 4, s));
    CK(cudaMemsetAsync(act, 0xff, kFfn * 2, s));
    if (c.attn) poison_new_slots(s);
    CK(cudaGraphLaunch(check, s));
    CK(cudaStreamSynchronize(s));
    const double err = MaxErr(state, c.attn ? ref_attn : ref), sc = c.attn ? scale_attn : scale;
    const std::pair<double, double> ae = c.attn ? attention_err() : std::make_pair(0.0, 0.0);
    const std::vector<float> ms = TimeRuns([&] { CK(cudaGraphLaunch(timed, s)); }, s, 15);
    const float med = ms[ms.size() / 2];
    printf("PLAN %-22s %s: %d layers %.3f ms (min %.3f max %.3f), %.2f us per layer; "
           "2-layer err %.2e of %.2e%s\n",
           plan_names[plan], c.name.c_str(), L, med, ms.front(), ms.back(), med * 1e3 / L, err,
           sc, err > 2e-2 * sc || ae.first > 2 || ae.second > 2 ? "  WRONG" : "");
    fflush(stdout);
    CK(cudaGraphExecDestroy(check));
    CK(cudaGraphExecDestroy(timed));
  }
  // Where a projection's time goes at the middle layer, block by block (consumer thread 0's
  // stamps): its chunks, the epilogue up to the arrival, the wait for the last block, the next
  // input; across blocks, how far apart they arrive and how late each leaves after the last.
  unsigned long long* trace;
  // + ATTN: [block][6 points][ns, cycles] of the middle layer's attention phase
  const size_t trace_words = (size_t)nb * 4 * 10 + (size_t)nb * 12;
  CK(cudaMalloc(&trace, trace_words * 8));
  int khz;
  CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
  const double cyc_us = khz / 1e3;  // the stamps' cycles at the rated clock
  auto stat = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    char buf[64];
    snprintf(buf, sizeof buf, "%6.2f/%6.2f", v[v.size() / 2], v.back());
    return std::string(buf);
  };
  // With the attention, qkv's "input" is the attention phase, its barrier and o's input.
  std::vector<Config> traced = {best, best_attn};  // TP=2: these only
#if LS_TP == 1
  if (!only_attention)
    traced = {MakeConfig<10, 16384, 8, true, true, 0, 0, 1>(),
              best,
              MakeConfig<10, 16384, 8, true, true, 0, 0, 1, true, 3>(),
              MakeConfig<10, 16384, 8, false, true, 0, 0, 1>(),
              MakeConfig<10, 16384, 8, true, true, 0, 2, 1>(),
              best_attn};
#endif
  const char* proj[] = {"qkv", "o", "gate_up", "down"};
  for (const Config& c : traced) {
    CK(cudaMemset(trace, 0, trace_words * 8));
    CK(cudaMemset(counter, 0, kCounterBytes));
    Params P{w_dev, norm, x_in, x_out, part, act, counter, L, 0, 4 * L, 0u, tpart, tact, epoch++,
             trace, pair_part};
    P.attn = aa;
    void* args[] = {&P};
    CK(cudaLaunchCooperativeKernel((void*)c.kernel, dim3(nb), dim3(c.threads), args, c.smem, s));
    CK(cudaStreamSynchronize(s));
    std::vector<unsigned long long> h(trace_words);
    CK(cudaMemcpy(h.data(), trace, h.size() * 8, cudaMemcpyDeviceToHost));
    printf("TRACE %s, layer %d, us median/max over blocks (clock %.0f MHz):\n", c.name.c_str(),
           L / 2, cyc_us);
    printf("  %-8s %13s %13s %13s %13s %13s %13s %9s\n", "", "chunks", "epilogue", "wait",
           "input", "arrival skew", "late leave", "span");
    for (int p = 0; p < 4; ++p) {
      std::vector<double> ch, ep, wt, in, lv;
      unsigned long long a_min = ~0ull, a_max = 0, s_min = ~0ull, d_max = 0;
      auto at = [&](int blk, int point, int k) { return h[((size_t)blk * 4 + p) * 10 + point * 2 + k]; };
      for (int blk = 0; blk < nb; ++blk) {
        ch.push_back((at(blk, 1, 1) - at(blk, 0, 1)) / cyc_us);
        ep.push_back((at(blk, 2, 1) - at(blk, 1, 1)) / cyc_us);
        wt.push_back((at(blk, 3, 1) - at(blk, 2, 1)) / cyc_us);
        in.push_back((at(blk, 4, 1) - at(blk, 3, 1)) / cyc_us);
        a_min = std::min(a_min, at(blk, 2, 0));
        a_max = std::max(a_max, at(blk, 2, 0));
        s_min = std::min(s_min, at(blk, 0, 0));
        d_max = std::max(d_max, at(blk, 4, 0));
      }
      for (int blk = 0; blk < nb; ++blk) lv.push_back(((double)at(blk, 3, 0) - (double)a_max) / 1e3);
      printf("  %-8s %13s %13s %13s %13s %13.2f %13s %9.2f\n", proj[p], stat(ch).c_str(),
             stat(ep).c_str(), stat(wt).c_str(), stat(in).c_str(), (a_max - a_min) / 1e3,
             stat(lv).c_str(), (d_max - s_min) / 1e3);
    }
    if (c.attn) {  // the attention phase of blocks with a chunk, in cycles of each block
      std::vector<double> rd, sm, pv, ct, mg, wt, in;
      for (int blk = 0; blk < attn::kBlocks; ++blk) {
        auto pt = [&](int k) { return (double)h[(size_t)nb * 40 + (size_t)blk * 12 + 2 * k + 1]; };
        const double entry = (double)h[((size_t)blk * 4) * 10 + 3 * 2 + 1];
        const double input = (double)h[((size_t)blk * 4) * 10 + 4 * 2 + 1];
        rd.push_back((pt(0) - entry) / cyc_us);
        sm.push_back((pt(5) - pt(0)) / cyc_us);
        pv.push_back((pt(1) - pt(5)) / cyc_us);
        ct.push_back((pt(2) - pt(1)) / cyc_us);
        if (pt(3) > 0) mg.push_back((pt(3) - pt(2)) / cyc_us);
        wt.push_back((pt(4) - (pt(3) > 0 ? pt(3) : pt(2))) / cyc_us);
        in.push_back((input - pt(4)) / cyc_us);
      }
      printf("  attention phase, us median/max over its %d blocks: q/k/v read %s, rotation + "
             "scores + softmax %s, values + the chunk's result %s, the count %s, the merge %s "
             "(%zu blocks), to the barrier's release %s, o's input %s\n",
             attn::kBlocks, stat(rd).c_str(), stat(sm).c_str(), stat(pv).c_str(), stat(ct).c_str(),
             mg.empty() ? "-" : stat(mg).c_str(), mg.size(), stat(wt).c_str(), stat(in).c_str());
    }
    fflush(stdout);
  }
  return 0;
}
