// The attention of one decode step as a phase of layer_stream.cu's persistent kernel (ATTN):
// between qkv's grid barrier and o's, with no launch of its own. One rank's Llama-8B shapes at
// LS_TP: 8 / LS_TP KV heads of 4 query heads, head_dim 128, the cache
// [layers][2][kv heads][kCap][128] ("bhsd", as the decoder's Pallas path keeps it), keys
// 0..pos seen, the new key and value in slot pos.
//
// Work: block b < kBlocks = kKv * kSplits takes KV head b / kSplits and the chunk of kChunk keys
// b % kSplits (flash-decoding's split-K); the other blocks only pass the barriers.
//   - The chunk's keys and values (16 KiB each, contiguous: ChunkSrc) travel through the
//     block's weight ring as two more chunks right after its share of qkv's weights: the
//     cache's old slots do not depend on this step, so the producer loads them ahead like any
//     weight.
//   - Phase, after qkv's barrier: the head's q, k, v from qkv's two partial halves (bf16, as
//     the dot returns them), the rotary embedding (float32, to bf16, as models/attention's),
//     the new key and value written to slot pos (by the block whose chunk holds it, which uses
//     them in place of the slot's stale contents), the scores, the chunk's softmax (its max m
//     and sum l), its unnormalised output to `part`; then an acq_rel count per KV head, and the
//     head's last block to arrive merges the kSplits partial results in chunk order
//     (deterministic) into `out` (bf16, heads in (kv head, group) order).
// Every block's consumers are the 256 threads t of layer_stream's 8 consumer warps.
#pragma once
#include <cuda_bf16.h>

#include <cmath>
#include <vector>

#include "probe_util.cuh"

#ifndef LS_TP
#define LS_TP 1  // tensor parallelism whose per-rank shapes the probe runs (1 or 2)
#endif

namespace attn {

constexpr int kKv = 8 / LS_TP, kGroup = 4, kD = 128;  // one rank's KV heads
constexpr int kSplits = 16, kChunk = 64;  // 8 x 16 = 128 working blocks of 132 (TP=2: 64)
constexpr int kBlocks = kKv * kSplits;     // the blocks with a chunk: b < kBlocks
constexpr int kCap = kSplits * kChunk;     // cache slots per head (KV 1024)
constexpr int kPerHead = (kGroup + 2) * kD;  // a KV head's qkv columns: its 4 q heads, k, v
constexpr int kPartStride = kGroup * kD + 2 * kGroup;  // one chunk's o [4][128], m [4], l [4]
constexpr int kThreads = 256;
// Scratch floats the phase takes from the block's shared memory (layer_stream's xs).
constexpr int kQPad = 36;  // a query quarter's 32 floats + 4: the 4 quarters in distinct banks
constexpr int kScratch =
    kPerHead + kD + kGroup * 4 * kQPad + 2 * kD + kGroup * kChunk + 2 * kGroup + 8 * 16 * 32;

struct Args {
  bf16* cache;            // [layers][2][kKv][kCap][kD]
  const float* rot;       // [2][kD / 2] this step's rotary cos, then sin (the caller computes
                          // them once per step, as models.attention.rope_cos_sin)
  int pos;                // this token's slot (< kCap): slots 0..pos are seen
  float* part;            // [kBlocks][kPartStride]
  bf16* out;              // [kKv * kGroup * kD] the attention's output (o's input)
  unsigned* head_count;   // [kKv] chunks finished per head, counted over the launch
};

// Slot s of head h's keys (kv 0) or values (kv 1) of a layer (the host uses it for its checks).
__host__ __device__ __forceinline__ bf16* Slot(const Args& A, int layer, int kv, int h, int s) {
  return A.cache + ((((size_t)layer * 2 + kv) * kKv + h) * kCap + s) * kD;
}

// Block b's chunk of the layer's keys (kv 0) or values (kv 1): kChunk slots of kD, contiguous.
__device__ __forceinline__ const uint4* ChunkSrc(const Args& A, int layer, int kv, int b) {
  return reinterpret_cast<const uint4*>(Slot(A, layer, kv, b / kSplits, (b % kSplits) * kChunk));
}
constexpr int kChunkBytes = kChunk * kD * 2;

// kc, vc: the chunk's keys and values (ring stages, slots as in the cache: those after pos and
// slot pos itself stale); release() once both are read. qkv_part: qkv's two partial halves (the
// second `half` floats after the first). sync(): the consumers' named barrier. s: kScratch
// floats of shared memory. mark(k): a timestamp at point k (0 q, k, v read; 5 rotated, scores
// and softmax done; 1 the chunk's result written; 2 counted; 3 merged; the caller's 4: after
// the barrier that follows).
template <class Sync, class Release, class Mark>
__device__ void Phase(const Args& A, int layer, int b, int t, const uint4* kc, const uint4* vc,
                      const float* qkv_part, size_t half, float* s, Sync sync, Release release,
                      Mark mark) {
  if (b >= kBlocks) return;
  const int h = b / kSplits, ci = b % kSplits, s0 = ci * kChunk;
  const int lane = t % 32, w = t / 32;
  float* raw = s;                         // [kPerHead] q0..q3, k, v as bf16 values
  float* rot = raw + kPerHead;            // [2][kD / 2] cos, sin
  float* qs = rot + kD;                   // [4][4 quarters][kQPad] rotated queries
  float* kn = qs + kGroup * 4 * kQPad;    // [kD] the new key, rotated
  float* vn = kn + kD;                    // [kD] the new value
  float* sc = vn + kD;                    // [4][kChunk] scores, then probabilities
  float* ml = sc + kGroup * kChunk;       // [4] m, [4] l
  float* red = ml + 2 * kGroup;           // [8 warps][4 heads x 8 dims][16] the values' sums

  // The head's qkv columns, the two halves added and rounded as the dot's bf16; the rotation.
  static_assert(kPerHead / 4 + kD / 2 <= kThreads, "one round of loads");
  if (t >= kPerHead / 4 && t < kPerHead / 4 + kD / 2) {
    const int d = t - kPerHead / 4;
    const float c = __ldg(A.rot + d), sn = __ldg(A.rot + kD / 2 + d);
    rot[d] = c, rot[kD / 2 + d] = sn;
  }
  const float4* p0 = reinterpret_cast<const float4*>(qkv_part + (size_t)h * kPerHead);
  const float4* p1 = reinterpret_cast<const float4*>(qkv_part + half + (size_t)h * kPerHead);
  if (t < kPerHead / 4) {
    const float4 a = __ldcg(p0 + t), d = __ldcg(p1 + t);
    raw[4 * t] = Bf(a.x + d.x), raw[4 * t + 1] = Bf(a.y + d.y);
    raw[4 * t + 2] = Bf(a.z + d.z), raw[4 * t + 3] = Bf(a.w + d.w);
  }
  sync();
  mark(0);
  // Rotary embedding (rotate_half layout) of the 4 queries and the key; the value as it is.
  for (int x = t; x < (kGroup + 1) * (kD / 2); x += kThreads) {
    const int g = x / (kD / 2), d = x % (kD / 2);
    const float cs = rot[d], sn = rot[kD / 2 + d];
    const float x1 = raw[g * kD + d], x2 = raw[g * kD + d + kD / 2];
    const float lo = Bf(x1 * cs - x2 * sn), hi = Bf(x2 * cs + x1 * sn);
    if (g < kGroup) {
      qs[g * 4 * kQPad + (d / 32) * kQPad + d % 32] = lo;
      qs[g * 4 * kQPad + (d / 32 + 2) * kQPad + d % 32] = hi;
    } else {
      kn[d] = lo, kn[d + kD / 2] = hi;
    }
  }
  if (t < kD) vn[t] = raw[(kGroup + 1) * kD + t];
  sync();
  const bool holds_new = A.pos >= s0 && A.pos < s0 + kChunk;
  if (holds_new && t < kD) {  // this step's key and value into the cache, for later steps
    Slot(A, layer, 0, h, A.pos)[t] = __float2bfloat16_rn(kn[t]);
    Slot(A, layer, 1, h, A.pos)[t] = __float2bfloat16_rn(vn[t]);
  }

  // Scores: thread t, key s0 + t / 4, dims quarter t % 4; the 4 quarters added by shuffles.
  {
    const int key = s0 + t / 4, qd = t % 4;
    float acc[kGroup] = {0.f, 0.f, 0.f, 0.f};
    if (key <= A.pos) {
      float kf[32];
      if (key == A.pos) {
#pragma unroll
        for (int e = 0; e < 32; ++e) kf[e] = kn[qd * 32 + e];
      } else {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const uint4 kq = kc[(t / 4) * (kD / 8) + qd * 4 + u];
          const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&kq);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = __bfloat1622float2(k2[e]);
            kf[u * 8 + 2 * e] = f.x, kf[u * 8 + 2 * e + 1] = f.y;
          }
        }
      }
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        const float4* q4 = reinterpret_cast<const float4*>(qs + g * 4 * kQPad + qd * kQPad);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float4 q = q4[e];
          acc[g] = fmaf(q.x, kf[4 * e], fmaf(q.y, kf[4 * e + 1],
                   fmaf(q.z, kf[4 * e + 2], fmaf(q.w, kf[4 * e + 3], acc[g]))));
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      acc[g] += __shfl_xor_sync(0xffffffffu, acc[g], 1);
      acc[g] += __shfl_xor_sync(0xffffffffu, acc[g], 2);
    }
    if (qd == 0)
#pragma unroll
      for (int g = 0; g < kGroup; ++g)
        sc[g * kChunk + t / 4] = key <= A.pos ? acc[g] * rsqrtf((float)kD) : -INFINITY;
  }
  sync();
  // The chunk's softmax, one warp per query head: m, p = exp(s - m), l = sum(p).
  if (w < kGroup) {
    const float a = sc[w * kChunk + lane], d = sc[w * kChunk + lane + 32];
    float m = fmaxf(a, d);
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float pa = m == -INFINITY ? 0.f : expf(a - m), pd = m == -INFINITY ? 0.f : expf(d - m);
    float l = pa + pd;
    for (int o = 16; o; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
    sc[w * kChunk + lane] = pa, sc[w * kChunk + lane + 32] = pd;
    if (lane == 0) ml[w] = m, ml[kGroup + w] = l;
  }
  sync();
  mark(5);
  // Values: thread t, keys (t / 16) * 4 .. + 4, dims (t % 16) * 8 .. + 8, for the 4 heads;
  // the two key groups of a warp by one shuffle, the 8 warps through shared memory.
  {
    const int kg = t / 16, dv = t % 16;
    float acc[kGroup][8] = {};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int key = s0 + kg * 4 + j;
      if (key > A.pos) continue;
      float vf[8];
      if (key == A.pos) {
#pragma unroll
        for (int e = 0; e < 8; ++e) vf[e] = vn[dv * 8 + e];
      } else {
        const uint4 vq = vc[(kg * 4 + j) * (kD / 8) + dv];
        const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&vq);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 f = __bfloat1622float2(v2[e]);
          vf[2 * e] = f.x, vf[2 * e + 1] = f.y;
        }
      }
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        const float p = sc[g * kChunk + kg * 4 + j];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
      }
    }
#pragma unroll
    for (int g = 0; g < kGroup; ++g)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], 16);
    if (lane < 16)
#pragma unroll
      for (int g = 0; g < kGroup; ++g)
#pragma unroll
        for (int e = 0; e < 8; ++e) red[(w * 32 + g * 8 + e) * 16 + dv] = acc[g][e];  // lanes: banks
  }
  sync();
  release();
  float* mine = A.part + (size_t)(h * kSplits + ci) * kPartStride;
  for (int x = t; x < kGroup * kD; x += kThreads) {  // x = g * kD + d
    const int g = x / kD, d = x % kD;
    float v = 0.f;
    for (int ww = 0; ww < 8; ++ww) v += red[(ww * 32 + g * 8 + d % 8) * 16 + d / 8];
    mine[x] = v;
  }
  if (t < 2 * kGroup) mine[kGroup * kD + t] = ml[t];
  sync();
  mark(1);
  // The head's last chunk to finish merges them all (its count's acq_rel orders the other
  // blocks' partial results, published by their own counts, before its reads).
  unsigned* last = reinterpret_cast<unsigned*>(ml);  // m, l are in `mine` now
  if (t == 0) {
    unsigned old;
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;" : "=r"(old) : "l"(A.head_count + h)
                 : "memory");
    *last = (old + 1) % kSplits == 0;
  }
  sync();
  mark(2);
  if (!*last) return;
  const float* all = A.part + (size_t)h * kSplits * kPartStride;
  constexpr int kOuts = kGroup * kD / kThreads;  // outputs x = t + u * kThreads per thread
  static_assert(kSplits * 2 * kGroup <= kThreads, "one (m or l) per thread");
  // Every load in one round: each thread's outputs from the kSplits chunks, and one chunk's m
  // or l per thread (to shared memory, `sc`, for all).
  float o[kOuts][kSplits];
#pragma unroll
  for (int u = 0; u < kOuts; ++u)
#pragma unroll
    for (int k = 0; k < kSplits; ++k) o[u][k] = __ldcg(all + k * kPartStride + t + u * kThreads);
  if (t < kSplits * 2 * kGroup)  // sc: [chunk][m 4, l 4]
    sc[t] = __ldcg(all + (t / (2 * kGroup)) * kPartStride + kGroup * kD + t % (2 * kGroup));
  sync();
#pragma unroll
  for (int u = 0; u < kOuts; ++u) {
    const int g = (t + u * kThreads) / kD;
    float top = -INFINITY, num = 0.f, den = 0.f;
#pragma unroll
    for (int k = 0; k < kSplits; ++k) top = fmaxf(top, sc[k * 2 * kGroup + g]);
#pragma unroll
    for (int k = 0; k < kSplits; ++k) {
      const float mk = sc[k * 2 * kGroup + g];
      const float f = mk == -INFINITY ? 0.f : expf(mk - top);
      num = fmaf(f, o[u][k], num);
      den = fmaf(f, sc[k * 2 * kGroup + kGroup + g], den);
    }
    A.out[(size_t)h * kGroup * kD + t + u * kThreads] = __float2bfloat16_rn(num / den);
  }
  sync();
  mark(3);
}

// ---- the host's reference (double, the kernel's bf16 roundings) ----------------------------------

// The attention output [kKv * kGroup * kD] of one layer from its qkv (unrounded dot results),
// the layer's old cache slots (keys, then values: [2][kKv][kCap][kD], slots < pos used) and the
// step's rotary cos and sin (Args::rot); new_kv (out): the rotated new key and the value
// [kKv][2][kD], as the kernel writes them to slot pos.
inline std::vector<float> Reference(const std::vector<double>& qkv, const std::vector<bf16>& cache,
                                    const std::vector<float>& rot, int pos,
                                    std::vector<float>& new_kv) {
  std::vector<float> out((size_t)kKv * kGroup * kD);
  new_kv.assign((size_t)kKv * 2 * kD, 0.f);
  auto rope = [&](const double* x, float* y) {  // x: kD unrounded values
    for (int d = 0; d < kD / 2; ++d) {
      const double cs = rot[d], sn = rot[kD / 2 + d];
      const double x1 = Bf(x[d]), x2 = Bf(x[d + kD / 2]);
      y[d] = Bf(x1 * cs - x2 * sn);
      y[d + kD / 2] = Bf(x2 * cs + x1 * sn);
    }
  };
  for (int h = 0; h < kKv; ++h) {
    const double* base = qkv.data() + (size_t)h * kPerHead;
    float* kn = &new_kv[(size_t)h * 2 * kD];
    float* vn = kn + kD;
    rope(base + kGroup * kD, kn);
    for (int d = 0; d < kD; ++d) vn[d] = Bf(base[(kGroup + 1) * kD + d]);
    auto key = [&](int s, int d) {
      return s == pos ? kn[d] : __bfloat162float(cache[(((size_t)0 * kKv + h) * kCap + s) * kD + d]);
    };
    auto val = [&](int s, int d) {
      return s == pos ? vn[d] : __bfloat162float(cache[(((size_t)1 * kKv + h) * kCap + s) * kD + d]);
    };
    for (int g = 0; g < kGroup; ++g) {
      float q[kD];
      rope(base + g * kD, q);
      std::vector<double> p(pos + 1);
      double top = -INFINITY;
      for (int s = 0; s <= pos; ++s) {
        double acc = 0;
        for (int d = 0; d < kD; ++d) acc += (double)q[d] * key(s, d);
        p[s] = acc / std::sqrt((double)kD);
        top = std::max(top, p[s]);
      }
      double den = 0;
      for (int s = 0; s <= pos; ++s) den += p[s] = std::exp(p[s] - top);
      for (int d = 0; d < kD; ++d) {
        double num = 0;
        for (int s = 0; s <= pos; ++s) num += p[s] * val(s, d);
        out[((size_t)h * kGroup + g) * kD + d] = Bf(num / den);
      }
    }
  }
  return out;
}

}  // namespace attn
