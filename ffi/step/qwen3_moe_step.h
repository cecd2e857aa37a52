// The batch-1 decode step of a Qwen3-MoE model with FP8 or bf16 weights as ONE op: every
// layer's RMSNorm, qkv, per-head q and k RMSNorm, RoPE, KV-cache write, attention, o, residual
// add, RMSNorm, router, top-k, the chosen experts' gate_up, SwiGLU and down, their
// routing-weighted sum, residual add, then the final norm and optionally the LM head. On CUDA one
// cooperative launch of a persistent kernel (cuda_qwen3_moe_step.cu), on the CPU a reference
// of the same phases (qwen3_moe_step.cc). The Llama step's sibling (llama_step.h): the same
// attention, norms, GEMV order, cache layout and workspace head; what differs is written here.
//
// Operands (dtypes checked by PlanQwen3MoeStep): x [H] bf16, rope [2, D] f32, pos [2] int32
// (the slot written, the first slot attended), final_norm [H] bf16, then per layer 13 arrays:
//   0 input_norm [H] bf16      1 qkv [Nqkv, H]      2 its scale [Nqkv] or [1]
//   3 q_norm [D] bf16          4 k_norm [D] bf16    (Qwen3's per-head RMSNorm scales)
//   5 o [H, Q]                 6 its scale [H] or [1]
//   7 post_norm [H] bf16       8 router [E, H] bf16 (always bf16: the model keeps it dense)
//   9 gate_up [E, 2I, H] (per expert its I gate rows, then its I up rows)
//  10 its scale: [E * 2I] per channel, [E] per expert or [1] per tensor
//  11 down [E, H, I]          12 its scale: [E * H], [E] or [1]
// then the cache [L, 2, 1, kv, S, D] bf16 (bhsd), updated in place (result 1 aliases it), then
// optionally the LM head [V, H] + its scale ([V] or [1]). qkv, o, the experts and the head are
// one weight type, the step's: e4m3 or bf16. qkv's rows and o's columns as llama_step.h's.
// Attributes: layers, kv_heads, group, top_k, norm_topk_prob (0 or 1), eps (every RMSNorm's).
// Results: h [H] bf16 (final_norm of the residual stream), the cache, the workspace
// (Qwen3MoeWorkspace: its `sel` words hold each layer's chosen experts and their weights after
// the step: [layers][top_k] int32 ids, then [layers][top_k] float32 weights), the logits [V] f32
// ([0] without a head).
//
// Numerics (besides llama_step.h's, which hold here too):
//   - q and k heads: RMSNorm over the head's 128 values (the sum of squares one warp's: lane l's
//     quad in order, fma; the butterfly), bf16(bf16(v * inv) * scale), before the RoPE.
//   - router: logits[e] = bf16(router row e . x) (bf16 weights, fp8_matvec's order), as the XLA
//     step's x @ router in bf16; probs = softmax in float32: m = max, the exps' sum in the
//     kernel's warp order (lane l adds experts l, l + 32, ... in order, then the butterfly),
//     p[e] = exp(logit - m) / sum (the platform's exp: CPU and GPU may differ by an ulp).
//   - top-k: the k largest probabilities, ties to the LOWER expert index (jax.lax.top_k's
//     order), slot i the i-th largest; weights w_i = p_i / (p_0 + ... + p_{k-1}) (the sum in
//     slot order) with norm_topk_prob, else p_i; then rounded to bf16 (the XLA step casts the
//     weights to the activations' dtype).
//   - expert i: act = bf16(silu(g) * u) of bf16(gate_up rows . xm), y_i = bf16(down . act);
//     moe = bf16(sum over slots in order of y_i * w_i, float32), resid = bf16(resid + moe).
// Virtual ranks (attribute ranks = R > 1; on CUDA R equal sets of blocks of the one launch
// with llama_step's all-reduce phase between them): the step of a TP=R model as llama_step.h's, rank r holding KV heads
// [r kv/R, (r+1) kv/R) and every expert's FFN rows [r I/R, (r+1) I/R) (gate_up's rows, down's
// columns); every rank routes itself (the router is replicated: the same bits, the same experts).
// o's and the MoE block's outputs are partial sums: o's rounded to bf16; the MoE's
// bf16(sum over slots of bf16(rank's down rows . act) * w_i), as the XLA decoder's per-rank
// experts; then all-reduced by sifar's rule (rank order in float32, rounded once) before the
// residual add. The step across devices is not implemented for this op.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "step/llama_step.h"
#include "xla/ffi/api/ffi.h"

namespace sifar {
namespace step {

constexpr int kMoeOperandsPerLayer = 13;
constexpr int kMaxExperts = 256;  // the kernel's warp holds E / 32 router logits per lane
constexpr int kMaxTopK = 8;

// An expert stack's scale: one per row of every expert, one per expert, or one.
enum ExpertScale { kPerTensor = 0, kPerExpert = 1, kPerChannel = 2 };

struct MoeLayerWeights {
  const uint16_t* input_norm;
  const uint8_t* qkv;
  const float* qkv_scale;
  const uint16_t* q_norm;
  const uint16_t* k_norm;
  const uint8_t* o;
  const float* o_scale;
  const uint16_t* post_norm;
  const uint16_t* router;  // [E, H] bf16
  const uint8_t* gate_up;  // [E, 2I, H]
  const float* gate_up_scale;
  const uint8_t* down;     // [E, H, I]
  const float* down_scale;
  uint32_t scale_per_channel;  // bit 0 qkv, bit 1 o (as LayerWeights')
  int gate_up_scale_kind, down_scale_kind;  // ExpertScale
};

// The scale of row `row` of expert e's n rows.
SIFAR_STEP_HD inline float ExpertRowScale(const float* s, int kind, int e, int n, int row) {
  return kind == kPerChannel ? s[static_cast<size_t>(e) * n + row] : kind == kPerExpert ? s[e] : s[0];
}

struct MoeShape {
  Shape s;  // s.ffn: one expert's width I
  int experts = 0, top_k = 0, norm_topk = 1;
};

// The workspace: the Llama step's (StepWorkspace of the shape with ffn = top_k * I: its act
// holds the k experts' SwiGLU outputs, [R][top_k][I / R]; with ranks its all-reduce words and
// residual streams) followed by the router's logits [R][E] f32, the selection record `sel`
// ([layers][top_k] int32 ids, then [layers][top_k] f32 weights: rank 0's), and the experts' down
// outputs y [R][top_k][H] f32 (bf16 values).
struct MoeWorkspace {
  Workspace base;
  size_t logits = 0, sel = 0, y = 0, total = 0;
};
MoeWorkspace Qwen3MoeWorkspace(const MoeShape& m);

struct MoeCall {
  MoeShape shape;
  const uint16_t* x = nullptr;
  const float* rope = nullptr;
  const int32_t* pos = nullptr;
  const uint16_t* final_norm = nullptr;
  const uint16_t* cache_in = nullptr;
  uint16_t* cache = nullptr;
  size_t cache_bytes = 0;
  uint16_t* h = nullptr;
  uint8_t* work = nullptr;
  const uint8_t* head = nullptr;
  const float* head_scale = nullptr;
  bool head_per_channel = false;
  int vocab = 0;
  float* logits = nullptr;
  int oneshot = 0;
  long long timeout_ns = 0;
  MoeWorkspace ws;
  std::vector<MoeLayerWeights> layers;
};

struct MoeAttrs {
  int64_t layers, kv_heads, group, top_k, norm_topk_prob;
  float eps;
  int64_t ranks, oneshot, timeout_ns;  // virtual ranks (1: TP=1), llama_step.h's meanings
};

// Checks every operand (dtype, shape, alignment) against the attributes; fills *call.
xla::ffi::Error PlanQwen3MoeStep(xla::ffi::RemainingArgs args, xla::ffi::AnyBuffer h,
                                 xla::ffi::AnyBuffer cache, xla::ffi::AnyBuffer work,
                                 xla::ffi::AnyBuffer logits, const MoeAttrs& attrs,
                                 MoeCall* call);

// The top-k of router logits (bf16 values as floats) by the rule above: ids[top_k] and their
// weights (rounded to bf16). The CPU reference's; the kernel computes the same in a warp.
void SelectExperts(const float* logits, int experts, int top_k, bool norm_topk, int* ids,
                   float* weights);

void RunCpuQwen3MoeStep(const MoeCall& call);

}  // namespace step

template <typename Binding>
auto WithQwen3MoeStepOperands(Binding binding) {
  return std::move(binding)
      .RemainingArgs()  // x, rope, pos, final_norm, 13 per layer, cache[, head, head scale]
      .template Ret<xla::ffi::AnyBuffer>()    // h [H] bf16
      .template Ret<xla::ffi::AnyBuffer>()    // the cache (aliases the cache operand)
      .template Ret<xla::ffi::AnyBuffer>()    // workspace (uint8)
      .template Ret<xla::ffi::AnyBuffer>()    // logits [V] f32 ([0] without a head)
      .template Attr<int64_t>("layers")
      .template Attr<int64_t>("kv_heads")
      .template Attr<int64_t>("group")
      .template Attr<int64_t>("top_k")
      .template Attr<int64_t>("norm_topk_prob")
      .template Attr<float>("eps")
      .template Attr<int64_t>("ranks")        // virtual ranks (1: TP=1)
      .template Attr<int64_t>("oneshot")      // ranks > 1: 1 oneshot, 0 sifar (the kernel's)
      .template Attr<int64_t>("timeout_ns");  // an all-reduce wait's bound (the kernel's)
}

}  // namespace sifar
