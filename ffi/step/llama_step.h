// The batch-1 decode step of a Llama-family model with FP8 or bf16 weights as ONE op: every layer's
// RMSNorm, qkv, RoPE, KV-cache write, attention, o, residual add, RMSNorm, gate_up, SwiGLU,
// down, residual add, then the final norm. On CUDA it is one cooperative launch (a
// persistent kernel: one grid, grid barriers between the phases, no kernel boundary inside
// the step); on the CPU a reference that runs the same phases in order. The LM head is
// optional: given as the last two operands, the same launch streams it and returns the logits;
// without it the head stays outside (XLA's dot or fp8_matvec on the returned hidden state).
//
// Operands (dtypes checked by PlanLlamaStep):
//   x [H] bf16 (the token's embedding), rope [2, D] f32 (cos, sin at the token's rotary
//   position), pos [2] int32 (the cache slot written, the first slot attended), final_norm
//   [H] bf16, then per layer 10 arrays: input_norm [H], qkv [Nqkv, H] + scale, o [H, Q] +
//   scale, post_norm [H], gate_up [2F, H] (gate rows, then up rows) + scale, down [H, F] +
//   scale, each scale float32 per output channel [N] or per tensor [1]; last the cache [L, 2,
//   1, kv, S, D] bf16 ("bhsd"), updated in place (result 1 aliases it); then, optionally, the
//   LM head [V, H] + its scale (per row [V] or per tensor [1]). Every projection and the head
//   are one weight type, the step's: e4m3 or bf16 (Shape::wbytes).
//   qkv's rows per KV head h: its `group` query heads, then its key, then its value (D rows
//   each, models/attention.py's layout); o's K follows the heads in (kv head, group) order.
// Results: h [H] bf16 = final_norm(residual stream after the last layer), the cache, a
//   workspace (StepWorkspace) whose counters the op zeroes before each launch, and the logits
//   [V] float32 = head x h (in fp8_matvec's order, times the scale, not rounded), [0] without
//   a head. The workspace starts with the status words (StepStatus).
//
// Virtual ranks (attribute ranks = R > 1): the step of a TP=R model whose R ranks are sets of
// blocks of this one launch. Rank r holds KV heads [r kv/R, (r+1) kv/R) (their qkv rows, their
// cache, their columns of o), FFN rows [r F/R, (r+1) F/R) (gate_up's rows, down's columns);
// the operands are the TP=1 model's, each rank reading its slices. o's and down's outputs are
// partial sums, rounded to bf16 as the XLA decoder's per-rank projections are, and all-reduced
// by sifar's rule (rank order 0..R-1 in float32, rounded once: design.md, Reduction order)
// before the residual add. The all-reduce is a phase of the kernel (allreduce_phase.cuh):
// "sifar" (tagged words in dual buffers, read speculatively, no barrier) or "oneshot" (flag
// barriers across the ranks before and after the reads). On the CPU the same sums in loops.
//
// Numerics: the GEMVs are fp8_matvec's (lanes 32, no K split: the same bits as
// sifar_jax.fp8_matvec; bf16 weights in the same order, a 16-byte chunk being 8 weights, not
// 16); activations are rounded to bf16 where the XLA decoder rounds them
// (each projection's output, the residual stream, the norms' scaled values, the roped q and k,
// the attention output, the SwiGLU product); the attention's softmax is a float32 split-K
// (flash-decoding) merge, whose probabilities are not rounded to bf16 (the XLA decoder rounds
// them): the two agree within bf16 rounding, not bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__CUDACC__)
#define SIFAR_STEP_HD __host__ __device__  // the kernel reads the shape too
#else
#define SIFAR_STEP_HD
#endif

namespace sifar {
namespace step {

constexpr int kOperandsPerLayer = 10;
constexpr int kLeadOperands = 4;     // x, rope, pos, final_norm
constexpr int kHeadDim = 128;        // D: the kernel's lanes hold D / 32 dims each
constexpr int kMaxGroup = 8;         // query heads per KV head
constexpr int kMaxSplits = 64;       // key ranges one KV head's attention is split into
constexpr int kMaxLayers = 128;
constexpr int kThreads = 256;
// Every projection's K (and H, F, the heads' width) is a multiple of it: a 16-byte load holds
// 16 e4m3 or 8 bf16 weights (PlanLlamaStep checks it).
constexpr int kChunk = 16;

// One layer's weights (device or host pointers). scale_per_channel bit p: projection p's
// (0 qkv, 1 o, 2 gate_up, 3 down) scale has one value per output row, else one per tensor.
struct LayerWeights {
  const uint16_t* input_norm;
  const uint8_t* qkv;
  const float* qkv_scale;
  const uint8_t* o;
  const float* o_scale;
  const uint16_t* post_norm;
  const uint8_t* gate_up;
  const float* gate_up_scale;
  const uint8_t* down;
  const float* down_scale;
  uint32_t scale_per_channel;
};

constexpr int kMaxRanks = 8;  // virtual ranks
// An all-reduce wait's bound at most: half the kernel's trap bound (device_math.cuh, kWaitNs),
// so that a failed all-reduce ends as NaN and status words, not as a trap elsewhere.
constexpr long long kMaxTimeoutNs = 5ll * 1000 * 1000 * 1000;
// The timeout_ns attribute sifar_jax passes unless told otherwise (llama_step_virtual_ranks).
constexpr long long kDefaultTimeoutNs = 1ll * 1000 * 1000 * 1000;

struct Shape {
  int hidden = 0, kv_heads = 0, group = 0, ffn = 0, layers = 0, capacity = 0, ranks = 1;
  // Across devices (llama_step_tp.h): the ranks of the axis, one per device, this op being one
  // of them (ranks is then 1: kv_heads and ffn are this rank's shard). 1: not across devices.
  int devices = 1;
  int wbytes = 1;  // bytes per weight: 1 e4m3, 2 bf16 (every projection and the head)
  float eps = 1e-5f;
  SIFAR_STEP_HD int qkv_rows() const { return kv_heads * (group + 2) * kHeadDim; }
  SIFAR_STEP_HD int q_dim() const { return kv_heads * group * kHeadDim; }
  int max_k() const;  // the widest projection input (shared memory per block)
};

// The status words at the workspace's start (zeroed by the op): a virtual-rank all-reduce
// that waited past the timeout sets kFailed (1) and where: the phase (k = 1, 2, ...: layer l's
// o is 2l + 1, its down 2l + 2), the rank whose partials (sifar) or arrival (oneshot) it waited
// for, the waiting block; kRetried counts (block, phase) pairs that read a stale word first
// (sifar's mis-speculations, read again).
enum StepStatus {
  kFailed = 0, kFailedPhase, kMissingRank, kFailedBlock, kRetried, kStatusWords = 8
};

// Byte offsets into the workspace (each 256-aligned). Zeroed by the op (the first
// counter_bytes): the status words, the barrier counters (one per rank; then one per rank
// for the arrivals of oneshot's barriers across the ranks), the attention's per-head counts [layers][kv], the all-reduce's tagged words [2][R][H]
// (ranks > 1). Then qkv's output, the attention output, the SwiGLU output, the residual
// stream ([H]; [R][2][H] with ranks; [2][H] across devices), the attention's per-split partials
// [kv][kMaxSplits][group][D + 2] f32. Across devices the tagged words are not here: they live in
// the communicator's workspace (llama_step_tp.h), never zeroed by the op.
struct Workspace {
  size_t status = 0, barriers = 0, heads = 0, ar = 0;
  size_t qkv = 0, attn = 0, act = 0, resid = 0, part = 0, total = 0;
  size_t counter_bytes = 0;
};
Workspace StepWorkspace(const Shape& s);

struct StepCall {
  Shape shape;
  const uint16_t* x = nullptr;
  const float* rope = nullptr;
  const int32_t* pos = nullptr;
  const uint16_t* final_norm = nullptr;
  const uint16_t* cache_in = nullptr;
  uint16_t* cache = nullptr;
  size_t cache_bytes = 0;
  uint16_t* h = nullptr;
  uint8_t* work = nullptr;
  const uint8_t* head = nullptr;  // the LM head [vocab, H] (e4m3 or bf16), or none (vocab 0)
  const float* head_scale = nullptr;
  bool head_per_channel = false;
  int vocab = 0;
  float* logits = nullptr;
  int oneshot = 0;                  // ranks > 1: the all-reduce phase is oneshot, else sifar
  long long timeout_ns = 0;         // an all-reduce wait past it fails the step (NaN, status)
  long long skew_ns = 0;            // tests: each rank sleeps up to this before its partials
  int absent_rank = -1;             // tests: this rank never publishes its partials
  Workspace ws;
  std::vector<LayerWeights> layers;
};

// The op's attributes.
struct StepAttrs {
  int64_t layers, kv_heads, group;
  float eps;
  int64_t ranks, oneshot, timeout_ns, skew_ns, absent_rank;
};

// Checks every operand (dtype, shape, alignment) against the attributes; fills *call. `nargs`:
// the step's operands among args (the first ones; any after them only order the call), all by
// default. `devices`: Shape::devices (ranks across devices; attrs.ranks must then be 1).
xla::ffi::Error PlanLlamaStep(xla::ffi::RemainingArgs args, xla::ffi::AnyBuffer h,
                              xla::ffi::AnyBuffer cache, xla::ffi::AnyBuffer work,
                              xla::ffi::AnyBuffer logits, const StepAttrs& attrs, StepCall* call,
                              size_t nargs = static_cast<size_t>(-1), int devices = 1);

// The CPU reference's all-reduce between devices (llama_step_tp.cc): phase k (layer l's o is
// 2l + 1, its down 2l + 2) gets this rank's partials (bf16 values, [H]) and returns in *sum
// the rank-order float32 sum of every rank's (not rounded), NaN where the phase failed.
class CpuAcross {
 public:
  virtual ~CpuAcross() = default;
  virtual void Reduce(int k, const std::vector<float>& mine, std::vector<float>* sum) = 0;
};

// The CPU reference of a planned step: TP=1, virtual ranks, or (with `across`) this device's
// shard of the step across devices, whose o and down partials `across` all-reduces.
void RunCpuLlamaStep(const StepCall& call, CpuAcross* across = nullptr);

}  // namespace step

template <typename Binding>
auto WithLlamaStepOperands(Binding binding) {
  return std::move(binding)
      .RemainingArgs()  // x, rope, pos, final_norm, 10 per layer, cache[, head, head scale]
      .template Ret<xla::ffi::AnyBuffer>()    // h [H] bf16
      .template Ret<xla::ffi::AnyBuffer>()    // the cache (aliases the cache operand)
      .template Ret<xla::ffi::AnyBuffer>()    // workspace (uint8)
      .template Ret<xla::ffi::AnyBuffer>()    // logits [V] f32 ([0] without a head)
      .template Attr<int64_t>("layers")
      .template Attr<int64_t>("kv_heads")
      .template Attr<int64_t>("group")
      .template Attr<float>("eps")
      .template Attr<int64_t>("ranks")        // virtual ranks (1: TP=1)
      .template Attr<int64_t>("oneshot")      // ranks > 1: 1 oneshot, 0 sifar
      .template Attr<int64_t>("timeout_ns")   // an all-reduce wait's bound
      .template Attr<int64_t>("skew_ns")      // tests: random delay per rank before publishing
      .template Attr<int64_t>("absent_rank");  // tests: a rank that never publishes (-1 none)
}

}  // namespace sifar
