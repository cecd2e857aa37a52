// The Llama step (llama_step.h) as one persistent kernel: a cooperative launch of every
// block that fits (all resident), phases separated by grid barriers, 5 per layer:
//   norm + qkv | attention | o + residual | norm + gate_up + SwiGLU | down + residual
// and the final norm after the last. The GEMV phases are fp8_matvec's lanes-32 row kernel
// (a warp per output row, 8 16-byte loads in flight per lane, double-buffered in
// registers); a phase's last batch of loads is followed by the NEXT projection's first
// batch, so each warp's first weights are on their way while the grid waits at the barrier
// (the weights never depend on the activations). The attention splits each KV head's keys
// into up to kMaxSplits ranges, one block each; a range's partial softmax goes to the
// workspace and the head's last block (an atomic count per layer and head) merges them in
// split order. Grid barriers spin a bounded time and trap past it: a lost block is a
// failed launch (an error from XLA), never a hang.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <string>

#include "allreduce/launch.h"
#include "allreduce/plan.h"
#include "core/cuda_check.h"
#include "step/llama_step.h"
#include "targets.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sifar {
namespace cuda {
namespace {

using bf16 = __nv_bfloat16;
using step::kHeadDim;
using step::kMaxSplits;
using step::kThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kU = 8;                        // 16-byte loads per lane per batch
// Keys one block's range takes at least (a range's merge costs an L2 round trip per range).
constexpr int kKeysPerSplit = 64;
constexpr long long kSpinLimit = 1ll << 30;  // ~seconds of polling: a lost block traps

struct Params {
  step::Shape s;
  float score_scale;
  const bf16* x;
  const float* rope;
  const int32_t* pos;
  const bf16* final_norm;
  bf16* cache;
  bf16* h;
  unsigned* counters;  // [0] the grid barrier, [1 + l * kv + head] the attention's counts
  bf16* qkv;
  bf16* attn;
  bf16* act;
  bf16* resid;
  float* part;
  step::LayerWeights layer[step::kMaxLayers];
};

// One GEMV phase: `items` output items of `rows` weight rows each (row r + i * pair).
struct Mat {
  const uint8_t* w;
  const float* s;
  bool per_channel;
  int items, k, rows, pair;
};

__device__ __forceinline__ float F(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float Rb(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float LoadBf(const bf16* p) {
  return __uint_as_float(static_cast<uint32_t>(__ldcg(reinterpret_cast<const unsigned short*>(p)))
                         << 16);
}

__device__ __forceinline__ uint4 LoadW(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// 16 weights times 16 inputs, one fma chain from 0 (fp8_matvec's chunk order).
__device__ __forceinline__ float Chunk(const uint4& v, const float4* q) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
  float w[16];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(words[i] >> (16 * h));
      const float2 fv = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
      w[4 * i + 2 * h] = fv.x;
      w[4 * i + 2 * h + 1] = fv.y;
    }
  const float4 a = q[0], b = q[1], c = q[2], d = q[3];
  const float x[16] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w,
                       c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
  float p = 0.0f;
#pragma unroll
  for (int j = 0; j < 16; ++j) p = __fmaf_rn(x[j], w[j], p);
  return p;
}

// The input vector in shared memory as float4s, swizzled so that a warp's 16-byte chunk
// reads hit distinct banks: chunk c's quad q at 4c + (q ^ ((c >> 1) & 3)).
__device__ __forceinline__ int XQuad(int c, int q) { return 4 * c + (q ^ ((c >> 1) & 3)); }

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Every block's writes before it are visible to every block after it: a CTA barrier, one
// thread's gpu-scope release (cumulative over the CTA's writes through bar.sync), its acquire
// of the count, a CTA barrier.
__device__ __forceinline__ void GridSync(unsigned* counter, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
    unsigned v;
    long long n = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
      if (++n > kSpinLimit) __trap();
    } while (v < target);
  }
  __syncthreads();
}

__device__ __forceinline__ void Issue(uint4 (&v)[kU], const Mat& m, int item, int b) {
  const int lane = threadIdx.x % 32, nl = (m.k + 511) / 512, nb = (nl + kU - 1) / kU;
  const int row = min(item, m.items - 1) + (b / nb) * m.pair, bb = b % nb;
  const uint8_t* p = m.w + static_cast<size_t>(row) * m.k + lane * 16 + bb * kU * 512;
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int ci = bb * kU + u;
    if (ci < nl && (lane + 32 * ci) * 16 < m.k) v[u] = LoadW(p + u * 512);
  }
}

// The phase's items over the grid's warps (item = warp + i * all warps); A holds this warp's
// first batch on entry and the next phase's (nx) on return. epi(item, its rows' sums).
__device__ __forceinline__ Mat LayerMat(const Params& P, int l, int p);

template <class Epi>
__device__ __forceinline__ void Gemv(const Params& P, int l, int p, int next_l, int next_p,
                                     const float4* xs, uint4 (&A)[kU], uint4 (&B)[kU], Epi epi) {
  const Mat m = LayerMat(P, l, p);
  const bool has_next = next_p >= 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sw = (lane >> 1) & 3;
  const int first = blockIdx.x * kWarps + warp, stride = gridDim.x * kWarps;
  const int nl = (m.k + 511) / 512, nb = (nl + kU - 1) / kU, tb = m.rows * nb;
  int item = first, b = 0;
  float acc = 0.0f, r0 = 0.0f, r1 = 0.0f;
  auto step = [&](const uint4 (&cur)[kU], uint4 (&nxt)[kU]) {
    int in = item, bn = b + 1;
    if (bn >= tb) bn = 0, in = item + stride;
    if (in < m.items)
      Issue(nxt, m, in, bn);
    else if (has_next)
      Issue(nxt, LayerMat(P, next_l, next_p), first, 0);
    const int bb = b % nb;
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int ci = bb * kU + u, c = lane + 32 * ci;
      if (ci >= nl) break;
      if (c * 16 >= m.k) continue;
      float4 q[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) q[j] = xs[4 * c + (j ^ sw)];
      acc = __fadd_rn(acc, Chunk(cur[u], q));
    }
    if ((b + 1) % nb == 0) {
      const float sum = WarpSum(acc);
      if (b < nb) r0 = sum; else r1 = sum;
      acc = 0.0f;
    }
    if (bn == 0 && lane == 0) epi(item, r0, r1);
    item = in, b = bn;
    return item < m.items;
  };
  bool in_a = true;
  if (item >= m.items) {
    if (has_next) Issue(A, LayerMat(P, next_l, next_p), first, 0);
  } else {
    while (true) {
      if (!step(A, B)) { in_a = false; break; }
      if (!step(B, A)) { in_a = true; break; }
    }
  }
  if (!in_a) {
#pragma unroll
    for (int u = 0; u < kU; ++u) A[u] = B[u];
  }
}

__device__ __forceinline__ float Scale(const float* s, unsigned per_channel, int row) {
  return per_channel ? __ldg(s + row) : __ldg(s);
}

// xs <- in[0, k) (bf16 written by this launch: read through L2).
__device__ void StageX(float4* xs, const bf16* in, int k) {
  for (int i = threadIdx.x; i < k / 4; i += kThreads) {
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(in) + i);
    xs[XQuad(i >> 2, i & 3)] =
        make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                    __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
  }
  __syncthreads();
}

// 1 / rms(r[0, n)): thread t's fma sum over the quads t, t + 256, ... (each quad's 4 in
// order), each warp's butterfly, the warps in order (the CPU handler's order).
__device__ float InvRms(const bf16* r, int n, float eps, float* red) {
  float ss = 0.0f;
#pragma unroll 4
  for (int i = threadIdx.x; i < n / 4; i += kThreads) {
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(r) + i);
    const float e[4] = {__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                        __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u)};
#pragma unroll
    for (int k = 0; k < 4; ++k) ss = __fmaf_rn(e[k], e[k], ss);
  }
  ss = WarpSum(ss);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
  __syncthreads();
  float tot = 0.0f;
  for (int w = 0; w < kWarps; ++w) tot = __fadd_rn(tot, red[w]);
  __syncthreads();  // red is reused by the next call
  return __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(tot, static_cast<float>(n)), eps)));
}

// xs <- bf16(bf16(r * inv) * scale), models' RMSNorm.
__device__ void StageNorm(float4* xs, const bf16* r, const uint16_t* scale, int n, float eps,
                          float* red) {
  const float inv = InvRms(r, n, eps, red);
  const bf16* sc = reinterpret_cast<const bf16*>(scale);
#pragma unroll 4
  for (int i = threadIdx.x; i < n / 4; i += kThreads) {
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(r) + i);
    const float e[4] = {__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                        __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u)};
    float y[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) y[k] = Rb(__fmul_rn(Rb(__fmul_rn(e[k], inv)), F(sc[4 * i + k])));
    xs[XQuad(i >> 2, i & 3)] = make_float4(y[0], y[1], y[2], y[3]);
  }
  __syncthreads();
}

__device__ __forceinline__ bf16* Slot(const Params& P, int l, int kv01, int h, int j) {
  const step::Shape& s = P.s;
  return P.cache + ((((static_cast<size_t>(l) * 2 + kv01) * s.kv_heads + h) * s.capacity + j) *
                    kHeadDim);
}

// How a layer's attention splits each KV head's keys [start, pos]: nsplit ranges of `per`
// keys (the last shorter), one block each, every range at least kKeysPerSplit keys long.
__device__ __forceinline__ void SplitKeys(int kv, int pos, int start, int* nsplit, int* per) {
  const int nkeys = pos + 1 - start;
  int n = min(min(kMaxSplits, max(1, static_cast<int>(gridDim.x) / kv)),
              (nkeys + kKeysPerSplit - 1) / kKeysPerSplit);
  n = max(n, 1);
  *per = (nkeys + n - 1) / n;
  *nsplit = (nkeys + *per - 1) / *per;  // no empty range
}

// The attention of layer l for every query head (llama_step.h); sm: the block's shared
// memory (its GEMV input is dead here).
template <int G>
__device__ __forceinline__ void Attention(const Params& P, int l, float* sm, int* flag, int pos,
                                          int start) {
  const int KV = P.s.kv_heads, D = kHeadDim, DP = D + 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int nsplit, per;
  SplitKeys(KV, pos, start, &nsplit, &per);
  float* qf = sm;              // [G][D] roped queries
  float* kn = qf + G * D;      // [D] the new key (roped), [D] the new value
  float* vn = kn + D;
  float* wp = vn + D;          // [warps][G][D + 2]: each warp's acc, max, sum
  const float* cs = P.rope;
  for (int item = blockIdx.x; item < KV * nsplit; item += gridDim.x) {
    const int h = item / nsplit, sp = item % nsplit;
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
    __syncthreads();
    if (sp == nsplit - 1) {  // the range holding the new slot writes it, then reads it back
      for (int d = threadIdx.x; d < D; d += kThreads) {
        Slot(P, l, 0, h, pos)[d] = __float2bfloat16_rn(kn[d]);
        Slot(P, l, 1, h, pos)[d] = __float2bfloat16_rn(vn[d]);
      }
      __syncthreads();  // the block's own global writes, visible to its L2 reads below
    }
    const int j0 = start + sp * per, j1 = min(j0 + per, pos + 1);
    float m[G], ls[G], acc[G][4];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      m[g] = -INFINITY, ls[g] = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[g][i] = 0.0f;
    }
    // kKeys keys per warp per round: their loads issued together, their G x kKeys dot
    // products' butterflies independent (interleaved, not one long shuffle chain), then one
    // rescale per round and head; a key past the range scores -inf.
    constexpr int kKeys = G >= 8 ? 1 : G >= 4 ? 2 : 4;
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
      float sc[G][kKeys];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float4 q = reinterpret_cast<const float4*>(qf + g * D)[lane];
#pragma unroll
        for (int u = 0; u < kKeys; ++u) {
          float dot = __fmul_rn(q.x, __uint_as_float(kw[u].x << 16));
          dot = __fmaf_rn(q.y, __uint_as_float(kw[u].x & 0xffff0000u), dot);
          dot = __fmaf_rn(q.z, __uint_as_float(kw[u].y << 16), dot);
          sc[g][u] = __fmaf_rn(q.w, __uint_as_float(kw[u].y & 0xffff0000u), dot);
        }
      }
#pragma unroll
      for (int off = 16; off >= 1; off /= 2)
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
          for (int u = 0; u < kKeys; ++u)
            sc[g][u] = __fadd_rn(sc[g][u], __shfl_xor_sync(0xffffffffu, sc[g][u], off));
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float mn = m[g];
#pragma unroll
        for (int u = 0; u < kKeys; ++u) {
          sc[g][u] = j + u * kWarps < j1 ? __fmul_rn(sc[g][u], P.score_scale) : -INFINITY;
          mn = fmaxf(mn, sc[g][u]);
        }
        const float corr = expf(m[g] - mn);  // m = -inf at first: 0
        ls[g] = __fmul_rn(ls[g], corr);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[g][i] = __fmul_rn(acc[g][i], corr);
#pragma unroll
        for (int u = 0; u < kKeys; ++u) {
          const float e = expf(sc[g][u] - mn);  // a dead key: 0
          ls[g] = __fadd_rn(ls[g], e);
          const float vf[4] = {__uint_as_float(vw[u].x << 16), __uint_as_float(vw[u].x & 0xffff0000u),
                               __uint_as_float(vw[u].y << 16), __uint_as_float(vw[u].y & 0xffff0000u)};
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[g][i] = __fmaf_rn(e, vf[i], acc[g][i]);
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
    __syncthreads();
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
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      const unsigned old = atomicAdd(P.counters + 1 + l * KV + h, 1u);
      *flag = old == static_cast<unsigned>(nsplit - 1);
    }
    __syncthreads();
    if (*flag) {  // the head's last range: merge the ranges in order
      __threadfence();
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
    __syncthreads();
  }
}

__device__ __forceinline__ Mat LayerMat(const Params& P, int l, int p) {
  const step::LayerWeights& L = P.layer[l];
  const step::Shape& s = P.s;
  switch (p) {
    case 0: return {L.qkv, L.qkv_scale, (L.scale_per_channel & 1) != 0, s.qkv_rows(), s.hidden, 1, 0};
    case 1: return {L.o, L.o_scale, (L.scale_per_channel & 2) != 0, s.hidden, s.q_dim(), 1, 0};
    case 2: return {L.gate_up, L.gate_up_scale, (L.scale_per_channel & 4) != 0, s.ffn, s.hidden, 2, s.ffn};
    default: return {L.down, L.down_scale, (L.scale_per_channel & 8) != 0, s.hidden, s.ffn, 1, 0};
  }
}

template <int G>
__global__ void __launch_bounds__(kThreads, 2) LlamaStepKernel(const __grid_constant__ Params P) {
  extern __shared__ float4 smem4[];
  __shared__ float red[kWarps];
  __shared__ int flag;
  float4* xs = smem4;
  const step::Shape& s = P.s;
  const int pos = P.pos[0], start = P.pos[1];
  if (pos < 0 || pos >= s.capacity || start < 0 || start > pos) {  // every block alike
    if (blockIdx.x == 0)
      for (int j = threadIdx.x; j < s.hidden; j += kThreads) P.h[j] = __float2bfloat16_rn(NAN);
    return;
  }
  unsigned bars = 0;
  auto sync = [&]() { GridSync(P.counters, ++bars * gridDim.x); };
  uint4 A[kU], B[kU];
  const int first = blockIdx.x * kWarps + threadIdx.x / 32;
  Issue(A, LayerMat(P, 0, 0), first, 0);
  for (int l = 0; l < s.layers; ++l) {
    const step::LayerWeights& L = P.layer[l];
    const bf16* rin = l == 0 ? P.x : P.resid;  // the residual stream before this layer
    StageNorm(xs, rin, L.input_norm, s.hidden, s.eps, red);
    Gemv(P, l, 0, 0, -1, xs, A, B, [&](int n, float r0, float) {
      P.qkv[n] = __float2bfloat16_rn(__fmul_rn(r0, Scale(L.qkv_scale, L.scale_per_channel & 1, n)));
    });
    sync();
    Attention<G>(P, l, reinterpret_cast<float*>(smem4), &flag, pos, start);
    Issue(A, LayerMat(P, l, 1), first, 0);  // o's first weights in flight across the barrier,
    sync();                                 // not held through the attention (its registers)
    StageX(xs, P.attn, s.q_dim());
    Gemv(P, l, 1, l, 2, xs, A, B, [&](int n, float r0, float) {
      const float v = Rb(__fmul_rn(r0, Scale(L.o_scale, L.scale_per_channel & 2, n)));
      P.resid[n] = __float2bfloat16_rn(__fadd_rn(LoadBf(rin + n), v));
    });
    sync();
    StageNorm(xs, P.resid, L.post_norm, s.hidden, s.eps, red);
    Gemv(P, l, 2, l, 3, xs, A, B, [&](int j, float r0, float r1) {
      const unsigned pc = L.scale_per_channel & 4;
      const float g = Rb(__fmul_rn(r0, Scale(L.gate_up_scale, pc, j)));
      const float u = Rb(__fmul_rn(r1, Scale(L.gate_up_scale, pc, s.ffn + j)));
      P.act[j] = __float2bfloat16_rn(__fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u));
    });
    sync();
    StageX(xs, P.act, s.ffn);
    Gemv(P, l, 3, l + 1, l + 1 < s.layers ? 0 : -1, xs, A, B, [&](int n, float r0, float) {
      const float v = Rb(__fmul_rn(r0, Scale(L.down_scale, L.scale_per_channel & 8, n)));
      P.resid[n] = __float2bfloat16_rn(__fadd_rn(LoadBf(P.resid + n), v));
    });
    sync();
  }
  if (blockIdx.x == 0) {
    const float inv = InvRms(P.resid, s.hidden, s.eps, red);
    const bf16* sc = P.final_norm;
    for (int j = threadIdx.x; j < s.hidden; j += kThreads)
      P.h[j] = __float2bfloat16_rn(__fmul_rn(Rb(__fmul_rn(LoadBf(P.resid + j), inv)), F(sc[j])));
  }
}

size_t AttentionSmem(const step::Shape& s) {
  return sizeof(float) * (static_cast<size_t>(s.group) * kHeadDim + 2 * kHeadDim +
                          static_cast<size_t>(kWarps) * s.group * (kHeadDim + 2));
}

// The kernels by query heads per KV head (Llama 3.x: 3 for 3B, 4 for 1B and 8B, 8 for 70B).
using KernelFn = void (*)(Params);
KernelFn KernelFor(int group) {
  switch (group) {
    case 1: return LlamaStepKernel<1>;
    case 2: return LlamaStepKernel<2>;
    case 3: return LlamaStepKernel<3>;
    case 4: return LlamaStepKernel<4>;
    case 8: return LlamaStepKernel<8>;
    default: return nullptr;
  }
}

// Blocks of the cooperative grid on this device for `smem` bytes each (0: none fit), or the
// CUDA error that stopped the query.
cudaError_t GridBlocks(KernelFn kernel, size_t smem, int* blocks) {
  *blocks = 0;
  int dev = 0, sms = 0, coop = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev);
  if (e == cudaSuccess && smem > 48 * 1024)
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem));
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
  if (e == cudaSuccess && coop) *blocks = per_sm * sms;
  return e;
}

ffi::Error CudaLlamaStepImpl(cudaStream_t stream, int32_t ordinal, ffi::RemainingArgs args,
                             ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::AnyBuffer> cache,
                             ffi::Result<ffi::AnyBuffer> work, int64_t layers, int64_t kv_heads,
                             int64_t group, float eps) {
  step::StepCall call;
  ffi::Error err = step::PlanLlamaStep(args, *h, *cache, *work, layers, kv_heads, group, eps,
                                       &call);
  if (err.failure()) return err;
  err = UseDevice(ordinal);
  if (err.failure()) return err;
  const step::Shape& s = call.shape;
  const size_t smem = std::max(sizeof(float) * static_cast<size_t>(s.max_k()), AttentionSmem(s));
  const KernelFn kernel = KernelFor(s.group);
  if (!kernel)
    return Invalid("llama_step: " + std::to_string(s.group) + " query heads per KV head; the "
                   "kernel is built for 1, 2, 3, 4 and 8");
  int blocks = 0;
  cudaError_t e = GridBlocks(kernel, smem, &blocks);
  if (e != cudaSuccess) return Launched(e);
  if (blocks < 1)
    return Invalid("llama_step: this GPU cannot run the persistent step (no cooperative launch, "
                   "or " + std::to_string(smem) + " bytes of shared memory per block do not fit)");
  if (call.cache != call.cache_in) {  // XLA gave the aliased result a buffer of its own
    e = cudaMemcpyAsync(call.cache, call.cache_in, call.cache_bytes, cudaMemcpyDeviceToDevice,
                        stream);
    if (e != cudaSuccess) return Launched(e);
  }
  e = cudaMemsetAsync(call.work + call.ws.counters, 0, call.ws.counter_bytes, stream);
  if (e != cudaSuccess) return Launched(e);
  auto p = std::make_unique<Params>();
  p->s = s;
  p->score_scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  p->x = reinterpret_cast<const bf16*>(call.x);
  p->rope = call.rope;
  p->pos = call.pos;
  p->final_norm = reinterpret_cast<const bf16*>(call.final_norm);
  p->cache = reinterpret_cast<bf16*>(call.cache);
  p->h = reinterpret_cast<bf16*>(call.h);
  p->counters = reinterpret_cast<unsigned*>(call.work + call.ws.counters);
  p->qkv = reinterpret_cast<bf16*>(call.work + call.ws.qkv);
  p->attn = reinterpret_cast<bf16*>(call.work + call.ws.attn);
  p->act = reinterpret_cast<bf16*>(call.work + call.ws.act);
  p->resid = reinterpret_cast<bf16*>(call.work + call.ws.resid);
  p->part = reinterpret_cast<float*>(call.work + call.ws.part);
  std::copy(call.layers.begin(), call.layers.end(), p->layer);
  void* kargs[] = {p.get()};
  return Launched(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel),
                                              dim3(blocks), dim3(kThreads), kargs, smem, stream));
}

}  // namespace
}  // namespace cuda

void PreloadLlamaStepKernels() {
  cudaFuncAttributes attr;
  for (int g : {1, 2, 3, 4, 8})
    SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, cuda::KernelFor(g)));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaLlamaStep, cuda::CudaLlamaStepImpl,
                              WithLlamaStepOperands(ffi::Ffi::Bind()
                                                        .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                        .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace sifar
