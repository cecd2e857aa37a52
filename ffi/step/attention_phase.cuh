// The decode attention as a phase of the persistent step: RoPE, the new slot written, each KV
// head's keys split into ranges (one block each, an online softmax in float32), the head's last
// block merging the ranges in order. StepParams: the kernel's parameters (s, qkv, rope, cache,
// part, heads (the per-head counts), attn, score_scale). A rank's blocks take its KV heads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "step/device_math.cuh"

namespace sifar {
namespace cuda {
namespace phase {

// Keys one block's range takes at least (a range's merge costs an L2 round trip per range).
constexpr int kKeysPerSplit = 64;

template <class StepParams>
__device__ __forceinline__ bf16* Slot(const StepParams& P, int l, int kv01, int h, int j) {
  const step::Shape& s = P.s;
  return P.cache + ((((static_cast<size_t>(l) * 2 + kv01) * s.kv_heads + h) * s.capacity + j) *
                    kHeadDim);
}

// How a layer's attention splits each of kv KV heads' keys [start, pos] over g blocks: nsplit
// ranges of `per` keys (the last shorter), one block each, every range at least
// kKeysPerSplit keys long.
__device__ __forceinline__ void SplitKeys(int kv, int g, int pos, int start, int* nsplit, int* per) {
  const int nkeys = pos + 1 - start;
  int n = min(min(kMaxSplits, max(1, g / kv)),
              (nkeys + kKeysPerSplit - 1) / kKeysPerSplit);
  n = max(n, 1);
  *per = (nkeys + n - 1) / n;
  *nsplit = (nkeys + *per - 1) / *per;  // no empty range
}

// Qwen3's q/k path of one KV head (base: its G query rows, key, value in P.qkv): warp w takes
// rows w, w + kWarps, ... of the G + 1 normed ones: lane l's quad of the row, its sum of squares
// (fma, in order), the butterfly; bf16(bf16(v * inv) * scale) into qf / kn; after a barrier the
// RoPE in place, each thread a (d, d + D/2) pair; the value row as it is.
template <int G>
__device__ __forceinline__ void QkNormRope(const bf16* base, float* qf, float* kn, float* vn,
                                           const float* cs, const uint16_t* q_norm,
                                           const uint16_t* k_norm, float eps) {
  constexpr int D = kHeadDim;
  static_assert(D == 4 * 32, "a head is one warp's quads");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int row = warp; row <= G; row += kWarps) {
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(base + row * D) + lane);
    const float e[4] = {__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                        __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u)};
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) ss = __fmaf_rn(e[k], e[k], ss);
    ss = __shfl_sync(0xffffffffu, WarpSum(ss), 0);  // lane 0's butterfly, as the CPU's
    const float inv = __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(D)), eps)));
    const bf16* sc = reinterpret_cast<const bf16*>(row < G ? q_norm : k_norm);
    float* out = row < G ? qf + row * D : kn;
#pragma unroll
    for (int k = 0; k < 4; ++k) out[4 * lane + k] = Rb(__fmul_rn(Rb(__fmul_rn(e[k], inv)), F(sc[4 * lane + k])));
  }
  for (int d = threadIdx.x; d < D; d += kThreads) vn[d] = LoadBf(base + (G + 1) * D + d);
  BlockSync();
  for (int idx = threadIdx.x; idx < (G + 1) * (D / 2); idx += kThreads) {
    const int row = idx / (D / 2), d = idx % (D / 2);
    float* v = row < G ? qf + row * D : kn;
    const float a = v[d], c = v[d + D / 2];
    v[d] = Rb(__fadd_rn(__fmul_rn(a, __ldg(cs + d)), __fmul_rn(-c, __ldg(cs + D + d))));
    v[d + D / 2] = Rb(__fadd_rn(__fmul_rn(c, __ldg(cs + d + D / 2)), __fmul_rn(a, __ldg(cs + D + d + D / 2))));
  }
}

// The attention of layer l for the query heads of KV heads [h0, h0 + nh) (llama_step.h), on
// the g blocks of a rank (b: this block among them); sm: the block's shared memory (its GEMV
// input is dead here).
// kQkNorm (Qwen3): each query and key head RMSNormed over its kHeadDim values before the RoPE
// (q_norm, k_norm: bf16 [kHeadDim] scales; the sum of squares one warp's, a lane's quad in order,
// the butterfly: step_common.h's SumSquares of a head), bf16(bf16(v * inv) * scale).
template <int G, class StepParams, bool kQkNorm = false>
__device__ __forceinline__ void Attention(const StepParams& P, int l, float* sm, int* flag, int pos,
                                          int start, int h0, int nh, int b, int g,
                                          const uint16_t* q_norm = nullptr,
                                          const uint16_t* k_norm = nullptr) {
  const int KV = P.s.kv_heads, D = kHeadDim, DP = D + 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int nsplit, per;
  SplitKeys(nh, g, pos, start, &nsplit, &per);
  float* qf = sm;              // [G][D] roped queries
  float* kn = qf + G * D;      // [D] the new key (roped), [D] the new value
  float* vn = kn + D;
  float* wp = vn + D;          // [warps][G][D + 2]: each warp's acc, max, sum
  const float* cs = P.rope;
  for (int item = b; item < nh * nsplit; item += g) {
    const int h = h0 + item / nsplit, sp = item % nsplit;
    const bf16* base = P.qkv + static_cast<size_t>(h) * (G + 2) * D;
    if constexpr (kQkNorm) {
      QkNormRope<G>(base, qf, kn, vn, cs, q_norm, k_norm, P.s.eps);
    } else {
      for (int idx = threadIdx.x; idx < (G + 2) * D; idx += kThreads) {
        const int row = idx / D, d = idx % D;
        const float v = LoadBf(base + idx);
        float val = v;
        if (row <= G) {
          const float rot = d < D / 2 ? -LoadBf(base + idx + D / 2) : LoadBf(base + idx - D / 2);
          val = Rb(__fadd_rn(__fmul_rn(v, __ldg(cs + d)), __fmul_rn(rot, __ldg(cs + D + d))));
        }
        (row < G ? qf + row * D : row == G ? kn : vn)[d] = val;
      }
    }
    BlockSync();
    if (sp == nsplit - 1) {  // the range holding the new slot writes it, then reads it back
      for (int d = threadIdx.x; d < D; d += kThreads) {
        Slot(P, l, 0, h, pos)[d] = __float2bfloat16_rn(kn[d]);
        Slot(P, l, 1, h, pos)[d] = __float2bfloat16_rn(vn[d]);
      }
      BlockSync();  // the block's own global writes, visible to its L2 reads below
    }
    const int j0 = start + sp * per, j1 = min(j0 + per, pos + 1);
    float m[G], ls[G], acc[G][4];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      m[g] = -INFINITY, ls[g] = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[g][i] = 0.0f;
    }
    // A lane per key: its G scores are whole 128-wide dot products in the lane (no butterfly),
    // the key's row loaded at once (16 x 16 bytes). A round gives each warp kpw <= 32
    // consecutive keys (a short range spreads over all warps: 64 keys, 8 a warp), so a block
    // takes 256 keys a round (at 16K on Llama-8B, a block's 1,000 keys in 4 rounds).
    // Its online softmax keeps one max per head for the warp and a partial sum per lane; the
    // values are then summed lane-per-dimension, each key's weight broadcast from its lane, 8
    // value rows in flight while the 8 before them are summed. A key past the range scores
    // -inf (weight 0; its loads read the range's last row).
    const bf16* kbase = Slot(P, l, 0, h, 0);
    const bf16* vbase = Slot(P, l, 1, h, 0);
    const int kpw = min(32, (j1 - j0 + kWarps - 1) / kWarps);  // keys per warp and round
    for (int jr = j0; jr < j1; jr += kWarps * kpw) {
      const int jb = jr + warp * kpw;  // this warp's first key this round
      if (jb >= j1) break;             // warp-uniform: the range's end
      const int nk = min(kpw, j1 - jb);
      const auto vrow = [&](int u) {  // lane's 4 values of this warp's key u (clamped)
        return __ldcg(reinterpret_cast<const uint2*>(vbase + static_cast<size_t>(min(jb + u, j1 - 1)) * D) + lane);
      };
      uint2 vcur[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) vcur[u] = vrow(u);
      const bool live = lane < nk;
      const uint4* krow =
          reinterpret_cast<const uint4*>(kbase + static_cast<size_t>(jb + (live ? lane : nk - 1)) * D);
      uint4 kc[D / 8];
#pragma unroll
      for (int c = 0; c < D / 8; ++c) kc[c] = krow[c];  // through L1: both halves of a sector
      float sc[G];
#pragma unroll
      for (int g = 0; g < G; ++g) sc[g] = 0.0f;
#pragma unroll
      for (int c = 0; c < D / 8; ++c) {
        const uint32_t w4[4] = {kc[c].x, kc[c].y, kc[c].z, kc[c].w};
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float4 qa = reinterpret_cast<const float4*>(qf + g * D + 8 * c)[0];
          const float4 qb = reinterpret_cast<const float4*>(qf + g * D + 8 * c)[1];
          const float qv[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
          float dot = sc[g];
#pragma unroll
          for (int t = 0; t < 8; ++t) {
            const uint32_t wd = w4[t / 2];
            dot = __fmaf_rn(qv[t], __uint_as_float(t % 2 == 0 ? wd << 16 : wd & 0xffff0000u), dot);
          }
          sc[g] = dot;
        }
      }
      float e[G];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float sg = live ? __fmul_rn(sc[g], P.score_scale) : -INFINITY;
        float mx = sg;  // lane 0's key is live: mx is finite
#pragma unroll
        for (int off = 16; off >= 1; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const float mn = fmaxf(m[g], mx), corr = expf(m[g] - mn);
        e[g] = expf(sg - mn);
        ls[g] = __fmaf_rn(ls[g], corr, e[g]);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[g][i] = __fmul_rn(acc[g][i], corr);
        m[g] = mn;
      }
#pragma unroll
      for (int b = 0; b < 4; ++b) {  // the values, 8 keys at a time
        if (8 * b >= nk) break;      // warp-uniform
        uint2 vnext[8];
        if (8 * b + 8 < nk) {
#pragma unroll
          for (int u = 0; u < 8; ++u) vnext[u] = vrow(8 * b + 8 + u);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
#pragma unroll
          for (int g = 0; g < G; ++g) {
            const float wgt = __shfl_sync(0xffffffffu, e[g], 8 * b + u);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const uint32_t word = i < 2 ? vcur[u].x : vcur[u].y;
              acc[g][i] = __fmaf_rn(wgt, __uint_as_float(i % 2 == 0 ? word << 16 : word & 0xffff0000u),
                                    acc[g][i]);
            }
          }
        }
        if (8 * b + 8 < nk) {
#pragma unroll
          for (int u = 0; u < 8; ++u) vcur[u] = vnext[u];
        }
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) ls[g] = WarpSum(ls[g]);  // the lanes' partial sums
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float* o = wp + (warp * G + g) * DP;
#pragma unroll
      for (int i = 0; i < 4; ++i) o[lane * 4 + i] = acc[g][i];
      if (lane == 0) o[D] = m[g], o[D + 1] = ls[g];
    }
    BlockSync();
    float* part = P.part + (static_cast<size_t>(h) * kMaxSplits) * G * DP;
    for (int idx = threadIdx.x; idx < G * D; idx += kThreads) {
      const int g = idx / D, d = idx % D;
      float mx = -INFINITY;
      for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, wp[(w * G + g) * DP + D]);
      float a = 0.0f, den = 0.0f;
      for (int w = 0; w < kWarps; ++w) {
        const float* o = wp + (w * G + g) * DP;
        if (o[D] == -INFINITY) continue;  // a warp without keys
        const float f = expf(o[D] - mx);
        a = __fmaf_rn(o[d], f, a);
        den = __fmaf_rn(o[D + 1], f, den);
      }
      float* dst = part + (static_cast<size_t>(sp) * G + g) * DP;
      dst[d] = a;
      if (d == 0) dst[D] = mx, dst[D + 1] = den;
    }
    BlockSync();
    if (threadIdx.x == 0) {  // release this range's partial, and (the last) acquire the others'
      unsigned old;  // acq_rel: cumulative over the block's writes and to it, through the barriers
      asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                   : "=r"(old) : "l"(P.heads + l * KV + h) : "memory");
      *flag = old == static_cast<unsigned>(nsplit - 1);
    }
    BlockSync();
    if (*flag) {  // the head's last range: merge the ranges in order
      for (int idx = threadIdx.x; idx < G * D; idx += kThreads) {
        const int g = idx / D, d = idx % D;
        float mx = -INFINITY, num = 0.0f, den = 0.0f;  // one pass, rescaled as the max grows
#pragma unroll 8
        for (int q = 0; q < nsplit; ++q) {
          const float* src = part + (static_cast<size_t>(q) * G + g) * DP;
          const float mq = __ldcg(src + D), aq = __ldcg(src + d), lq = __ldcg(src + D + 1);
          const float mn = fmaxf(mx, mq), cold = expf(mx - mn), cq = expf(mq - mn);
          num = __fmaf_rn(aq, cq, __fmul_rn(num, cold));
          den = __fmaf_rn(lq, cq, __fmul_rn(den, cold));
          mx = mn;
        }
        P.attn[(static_cast<size_t>(h) * G + g) * D + d] = __float2bfloat16_rn(__fdiv_rn(num, den));
      }
    }
    BlockSync();
  }
}

}  // namespace phase
}  // namespace cuda
}  // namespace sifar
