// The Llama step's checks (PlanLlamaStep: both backends run them), its workspace layout and
// its CPU backend: the phases of llama_step.h in plain loops, each GEMV in fp8_matvec's
// summation order (the CUDA kernel's bits, e4m3 or bf16 weights), each norm's sum of squares
// in the kernel's block order; the attention in one pass per head (the kernel splits it: not
// the same bits).
#include "step/llama_step.h"
#include "step/step_common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "allreduce/plan.h"
#include "core/cpu_numbers.h"
#include "targets.h"

namespace ffi = xla::ffi;

namespace sifar {
namespace step {

int Shape::max_k() const { return std::max(std::max(hidden, q_dim()), ffn); }

Workspace StepWorkspace(const Shape& s) {
  auto up = [](size_t v) { return (v + 255) / 256 * 256; };
  const size_t R = static_cast<size_t>(s.ranks), H = static_cast<size_t>(s.hidden);
  Workspace w;
  w.status = 0;
  w.barriers = up(4 * kStatusWords);
  w.heads = w.barriers + up(4 * 2 * R);
  w.ar = w.heads + up(4 * static_cast<size_t>(s.layers) * s.kv_heads);
  w.counter_bytes = w.ar + (R > 1 ? up(4 * 2 * R * H) : 0);
  w.qkv = w.counter_bytes;
  w.attn = w.qkv + up(2 * static_cast<size_t>(s.qkv_rows()));
  w.act = w.attn + up(2 * static_cast<size_t>(s.q_dim()));
  w.resid = w.act + up(2 * static_cast<size_t>(s.ffn));
  w.part = w.resid + up(2 * (R > 1 ? 2 * R * H : s.devices > 1 ? 2 * H : H));
  w.total = w.part + up(4 * static_cast<size_t>(s.kv_heads) * kMaxSplits * s.group *
                        (kHeadDim + 2));
  return w;
}


namespace {
const char* kProjNames[4] = {"qkv", "o", "gate_up", "down"};
}  // namespace

ffi::Error PlanLlamaStep(ffi::RemainingArgs args, ffi::AnyBuffer h, ffi::AnyBuffer cache,
                         ffi::AnyBuffer work, ffi::AnyBuffer logits, const StepAttrs& attrs,
                         StepCall* call, size_t nargs, int devices) {
  const std::string name = "llama_step: ";
  nargs = std::min(nargs, args.size());
  if (devices < 1 || devices > kMaxRanks || (devices > 1 && attrs.ranks != 1))
    return Invalid(name + "devices must be in [1, " + std::to_string(kMaxRanks) +
                   "], and virtual ranks 1 across devices");
  const int64_t layers = attrs.layers, kv_heads = attrs.kv_heads, group = attrs.group;
  const float eps = attrs.eps;
  const int64_t ranks = attrs.ranks;
  if (ranks < 1 || ranks > kMaxRanks)
    return Invalid(name + "ranks must be in [1, " + std::to_string(kMaxRanks) + "], got " +
                   std::to_string(ranks));
  if (kv_heads % ranks)
    return Invalid(name + std::to_string(kv_heads) + " KV heads do not split over " +
                   std::to_string(ranks) + " ranks");
  if (attrs.timeout_ns < 1 || attrs.timeout_ns > kMaxTimeoutNs || attrs.skew_ns < 0 ||
      attrs.skew_ns > kMaxTimeoutNs || attrs.absent_rank < -1 ||
      attrs.absent_rank >= ranks || (attrs.oneshot != 0 && attrs.oneshot != 1))
    return Invalid(name + "timeout_ns in [1, " + std::to_string(kMaxTimeoutNs) +
                   "], skew_ns in [0, the same], absent_rank in [-1, ranks) and oneshot 0 or 1 "
                   "needed");
  if (layers < 1 || layers > kMaxLayers)
    return Invalid(name + "layers must be in [1, " + std::to_string(kMaxLayers) + "], got " +
                   std::to_string(layers));
  if (kv_heads < 1 || group < 1 || group > kMaxGroup)
    return Invalid(name + "kv_heads >= 1 and group in [1, " + std::to_string(kMaxGroup) +
                   "] needed, got " + std::to_string(kv_heads) + ", " + std::to_string(group));
  const size_t want = kLeadOperands + kOperandsPerLayer * layers + 1;
  if (nargs != want && nargs != want + 2)
    return Invalid(name + "expected " + std::to_string(want) + " operands for " +
                   std::to_string(layers) + " layers (" + std::to_string(want + 2) +
                   " with the head), got " + std::to_string(nargs));
  auto arg = [&](size_t i) { return args.get<ffi::AnyBuffer>(i).value(); };
  ffi::AnyBuffer x = arg(0), rope = arg(1), pos = arg(2), fnorm = arg(3);
  ffi::AnyBuffer cache_in = arg(want - 1);
  StepCall& c = *call;
  Shape& s = c.shape;
  ffi::Error err = PlanLead(name, x, rope, pos, fnorm, &s.hidden);
  if (err.failure()) return err;
  s.kv_heads = static_cast<int>(kv_heads);
  s.group = static_cast<int>(group);
  s.layers = static_cast<int>(layers);
  s.ranks = static_cast<int>(ranks);
  s.devices = devices;
  s.eps = eps;
  // The FFN width from the first gate_up.
  ffi::AnyBuffer gu0 = arg(kLeadOperands + 6);
  if (gu0.dimensions().size() != 2)
    return Invalid(name + "gate_up must be [2F, H], got " + Dims(gu0));
  s.ffn = static_cast<int>(gu0.dimensions()[0] / 2);
  if (s.ffn % kChunk || s.q_dim() % kChunk)
    return Invalid(name + "F and the heads' width must be multiples of " + std::to_string(kChunk));
  if (s.ffn % (kChunk * s.ranks))
    return Invalid(name + "F=" + std::to_string(s.ffn) + " must split over " +
                   std::to_string(s.ranks) + " ranks in multiples of " + std::to_string(kChunk));
  s.wbytes = WeightBytes(arg(kLeadOperands + 1).element_type());
  if (s.wbytes == 0)
    return Invalid(name + "layer 0 qkv must be float8_e4m3fn or bfloat16 (the step's weight "
                   "type), got another dtype");
  const std::string wname = WeightName(s.wbytes);
  const int64_t ns[4] = {s.qkv_rows(), s.hidden, 2 * static_cast<int64_t>(s.ffn), s.hidden};
  const int64_t ks[4] = {s.hidden, s.q_dim(), s.hidden, s.ffn};
  c.layers.resize(layers);
  for (int64_t l = 0; l < layers; ++l) {
    const size_t b = kLeadOperands + kOperandsPerLayer * l;
    LayerWeights& L = c.layers[l];
    const std::string at = name + "layer " + std::to_string(l) + " ";
    ffi::AnyBuffer in_norm = arg(b), post_norm = arg(b + 5);
    for (ffi::AnyBuffer nb : {in_norm, post_norm})
      if (nb.element_type() != ffi::DataType::BF16 || !HasDims(nb, {s.hidden}))
        return Invalid(at + "norm scales must be bf16 [H], got " + Dims(nb));
    L.input_norm = static_cast<const uint16_t*>(in_norm.untyped_data());
    L.post_norm = static_cast<const uint16_t*>(post_norm.untyped_data());
    const size_t wi[4] = {b + 1, b + 3, b + 6, b + 8};
    const uint8_t** wp[4] = {&L.qkv, &L.o, &L.gate_up, &L.down};
    const float** sp[4] = {&L.qkv_scale, &L.o_scale, &L.gate_up_scale, &L.down_scale};
    L.scale_per_channel = 0;
    for (int p = 0; p < 4; ++p) {
      ffi::AnyBuffer w = arg(wi[p]), sc = arg(wi[p] + 1);
      if (WeightBytes(w.element_type()) != s.wbytes || !HasDims(w, {ns[p], ks[p]}))
        return Invalid(at + kProjNames[p] + " must be " + wname + " [" + std::to_string(ns[p]) +
                       ", " + std::to_string(ks[p]) + "] (layer 0 qkv's weight type), got " +
                       Dims(w) + (WeightBytes(w.element_type()) != s.wbytes ? " of another dtype" : ""));
      if (sc.element_type() != ffi::DataType::F32 ||
          (sc.element_count() != 1 && sc.element_count() != ns[p]))
        return Invalid(at + kProjNames[p] + "'s scale must be float32 with 1 (per tensor) or " +
                       std::to_string(ns[p]) + " (per channel) values, got " + Dims(sc));
      if (reinterpret_cast<uintptr_t>(w.untyped_data()) % 16)
        return Invalid(at + kProjNames[p] + " must be 16-byte aligned");
      *wp[p] = static_cast<const uint8_t*>(w.untyped_data());
      *sp[p] = static_cast<const float*>(sc.untyped_data());
      if (sc.element_count() == ns[p] && ns[p] > 1) L.scale_per_channel |= 1u << p;
    }
  }
  const bool has_head = nargs == want + 2;
  const ffi::AnyBuffer hw = arg(has_head ? want : 0), hs = arg(has_head ? want + 1 : 0);
  StepTail t;
  err = PlanTail(name, cache_in, cache, h, has_head ? &hw : nullptr, has_head ? &hs : nullptr,
                 logits, layers, kv_heads, s.hidden, s.wbytes, &t);
  if (err.failure()) return err;
  s.capacity = t.capacity;
  c.vocab = t.vocab;
  c.head = t.head;
  c.head_scale = t.head_scale;
  c.head_per_channel = t.head_per_channel;
  c.logits = t.logits;
  c.oneshot = static_cast<int>(attrs.oneshot);
  c.timeout_ns = attrs.timeout_ns;
  c.skew_ns = attrs.skew_ns;
  c.absent_rank = static_cast<int>(attrs.absent_rank);
  c.ws = StepWorkspace(s);
  if (work.size_bytes() != c.ws.total)
    return Invalid(name + "the workspace must be " + std::to_string(c.ws.total) + " bytes, got " +
                   std::to_string(work.size_bytes()));
  c.x = static_cast<const uint16_t*>(x.untyped_data());
  c.rope = static_cast<const float*>(rope.untyped_data());
  c.pos = static_cast<const int32_t*>(pos.untyped_data());
  c.final_norm = static_cast<const uint16_t*>(fnorm.untyped_data());
  c.cache_in = static_cast<const uint16_t*>(cache_in.untyped_data());
  c.cache = static_cast<uint16_t*>(cache.untyped_data());
  c.cache_bytes = cache.size_bytes();
  c.h = static_cast<uint16_t*>(h.untyped_data());
  c.work = static_cast<uint8_t*>(work.untyped_data());
  return ffi::Error::Success();
}

}  // namespace step

namespace {

using cpu::Bf16ToF32;
using cpu::F32ToBf16;
using step::kHeadDim;
using step::Gemv;
using step::Norm;
using step::Rb;
using step::Row;

// resid += w [H, K] x in, as TP=R ranks compute it: rank r's partial (columns [r K/R,
// (r+1) K/R)) rounded to bf16, the partials added in rank order in float32 and rounded once
// (sifar's rule), then the residual add. A rank that never publishes (absent) leaves NaN.
// At R = 1 the TP=1 step's bf16(resid + bf16(w x)). With `across` (phase k of the step across
// devices) this rank's partial of its columns (all K of them: its shard), all-reduced by it.
void ReduceAdd(const step::StepCall& c, const uint8_t* w, const float* sc, bool per_channel,
               int K, const std::vector<float>& in, std::vector<float>& resid,
               step::CpuAcross* across, int k) {
  const int H = c.shape.hidden, R = c.shape.ranks, Kr = K / R, wb = c.shape.wbytes;
  std::vector<float> acc(H);
  if (across) {
    std::vector<float> mine(H);
    for (int j = 0; j < H; ++j)
      mine[j] = Rb(Row(w + static_cast<size_t>(j) * K * wb, K, in.data(),
                       per_channel ? sc[j] : sc[0], wb));
    across->Reduce(k, mine, &acc);
    for (int j = 0; j < H; ++j) resid[j] = Rb(resid[j] + Rb(acc[j]));
    return;
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < H; ++j) {
      const float p = r == c.absent_rank
                          ? NAN
                          : Rb(Row(w + (static_cast<size_t>(j) * K + r * Kr) * wb, Kr,
                                   in.data() + r * Kr, per_channel ? sc[j] : sc[0], wb));
      acc[j] = r == 0 ? p : acc[j] + p;
    }
  for (int j = 0; j < H; ++j) resid[j] = Rb(resid[j] + Rb(acc[j]));
}

}  // namespace

void step::RunCpuLlamaStep(const step::StepCall& c, step::CpuAcross* across) {
  const step::Shape& s = c.shape;
  const int H = s.hidden, D = kHeadDim, G = s.group, KV = s.kv_heads, F = s.ffn, S = s.capacity;
  const int pos = c.pos[0], start = c.pos[1];
  if (c.cache != c.cache_in) std::memcpy(c.cache, c.cache_in, c.cache_bytes);
  uint32_t* status = reinterpret_cast<uint32_t*>(c.work + c.ws.status);
  std::fill(status, status + step::kStatusWords, 0u);
  if (c.absent_rank >= 0) {  // the kernel's first all-reduce (layer 0's o) fails, for every rank
    status[step::kFailed] = 1;
    status[step::kFailedPhase] = 1;
    status[step::kMissingRank] = static_cast<uint32_t>(c.absent_rank);
  }
  std::vector<float> resid(H);
  for (int j = 0; j < H; ++j) resid[j] = Bf16ToF32(c.x[j]);
  for (int l = 0; l < s.layers; ++l) {
    const step::LayerWeights& L = c.layers[l];
    const std::vector<float> xn = Norm(resid, L.input_norm, s.eps);
    const std::vector<float> qkv = Gemv(L.qkv, L.qkv_scale, L.scale_per_channel & 1,
                                        s.qkv_rows(), H, xn, s.wbytes);
    step::CpuAttention at{c.rope, c.cache + static_cast<size_t>(l) * 2 * KV * S * D, KV, G, S,
                          pos, start};
    const std::vector<float> att = step::AttendLayer(at, qkv);
    ReduceAdd(c, L.o, L.o_scale, L.scale_per_channel & 2, s.q_dim(), att, resid, across,
              2 * l + 1);
    const std::vector<float> xm = Norm(resid, L.post_norm, s.eps);
    const std::vector<float> gu = Gemv(L.gate_up, L.gate_up_scale, L.scale_per_channel & 4,
                                       2 * F, H, xm, s.wbytes);
    std::vector<float> act(F);
    for (int j = 0; j < F; ++j) {
      const float g = gu[j], u = gu[F + j];
      act[j] = Rb(g / (1.0f + std::exp(-g)) * u);
    }
    ReduceAdd(c, L.down, L.down_scale, L.scale_per_channel & 8, F, act, resid, across,
              2 * l + 2);
  }
  const std::vector<float> out = Norm(resid, c.final_norm, s.eps);
  for (int j = 0; j < H; ++j) c.h[j] = F32ToBf16(out[j]);
  for (int r = 0; r < c.vocab; ++r)
    c.logits[r] = Row(c.head + static_cast<size_t>(r) * H * s.wbytes, H, out.data(),
                      c.head_per_channel ? c.head_scale[r] : c.head_scale[0], s.wbytes);
}

namespace {

ffi::Error CpuLlamaStepImpl(ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> h,
                            ffi::Result<ffi::AnyBuffer> cache, ffi::Result<ffi::AnyBuffer> work,
                            ffi::Result<ffi::AnyBuffer> logits, int64_t layers, int64_t kv_heads,
                            int64_t group, float eps, int64_t ranks, int64_t oneshot,
                            int64_t timeout_ns, int64_t skew_ns, int64_t absent_rank) {
  step::StepCall call;
  const step::StepAttrs attrs{layers, kv_heads, group, eps, ranks, oneshot, timeout_ns, skew_ns,
                              absent_rank};
  ffi::Error err = step::PlanLlamaStep(args, *h, *cache, *work, *logits, attrs, &call);
  if (err.failure()) return err;
  const int pos = call.pos[0], start = call.pos[1];
  if (pos < 0 || pos >= call.shape.capacity || start < 0 || start > pos)
    return Invalid("llama_step: slot " + std::to_string(pos) + " (first slot " +
                   std::to_string(start) + ") outside the cache's " +
                   std::to_string(call.shape.capacity) + " slots");
  step::RunCpuLlamaStep(call);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuLlamaStep, CpuLlamaStepImpl,
                              WithLlamaStepOperands(ffi::Ffi::Bind()));

}  // namespace sifar
