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

// The attention of layer l for the query heads of KV heads [h0, h0 + nh) (llama_step.h), on
// the g blocks of a rank (b: this block among them); sm: the block's shared memory (its GEMV
// input is dead here).
template <int G, class StepParams>
__device__ __forceinline__ void Attention(const StepParams& P, int l, float* sm, int* flag, int pos,
                                          int start, int h0, int nh, int b, int g) {
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
    // kKeys keys per warp per round, their loads issued together (latency, not bandwidth,
    // bounds this loop: at 64 keys per range, one round); a key past the range scores -inf.
    // A round's scores are computed first (kKeys x G independent dot products and butterflies,
    // no chain between them), then its softmax update once per round: the online softmax's
    // rescale is per round, not per key.
    constexpr int kKeys = G >= 8 ? 4 : 8;
    const bf16* kbase = Slot(P, l, 0, h, 0);
    const bf16* vbase = Slot(P, l, 1, h, 0);
    for (int j = j0 + warp; j < j1; j += kWarps * kKeys) {
      uint2 kw[kKeys], vw[kKeys];
#pragma unroll
      for (int u = 0; u < kKeys; ++u) {
        const int jj = min(j + u * kWarps, j1 - 1);
        kw[u] = __ldcg(reinterpret_cast<const uint2*>(kbase + static_cast<size_t>(jj) * D) + lane);
        vw[u] = __ldcg(reinterpret_cast<const uint2*>(vbase + static_cast<size_t>(jj) * D) + lane);
      }
      float sc[kKeys][G];
#pragma unroll
      for (int u = 0; u < kKeys; ++u) {
        const float kf[4] = {__uint_as_float(kw[u].x << 16), __uint_as_float(kw[u].x & 0xffff0000u),
                             __uint_as_float(kw[u].y << 16), __uint_as_float(kw[u].y & 0xffff0000u)};
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float4 q = reinterpret_cast<const float4*>(qf + g * D)[lane];
          float dot = __fmul_rn(q.x, kf[0]);
          dot = __fmaf_rn(q.y, kf[1], dot);
          dot = __fmaf_rn(q.z, kf[2], dot);
          dot = __fmaf_rn(q.w, kf[3], dot);
          sc[u][g] = dot;
        }
      }
#pragma unroll
      for (int u = 0; u < kKeys; ++u)
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const bool live = j + u * kWarps < j1;
          sc[u][g] = live ? __fmul_rn(WarpSum(sc[u][g]), P.score_scale) : -INFINITY;
        }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float mn = m[g];
#pragma unroll
        for (int u = 0; u < kKeys; ++u) mn = fmaxf(mn, sc[u][g]);
        if (mn == -INFINITY) continue;  // nothing live yet
        const float corr = expf(m[g] - mn);
        float e[kKeys], es = 0.0f;
#pragma unroll
        for (int u = 0; u < kKeys; ++u) {
          e[u] = expf(sc[u][g] - mn);
          es = __fadd_rn(es, e[u]);
        }
        ls[g] = __fmaf_rn(ls[g], corr, es);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float a = __fmul_rn(acc[g][i], corr);
#pragma unroll
          for (int u = 0; u < kKeys; ++u) {
            const uint32_t word = i < 2 ? vw[u].x : vw[u].y;
            const float v = __uint_as_float(i % 2 == 0 ? word << 16 : word & 0xffff0000u);
            a = __fmaf_rn(e[u], v, a);
          }
          acc[g][i] = a;
        }
        m[g] = mn;
      }
    }
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
