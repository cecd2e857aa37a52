// The Qwen3-MoE step (qwen3_moe_step.h) as one persistent kernel, cuda_llama_step.cu's sibling:
// a cooperative launch of one block per SM, phases separated by grid barriers, 6 per layer:
//   norm + qkv | q/k norm + RoPE + attention | o + residual | norm + router |
//   top-k + the k experts' gate_up + SwiGLU | the k experts' down + weighted sum + residual
// and the final norm (and the head) after the last. The phases are the Llama step's
// (ring_gemv.cuh, norm_phase.cuh, attention_phase.cuh with its kQkNorm path, grid_sync.cuh).
//
// The weight stream and the routing. Each block's producer warp streams the block's rows of
// every projection into the shared-memory ring, in the consumers' order: per layer qkv, o, the
// router, then gate_up of the k chosen experts, then their down. Up to the router it runs ahead
// as in the Llama step (those weights never depend on the activations). The experts' rows do:
// which experts a layer reads is known only once its router phase is done across the grid. So
// after a layer's router rows the producer WAITS for the block's selection of that layer: after
// the grid barrier that ends the router phase, every block's consumers compute the top-k
// themselves from the router logits in the workspace (warp 0; the same bits in every block), put
// the ids in shared memory and then publish the layer's epoch (l + 1) in a shared-memory word
// (a block fence between); the producer, polling that word (bounded, Deadline), then streams
// the chosen experts' rows. Between a layer's router and its first expert rows the ring runs
// dry (a bubble of one grid barrier, the top-k and the first stages' latency per layer), and
// the next layer's qkv cannot be fetched before this layer's experts (one ring, in order). The
// selection record in the workspace (ids, weights per layer) is block 0's.
//
// The down phase: each expert's down rows are a GEMV over its own SwiGLU output (staged in
// shared memory in turn, no grid barrier between the experts); a block's rows n are the same
// items for every expert, so the thread that finishes row n of the last expert sums the k
// outputs it wrote itself (y, workspace) in slot order and adds the residual.
//
// TP = 1, or R virtual ranks (MoeRanksStep: the all-reduce phase after o and after the MoE
// block, as the Llama step's); no step across devices. Run on one H100 (2026-12-07): TP=1
// against the CPU reference; slower than the XLA step so far (docs/performance.md, Open).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

#include "allreduce/launch.h"
#include "allreduce/plan.h"
#include "core/cuda_check.h"
#include "step/allreduce_phase.cuh"
#include "step/attention_phase.cuh"
#include "step/device_math.cuh"
#include "step/grid_sync.cuh"
#include "step/norm_phase.cuh"
#include "step/qwen3_moe_step.h"
#include "step/ring_gemv.cuh"
#include "step/step_launch.cuh"
#include "targets.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sifar {
namespace cuda {
namespace {

using namespace phase;  // NOLINT: the step's phases

struct MoeParams {
  step::Shape s;  // s.ffn: one expert's width I
  int experts, top_k, norm_topk;
  float score_scale;
  const bf16* x;
  const float* rope;
  const int32_t* pos;
  const bf16* final_norm;
  bf16* cache;
  bf16* h;
  unsigned* status;    // step::StepStatus
  unsigned* barriers;  // [ranks] each rank's barrier, then [ranks] oneshot's arrivals
  unsigned* heads;     // [layers][kv] the attention's counts
  uint32_t* ar;        // [2][ranks][H] the all-reduce's tagged words (ranks > 1)
  int oneshot;
  long long timeout_ns;
  bf16* qkv;
  bf16* attn;
  bf16* act;    // [ranks][top_k][I / ranks] the chosen experts' SwiGLU outputs
  bf16* resid;  // [H]; [ranks][2][H] with ranks
  float* part;
  float* router_logits;  // [ranks][E]
  int32_t* sel_ids;      // [layers][top_k] (block 0 writes them)
  float* sel_w;          // [layers][top_k]
  float* y;              // [ranks][top_k][H] the experts' down outputs (bf16 values)
  const uint8_t* head;
  const float* head_scale;
  int head_per_channel, vocab;
  float* logits;
  int stages, xs_bytes;
  step::MoeLayerWeights layer[step::kMaxLayers];
};

// The block's selection: the consumers write ids and weights, then epoch = layer + 1; the
// producer reads ids once epoch says so.
struct Selection {
  int ids[step::kMaxTopK];
  float w[step::kMaxTopK];
  int epoch;
};

constexpr int kFixed = 3;  // qkv, o, router: the projections before a layer's experts

// Projection p of layer l for block b of the g blocks of rank `rank`: 0 qkv, 1 o, 2 the
// router, 3 + i gate_up of slot i, 3 + k + i down of slot i (expert ids: sel), each the rank's
// slice (qkv's rows of its KV heads, o's columns, every expert's FFN rows [rank I/R, ...): its
// gate and up rows, its down columns; the router whole); the head as "layer" s.layers, p 0, on
// every block of the grid.
__device__ __forceinline__ Mat MoeMat(const MoeParams& P, int l, int p, const int* sel, int rank,
                                      int b, int g) {
  const step::Shape& s = P.s;
  const int H = s.hidden, I = s.ffn, wb = s.wbytes, k = P.top_k, R = s.ranks;
  const int qr = s.qkv_rows() / R, kr = s.q_dim() / R, ir = I / R;
  if (l == s.layers)
    return {P.head, P.vocab, H * wb, 1, 0, H * wb, static_cast<int>(blockIdx.x),
            static_cast<int>(gridDim.x)};
  const step::MoeLayerWeights& L = P.layer[l];
  if (p == 0) return {L.qkv + static_cast<size_t>(rank) * qr * H * wb, qr, H * wb, 1, 0, H * wb, b, g};
  if (p == 1) return {L.o + rank * kr * wb, H, kr * wb, 1, 0, s.q_dim() * wb, b, g};
  if (p == 2)
    return {reinterpret_cast<const uint8_t*>(L.router), P.experts, H * 2, 1, 0, H * 2, b, g};
  const int i = (p - kFixed) % k;
  const size_t e = static_cast<size_t>(sel[i]);
  if (p < kFixed + k)
    return {L.gate_up + (e * 2 * I + static_cast<size_t>(rank) * ir) * H * wb, ir, H * wb, 2, I,
            H * wb, b, g};
  return {L.down + e * H * I * wb + rank * ir * wb, H, ir * wb, 1, 0, I * wb, b, g};
}

// The producer warp: layer by layer, qkv, o and the router, then (after the block's selection
// of the layer: Selection::epoch) the chosen experts' gate_up and down; the head last.
__device__ void ProduceMoe(const MoeParams& P, Ring& ring, volatile Selection* sel, int rank,
                           int b, int g) {
  const uint64_t policy = EvictFirst();
  const int lane = threadIdx.x % 32;
  int ids[step::kMaxTopK];
  for (int l = 0; l < P.s.layers; ++l) {
    for (int p = 0; p < kFixed; ++p) ProduceMat(MoeMat(P, l, p, ids, rank, b, g), ring, policy);
    if (lane == 0) {
      Deadline d;
      while (sel->epoch < l + 1) d.Tick();
    }
    __syncwarp();
    __threadfence_block();  // the ids after the epoch (the consumers fenced between them)
    for (int i = 0; i < P.top_k; ++i) ids[i] = sel->ids[i];
    for (int p = kFixed; p < kFixed + 2 * P.top_k; ++p)
      ProduceMat(MoeMat(P, l, p, ids, rank, b, g), ring, policy);
  }
  if (P.vocab > 0) ProduceMat(MoeMat(P, P.s.layers, 0, ids, rank, b, g), ring, policy);
}

// Warp 0 of the consumers: the top-k of the router logits (qwen3_moe_step.h's rule, the CPU's
// SelectExperts in the same order) into sel, then the epoch; block 0 also records it.
__device__ void SelectTopK(const MoeParams& P, int l, volatile Selection* sel, int rank) {
  if (threadIdx.x >= 32) return;
  const float* logits = P.router_logits + static_cast<size_t>(rank) * P.experts;
  constexpr int kPer = step::kMaxExperts / 32;
  const int lane = threadIdx.x, E = P.experts;
  float p[kPer];
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int e = lane + 32 * j;
    p[j] = e < E ? __ldcg(logits + e) : -INFINITY;
    m = fmaxf(m, p[j]);
  }
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (lane + 32 * j < E) {
      p[j] = expf(__fsub_rn(p[j], m));
      sum = __fadd_rn(sum, p[j]);
    }
  }
  sum = __shfl_sync(0xffffffffu, WarpSum(sum), 0);  // lane 0's butterfly, as the CPU's
#pragma unroll
  for (int j = 0; j < kPer; ++j) p[j] = lane + 32 * j < E ? __fdiv_rn(p[j], sum) : -1.0f;
  unsigned taken = 0;
  float total = 0.0f, w[step::kMaxTopK];
  int ids[step::kMaxTopK];
  for (int i = 0; i < P.top_k; ++i) {
    float bv = -2.0f;
    int be = 1 << 30;
#pragma unroll
    for (int j = 0; j < kPer; ++j)  // the lane's experts in increasing order: strictly larger
      if (!(taken >> j & 1u) && p[j] > bv) bv = p[j], be = lane + 32 * j;
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) {  // the largest, ties to the lower expert
      const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
      const int oe = __shfl_xor_sync(0xffffffffu, be, off);
      if (ov > bv || (ov == bv && oe < be)) bv = ov, be = oe;
    }
    if (be >= E) be = i;  // NaN probabilities: some valid expert (the step's output is NaN)
    if (be % 32 == lane) taken |= 1u << (be / 32);
    ids[i] = be;
    w[i] = bv;
    total = __fadd_rn(total, bv);
  }
  if (lane == 0) {
    for (int i = 0; i < P.top_k; ++i) {
      const float wi = Rb(P.norm_topk ? __fdiv_rn(w[i], total) : w[i]);
      sel->ids[i] = ids[i];
      sel->w[i] = wi;
      if (blockIdx.x == 0) {
        P.sel_ids[l * P.top_k + i] = ids[i];
        P.sel_w[l * P.top_k + i] = wi;
      }
    }
    __threadfence_block();  // the ids before the epoch the producer polls
    sel->epoch = l + 1;
  }
}

// The head after the last layer: xs holds the final norm of the stream (every block).
template <bool kB>
__device__ __forceinline__ void MoeHead(const MoeParams& P, Ring& ring, const float4* xs) {
  RingGemv<kB>(
      MoeMat(P, P.s.layers, 0, nullptr, 0, 0, 0), ring, xs,
      [&](int n) { return make_float2(Scale(P.head_scale, P.head_per_channel, n), 0.0f); },
      [&](int n, float r0, float, float2 pre) { P.logits[n] = __fmul_rn(r0, pre.x); });
}

// The MoE block of layer l on rank `rank`'s blocks (b of g; xs: the post-norm stream,
// staged): the router, the top-k, the rank's rows of the chosen experts, their weighted sum,
// handed row by row to finish(n, sum over slots of y_i * w_i in float32, pre's residual value):
// TP=1 adds it to the residual stream, ranks publish it as the rank's partial. sync: the
// rank's barrier; the last one is the caller's (a grid barrier, or the all-reduce phase).
template <bool kB, bool kResid, class Sync, class Finish>
__device__ __forceinline__ void MoeBlock(const MoeParams& P, int l, Ring& ring, float4* xs,
                                         volatile Selection* sel, int rank, int b, int g,
                                         Sync sync, Finish finish) {
  const step::MoeLayerWeights& L = P.layer[l];
  const int H = P.s.hidden, I = P.s.ffn, k = P.top_k, ir = I / P.s.ranks;
  float* logits = P.router_logits + static_cast<size_t>(rank) * P.experts;
  RingGemv<true>(  // the router: bf16 rows, whatever the experts' type
      MoeMat(P, l, 2, nullptr, rank, b, g), ring, xs, [&](int) { return make_float2(1.0f, 0.0f); },
      [&](int e, float r0, float, float2) { logits[e] = Rb(r0); });
  sync();
  SelectTopK(P, l, sel, rank);
  BlockSync();
  int ids[step::kMaxTopK];
  float w[step::kMaxTopK];
  for (int i = 0; i < k; ++i) ids[i] = sel->ids[i], w[i] = sel->w[i];
  bf16* act = P.act + static_cast<size_t>(rank) * k * ir;  // [k][ir]
  float* y = P.y + static_cast<size_t>(rank) * k * H;       // [k][H]
  for (int i = 0; i < k; ++i) {  // gate_up and the SwiGLU of each chosen expert's rows
    const int e = ids[i], j0 = rank * ir;
    RingGemv<kB>(
        MoeMat(P, l, kFixed + i, ids, rank, b, g), ring, xs,
        [&](int j) {
          const int kind = L.gate_up_scale_kind;
          return make_float2(step::ExpertRowScale(L.gate_up_scale, kind, e, 2 * I, j0 + j),
                             step::ExpertRowScale(L.gate_up_scale, kind, e, 2 * I, I + j0 + j));
        },
        [&](int j, float r0, float r1, float2 pre) {
          const float gt = Rb(__fmul_rn(r0, pre.x)), u = Rb(__fmul_rn(r1, pre.y));
          act[i * ir + j] =
              __float2bfloat16_rn(__fmul_rn(__fdiv_rn(gt, __fadd_rn(1.0f, expf(-gt))), u));
        });
  }
  sync();
  // ranks: the all-reduce words read before (phase 2l + 1's) ordered before this phase's
  // partials, which the last expert's epilogue publishes (allreduce_phase.cuh's argument)
  if constexpr (!kResid) FenceAcqRel();
  for (int i = 0; i < k; ++i) {  // down of each, then (last) the weighted sum
    const int e = ids[i];
    const bool last = i + 1 == k;
    BlockSync();  // every warp done with xs
    StageX(xs, act + i * ir, ir);
    RingGemv<kB>(
        MoeMat(P, l, kFixed + k + i, ids, rank, b, g), ring, xs,
        [&](int n) {
          return make_float2(step::ExpertRowScale(L.down_scale, L.down_scale_kind, e, H, n),
                             kResid && last ? LoadBf(P.resid + n) : 0.0f);
        },
        [&](int n, float r0, float, float2 pre) {
          const float yi = Rb(__fmul_rn(r0, pre.x));
          if (!last) {
            y[i * H + n] = yi;  // read back below by this same thread
            return;
          }
          float acc = 0.0f;
          for (int q = 0; q < k; ++q)
            acc = __fadd_rn(acc, __fmul_rn(q + 1 == k ? yi : y[q * H + n], w[q]));
          finish(n, acc, pre.y);
        });
  }
}

// TP=1: grid barriers between the phases, the residual adds in the epilogues of o and of the
// last expert's down.
template <int G, bool kB>
__device__ __forceinline__ void MoeTp1Step(const MoeParams& P, Ring& ring, unsigned char* smem,
                                           float* red, int* flag, volatile Selection* sel,
                                           int pos, int start) {
  float4* xs = reinterpret_cast<float4*>(smem);
  const step::Shape& s = P.s;
  const int b = blockIdx.x, g = gridDim.x;
  unsigned nbar = 0;
  auto sync = [&]() { GridSync(P.barriers, ++nbar * gridDim.x); };
  for (int l = 0; l < s.layers; ++l) {
    const step::MoeLayerWeights& L = P.layer[l];
    const bf16* rin = l == 0 ? P.x : P.resid;
    StageNorm(xs, rin, L.input_norm, s.hidden, s.eps, red);
    RingGemv<kB>(
        MoeMat(P, l, 0, nullptr, 0, b, g), ring, xs,
        [&](int n) { return make_float2(Scale(L.qkv_scale, L.scale_per_channel & 1, n), 0.0f); },
        [&](int n, float r0, float, float2 pre) { P.qkv[n] = __float2bfloat16_rn(__fmul_rn(r0, pre.x)); });
    sync();
    Attention<G, MoeParams, true>(P, l, reinterpret_cast<float*>(smem), flag, pos, start, 0,
                                  s.kv_heads, b, g, L.q_norm, L.k_norm);
    sync();
    StageX(xs, P.attn, s.q_dim());
    RingGemv<kB>(
        MoeMat(P, l, 1, nullptr, 0, b, g), ring, xs,
        [&](int n) {
          return make_float2(Scale(L.o_scale, L.scale_per_channel & 2, n), LoadBf(rin + n));
        },
        [&](int n, float r0, float, float2 pre) {
          P.resid[n] = __float2bfloat16_rn(__fadd_rn(pre.y, Rb(__fmul_rn(r0, pre.x))));
        });
    sync();
    StageNorm(xs, P.resid, L.post_norm, s.hidden, s.eps, red);
    MoeBlock<kB, true>(P, l, ring, xs, sel, 0, b, g, sync, [&](int n, float acc, float old) {
      P.resid[n] = __float2bfloat16_rn(__fadd_rn(old, Rb(acc)));
    });
    sync();
  }
  if (blockIdx.x == 0) {
    const float inv = InvRms(P.resid, s.hidden, s.eps, red);
    for (int j = threadIdx.x; j < s.hidden; j += kThreads)
      P.h[j] = __float2bfloat16_rn(__fmul_rn(Rb(__fmul_rn(LoadBf(P.resid + j), inv)), F(P.final_norm[j])));
  }
  if (P.vocab > 0) {  // the head: every block norms the residual stream itself (no barrier)
    StageNorm(xs, P.resid, reinterpret_cast<const uint16_t*>(P.final_norm), s.hidden, s.eps, red);
    MoeHead<kB>(P, ring, xs);
  }
}

// Virtual ranks: this block is block b of rank `rank`'s nb. Barriers of the rank's blocks
// after qkv, the attention, the router and gate_up; after o and after the MoE block the
// all-reduce phase (allreduce_phase.cuh: phase 2l + 1 and 2l + 2, as the Llama step's), which
// adds the residual and stages the next norm (the last: the final norm, h and the head's input).
template <int G, bool kB>
__device__ __forceinline__ void MoeRanksStep(const MoeParams& P, Ring& ring, unsigned char* smem,
                                             float* red, int* flag, volatile Selection* sel,
                                             int pos, int start, int rank, int b, int nb) {
  float4* xs = reinterpret_cast<float4*>(smem);
  const step::Shape& s = P.s;
  const int R = s.ranks, H = s.hidden;
  const int qr = s.qkv_rows() / R, kr = s.q_dim() / R;
  const ArCtx a{P.ar, P.status, P.barriers + R, R, rank, nb, H, P.oneshot, -1, P.timeout_ns, 0};
  unsigned nbar = 0;
  auto sync = [&]() { GridSync(P.barriers + rank, ++nbar * nb); };
  bf16* resid = P.resid + static_cast<size_t>(rank) * 2 * H;  // [2][H], phase k writes k & 1
  const int qlo = b * (H / 4) / nb, qhi = (b + 1) * (H / 4) / nb;
  unsigned k = 0;  // all-reduce phases so far
  StageNorm(xs, P.x, P.layer[0].input_norm, H, s.eps, red);
  for (int l = 0; l < s.layers; ++l) {
    const step::MoeLayerWeights& L = P.layer[l];
    RingGemv<kB>(
        MoeMat(P, l, 0, nullptr, rank, b, nb), ring, xs,
        [&](int n) {
          return make_float2(Scale(L.qkv_scale, L.scale_per_channel & 1, rank * qr + n), 0.0f);
        },
        [&](int n, float r0, float, float2 pre) {
          P.qkv[rank * qr + n] = __float2bfloat16_rn(__fmul_rn(r0, pre.x));
        });
    sync();
    Attention<G, MoeParams, true>(P, l, reinterpret_cast<float*>(smem), flag, pos, start,
                                  rank * (s.kv_heads / R), s.kv_heads / R, b, nb, L.q_norm,
                                  L.k_norm);
    sync();
    StageX(xs, P.attn + rank * kr, kr);
    ++k;
    FenceAcqRel();  // the words read before (the previous phases) ordered before these
    RingGemv<kB>(
        MoeMat(P, l, 1, nullptr, rank, b, nb), ring, xs,
        [&](int n) { return make_float2(Scale(L.o_scale, L.scale_per_channel & 2, n), 0.0f); },
        [&](int n, float r0, float, float2 pre) { ArPut(a, k, n, __fmul_rn(r0, pre.x)); });
    ArReduce(a, k, k == 1 ? P.x : resid + ((k - 1) & 1) * H, resid + (k & 1) * H, qlo, qhi,
             L.post_norm, s.eps, xs, red, nullptr);
    ++k;
    MoeBlock<kB, false>(P, l, ring, xs, sel, rank, b, nb, sync,
                        [&](int n, float acc, float) { ArPut(a, k, n, acc); });
    const bool last = l + 1 == s.layers;
    ArReduce(a, k, resid + ((k - 1) & 1) * H, last ? nullptr : resid + (k & 1) * H, qlo, qhi,
             last ? reinterpret_cast<const uint16_t*>(P.final_norm) : P.layer[l + 1].input_norm,
             s.eps, xs, red, last && blockIdx.x == 0 ? P.h : nullptr);
  }
  if (P.vocab > 0) MoeHead<kB>(P, ring, xs);
}

template <int G, bool kB, bool kV>
__global__ void __launch_bounds__(kBlockThreads, 1) Qwen3MoeStepKernel(const __grid_constant__ MoeParams P) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float red[kWarps];
  __shared__ int flag;
  __shared__ Selection sel_mem;
  volatile Selection* sel = &sel_mem;
  const step::Shape& s = P.s;
  const int pos = P.pos[0], start = P.pos[1];
  if (pos < 0 || pos >= s.capacity || start < 0 || start > pos) {  // NaN, every block alike
    if (blockIdx.x == 0 && threadIdx.x < kThreads)
      for (int j = threadIdx.x; j < s.hidden; j += kThreads) P.h[j] = __float2bfloat16_rn(NAN);
    if (threadIdx.x < kThreads)
      for (int j = blockIdx.x * kThreads + threadIdx.x; j < P.vocab; j += gridDim.x * kThreads)
        P.logits[j] = NAN;
    return;
  }
  unsigned char* ring_buf = smem + P.xs_bytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(ring_buf + static_cast<size_t>(P.stages) * kStageBytes);
  Ring ring{ring_buf, bars, bars + P.stages, P.stages, 0};
  if (threadIdx.x == 0) {
    RingInit(ring);
    sel->epoch = 0;
  }
  __syncthreads();  // the last barrier of all kBlockThreads threads
  const int nb = kV ? static_cast<int>(gridDim.x) / s.ranks : static_cast<int>(gridDim.x);
  const int rank = kV ? static_cast<int>(blockIdx.x) / nb : 0;
  const int b = static_cast<int>(blockIdx.x) - rank * nb;
  if (threadIdx.x >= kThreads) return ProduceMoe(P, ring, sel, rank, b, nb);
  if constexpr (kV) MoeRanksStep<G, kB>(P, ring, smem, red, &flag, sel, pos, start, rank, b, nb);
  else MoeTp1Step<G, kB>(P, ring, smem, red, &flag, sel, pos, start);
}

using MoeKernelFn = void (*)(MoeParams);
template <bool kB, bool kV>
MoeKernelFn MoeKernelOf(int group) {
  switch (group) {
    case 1: return Qwen3MoeStepKernel<1, kB, kV>;
    case 2: return Qwen3MoeStepKernel<2, kB, kV>;
    case 3: return Qwen3MoeStepKernel<3, kB, kV>;
    case 4: return Qwen3MoeStepKernel<4, kB, kV>;
    case 8: return Qwen3MoeStepKernel<8, kB, kV>;
    default: return nullptr;
  }
}
MoeKernelFn MoeKernelFor(int group, int wbytes, int ranks) {
  if (ranks > 1) return wbytes == 2 ? MoeKernelOf<true, true>(group) : MoeKernelOf<false, true>(group);
  return wbytes == 2 ? MoeKernelOf<true, false>(group) : MoeKernelOf<false, false>(group);
}

ffi::Error LaunchMoeStep(cudaStream_t stream, const step::MoeCall& call) {
  const step::Shape& s = call.shape.s;
  const MoeKernelFn kernel = MoeKernelFor(s.group, s.wbytes, s.ranks);
  if (!kernel)
    return Invalid("qwen3_moe_step: " + std::to_string(s.group) + " query heads per KV head; "
                   "the kernel is built for 1, 2, 3, 4 and 8");
  Smem sm;
  int blocks = 0;
  cudaError_t e = GridBlocks(kernel, s, &sm, &blocks);
  if (e != cudaSuccess) return Launched(e);
  const int cap = StepMaxBlocks();
  if (cap > 0 && blocks > cap) blocks = std::max(cap, s.ranks);
  blocks = blocks / s.ranks * s.ranks;  // virtual ranks: equal sets of blocks
  if (blocks < 1)
    return Invalid("qwen3_moe_step: this GPU cannot run the persistent step (no cooperative "
                   "launch, or no room for its input (" + std::to_string(sm.xs) + " bytes) and "
                   "two " + std::to_string(kStageBytes) + "-byte weight stages in one block's "
                   "shared memory)");
  if (call.cache != call.cache_in) {
    e = cudaMemcpyAsync(call.cache, call.cache_in, call.cache_bytes, cudaMemcpyDeviceToDevice,
                        stream);
    if (e != cudaSuccess) return Launched(e);
  }
  const step::MoeWorkspace& ws = call.ws;
  e = cudaMemsetAsync(call.work, 0, ws.base.counter_bytes, stream);  // status, counters
  if (e != cudaSuccess) return Launched(e);
  auto p = std::make_unique<MoeParams>();
  p->s = s;
  p->experts = call.shape.experts;
  p->top_k = call.shape.top_k;
  p->norm_topk = call.shape.norm_topk;
  p->score_scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  p->x = reinterpret_cast<const bf16*>(call.x);
  p->rope = call.rope;
  p->pos = call.pos;
  p->final_norm = reinterpret_cast<const bf16*>(call.final_norm);
  p->cache = reinterpret_cast<bf16*>(call.cache);
  p->h = reinterpret_cast<bf16*>(call.h);
  p->status = reinterpret_cast<unsigned*>(call.work + ws.base.status);
  p->barriers = reinterpret_cast<unsigned*>(call.work + ws.base.barriers);
  p->ar = reinterpret_cast<uint32_t*>(call.work + ws.base.ar);
  p->oneshot = call.oneshot;
  p->timeout_ns = call.timeout_ns;
  p->heads = reinterpret_cast<unsigned*>(call.work + ws.base.heads);
  p->qkv = reinterpret_cast<bf16*>(call.work + ws.base.qkv);
  p->attn = reinterpret_cast<bf16*>(call.work + ws.base.attn);
  p->act = reinterpret_cast<bf16*>(call.work + ws.base.act);
  p->resid = reinterpret_cast<bf16*>(call.work + ws.base.resid);
  p->part = reinterpret_cast<float*>(call.work + ws.base.part);
  p->router_logits = reinterpret_cast<float*>(call.work + ws.logits);
  p->sel_ids = reinterpret_cast<int32_t*>(call.work + ws.sel);
  p->sel_w = reinterpret_cast<float*>(p->sel_ids + static_cast<size_t>(s.layers) * p->top_k);
  p->y = reinterpret_cast<float*>(call.work + ws.y);
  p->head = call.head;
  p->head_scale = call.head_scale;
  p->head_per_channel = call.head_per_channel;
  p->vocab = call.vocab;
  p->logits = call.logits;
  p->stages = sm.stages;
  p->xs_bytes = static_cast<int>(sm.xs);
  std::copy(call.layers.begin(), call.layers.end(), p->layer);
  void* kargs[] = {p.get()};
  return Launched(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel), dim3(blocks),
                                              dim3(kBlockThreads), kargs, sm.total, stream));
}

ffi::Error CudaQwen3MoeStepImpl(cudaStream_t stream, int32_t ordinal, ffi::RemainingArgs args,
                                ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::AnyBuffer> cache,
                                ffi::Result<ffi::AnyBuffer> work,
                                ffi::Result<ffi::AnyBuffer> logits, int64_t layers,
                                int64_t kv_heads, int64_t group, int64_t top_k,
                                int64_t norm_topk_prob, float eps, int64_t ranks,
                                int64_t oneshot, int64_t timeout_ns) {
  step::MoeCall call;
  const step::MoeAttrs attrs{layers, kv_heads, group, top_k, norm_topk_prob, eps,
                             ranks,  oneshot,  timeout_ns};
  ffi::Error err = step::PlanQwen3MoeStep(args, *h, *cache, *work, *logits, attrs, &call);
  if (err.failure()) return err;
  err = UseDevice(ordinal);
  if (err.failure()) return err;
  return LaunchMoeStep(stream, call);
}

}  // namespace
}  // namespace cuda

void PreloadQwen3MoeStepKernels() {
  cudaFuncAttributes attr;
  for (int g : {1, 2, 3, 4, 8})
    for (int wbytes : {1, 2})
      for (int ranks : {1, 2})
        SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, cuda::MoeKernelFor(g, wbytes, ranks)));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaQwen3MoeStep, cuda::CudaQwen3MoeStepImpl,
                              WithQwen3MoeStepOperands(ffi::Ffi::Bind()
                                                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                           .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace sifar
