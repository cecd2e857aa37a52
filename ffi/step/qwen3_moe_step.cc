// The Qwen3-MoE step's checks (PlanQwen3MoeStep: both backends run them), its workspace layout,
// its expert selection and its CPU backend: qwen3_moe_step.h's phases in plain loops, built from
// the Llama step's pieces (step_common.h: the norms, GEMV rows and attention in the kernels'
// orders).
#include "step/qwen3_moe_step.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "allreduce/plan.h"
#include "core/cpu_numbers.h"
#include "step/step_common.h"
#include "targets.h"

namespace ffi = xla::ffi;

namespace sifar {
namespace step {

MoeWorkspace Qwen3MoeWorkspace(const MoeShape& m) {
  auto up = [](size_t v) { return (v + 255) / 256 * 256; };
  Shape s = m.s;
  s.ffn = m.top_k * m.s.ffn;  // act: the k experts' SwiGLU outputs
  MoeWorkspace w;
  w.base = StepWorkspace(s);
  const size_t k = static_cast<size_t>(m.top_k), R = static_cast<size_t>(m.s.ranks);
  w.logits = w.base.total;
  w.sel = w.logits + up(4 * R * static_cast<size_t>(m.experts));
  w.y = w.sel + up(4 * 2 * static_cast<size_t>(m.s.layers) * k);
  w.total = w.y + up(4 * R * k * m.s.hidden);
  return w;
}

namespace {

const char* kMoeNames[4] = {"qkv", "o", "gate_up", "down"};

// One layer's 13 operands from args[b, b + 13) (shape m; E, I known): *L, or the error.
ffi::Error PlanMoeLayer(const std::string& at, ffi::RemainingArgs args, size_t b,
                        const MoeShape& m, MoeLayerWeights* L) {
  auto arg = [&](size_t i) { return args.get<ffi::AnyBuffer>(b + i).value(); };
  const Shape& s = m.s;
  const int64_t H = s.hidden, E = m.experts, I = s.ffn;
  const std::pair<size_t, int64_t> norms[4] = {{0, H}, {3, kHeadDim}, {4, kHeadDim}, {7, H}};
  const uint16_t** np[4] = {&L->input_norm, &L->q_norm, &L->k_norm, &L->post_norm};
  for (int i = 0; i < 4; ++i) {
    ffi::AnyBuffer nb = arg(norms[i].first);
    if (nb.element_type() != ffi::DataType::BF16 || !HasDims(nb, {norms[i].second}))
      return Invalid(at + "norm scales must be bf16 [" + std::to_string(norms[i].second) +
                     "] (input_norm, post_norm [H]; q_norm, k_norm [head_dim]), got " + Dims(nb));
    *np[i] = static_cast<const uint16_t*>(nb.untyped_data());
  }
  ffi::AnyBuffer router = arg(8);
  if (router.element_type() != ffi::DataType::BF16 || !HasDims(router, {E, H}))
    return Invalid(at + "router must be bf16 [E, H] = [" + std::to_string(E) + ", " +
                   std::to_string(H) + "], got " + Dims(router));
  if (reinterpret_cast<uintptr_t>(router.untyped_data()) % 16)
    return Invalid(at + "router must be 16-byte aligned");
  L->router = static_cast<const uint16_t*>(router.untyped_data());
  const std::string wname = WeightName(s.wbytes);
  // qkv, o: [N, K]; gate_up, down: [E, N, K].
  const size_t wi[4] = {1, 5, 9, 11};
  const int64_t ns[4] = {s.qkv_rows(), H, 2 * I, H};
  const int64_t ks[4] = {H, s.q_dim(), H, I};
  const uint8_t** wp[4] = {&L->qkv, &L->o, &L->gate_up, &L->down};
  const float** sp[4] = {&L->qkv_scale, &L->o_scale, &L->gate_up_scale, &L->down_scale};
  L->scale_per_channel = 0;
  for (int p = 0; p < 4; ++p) {
    ffi::AnyBuffer w = arg(wi[p]), sc = arg(wi[p] + 1);
    const bool stack = p >= 2;
    const bool dims = stack ? HasDims(w, {E, ns[p], ks[p]}) : HasDims(w, {ns[p], ks[p]});
    if (WeightBytes(w.element_type()) != s.wbytes || !dims)
      return Invalid(at + kMoeNames[p] + " must be " + wname + " [" +
                     (stack ? std::to_string(E) + ", " : "") + std::to_string(ns[p]) + ", " +
                     std::to_string(ks[p]) + "] (layer 0 qkv's weight type), got " + Dims(w) +
                     (WeightBytes(w.element_type()) != s.wbytes ? " of another dtype" : ""));
    const int64_t n = sc.element_count();
    const bool ok = stack ? (n == 1 || n == E || n == E * ns[p]) : (n == 1 || n == ns[p]);
    if (sc.element_type() != ffi::DataType::F32 || !ok)
      return Invalid(at + kMoeNames[p] + "'s scale must be float32 with 1 (per tensor)" +
                     (stack ? ", " + std::to_string(E) + " (per expert)" : std::string()) +
                     " or " + std::to_string(stack ? E * ns[p] : ns[p]) +
                     " (per channel) values, got " + Dims(sc));
    if (reinterpret_cast<uintptr_t>(w.untyped_data()) % 16)
      return Invalid(at + kMoeNames[p] + " must be 16-byte aligned");
    *wp[p] = static_cast<const uint8_t*>(w.untyped_data());
    *sp[p] = static_cast<const float*>(sc.untyped_data());
    if (!stack && n == ns[p] && ns[p] > 1) L->scale_per_channel |= 1u << p;
    const int kind = n == E * ns[p] && n > 1 ? kPerChannel : n == E && n > 1 ? kPerExpert
                                                                                : kPerTensor;
    if (p == 2) L->gate_up_scale_kind = kind;
    if (p == 3) L->down_scale_kind = kind;
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error PlanQwen3MoeStep(ffi::RemainingArgs args, ffi::AnyBuffer h, ffi::AnyBuffer cache,
                            ffi::AnyBuffer work, ffi::AnyBuffer logits, const MoeAttrs& attrs,
                            MoeCall* call) {
  const std::string name = "qwen3_moe_step: ";
  const int64_t layers = attrs.layers, kv_heads = attrs.kv_heads, group = attrs.group;
  if (layers < 1 || layers > kMaxLayers)
    return Invalid(name + "layers must be in [1, " + std::to_string(kMaxLayers) + "], got " +
                   std::to_string(layers));
  if (kv_heads < 1 || group < 1 || group > kMaxGroup)
    return Invalid(name + "kv_heads >= 1 and group in [1, " + std::to_string(kMaxGroup) +
                   "] needed, got " + std::to_string(kv_heads) + ", " + std::to_string(group));
  if (attrs.top_k < 1 || attrs.top_k > kMaxTopK ||
      (attrs.norm_topk_prob != 0 && attrs.norm_topk_prob != 1))
    return Invalid(name + "top_k in [1, " + std::to_string(kMaxTopK) +
                   "] and norm_topk_prob 0 or 1 needed, got " + std::to_string(attrs.top_k) +
                   ", " + std::to_string(attrs.norm_topk_prob));
  const int64_t ranks = attrs.ranks;
  if (ranks < 1 || ranks > kMaxRanks || kv_heads % ranks)
    return Invalid(name + "ranks must be in [1, " + std::to_string(kMaxRanks) +
                   "] and split the KV heads, got " + std::to_string(ranks) + " for " +
                   std::to_string(kv_heads) + " KV heads");
  if (attrs.timeout_ns < 1 || attrs.timeout_ns > kMaxTimeoutNs ||
      (attrs.oneshot != 0 && attrs.oneshot != 1))
    return Invalid(name + "timeout_ns in [1, " + std::to_string(kMaxTimeoutNs) +
                   "] and oneshot 0 or 1 needed");
  const size_t want = kLeadOperands + kMoeOperandsPerLayer * layers + 1, nargs = args.size();
  if (nargs != want && nargs != want + 2)
    return Invalid(name + "expected " + std::to_string(want) + " operands for " +
                   std::to_string(layers) + " layers (" + std::to_string(want + 2) +
                   " with the head), got " + std::to_string(nargs));
  auto arg = [&](size_t i) { return args.get<ffi::AnyBuffer>(i).value(); };
  ffi::AnyBuffer x = arg(0), rope = arg(1), pos = arg(2), fnorm = arg(3);
  MoeCall& c = *call;
  MoeShape& m = c.shape;
  Shape& s = m.s;
  ffi::Error err = PlanLead(name, x, rope, pos, fnorm, &s.hidden);
  if (err.failure()) return err;
  s.kv_heads = static_cast<int>(kv_heads);
  s.group = static_cast<int>(group);
  s.layers = static_cast<int>(layers);
  s.eps = attrs.eps;
  s.ranks = static_cast<int>(ranks);
  m.top_k = static_cast<int>(attrs.top_k);
  m.norm_topk = static_cast<int>(attrs.norm_topk_prob);
  // E and I from layer 0's gate_up [E, 2I, H].
  ffi::AnyBuffer gu0 = arg(kLeadOperands + 9);
  if (gu0.dimensions().size() != 3)
    return Invalid(name + "gate_up must be [E, 2I, H], got " + Dims(gu0));
  m.experts = static_cast<int>(gu0.dimensions()[0]);
  s.ffn = static_cast<int>(gu0.dimensions()[1] / 2);
  if (m.experts < m.top_k || m.experts > kMaxExperts)
    return Invalid(name + std::to_string(m.experts) + " experts: top_k to " +
                   std::to_string(kMaxExperts) + " needed");
  if (s.ffn < 1 || s.ffn % kChunk || s.q_dim() % kChunk)
    return Invalid(name + "I and the heads' width must be multiples of " + std::to_string(kChunk));
  if (s.ffn % (kChunk * s.ranks))
    return Invalid(name + "I=" + std::to_string(s.ffn) + " must split over " +
                   std::to_string(s.ranks) + " ranks in multiples of " + std::to_string(kChunk));
  s.wbytes = WeightBytes(arg(kLeadOperands + 1).element_type());
  if (s.wbytes == 0)
    return Invalid(name + "layer 0 qkv must be float8_e4m3fn or bfloat16 (the step's weight "
                   "type), got another dtype");
  c.layers.resize(layers);
  for (int64_t l = 0; l < layers; ++l) {
    err = PlanMoeLayer(name + "layer " + std::to_string(l) + " ", args,
                       kLeadOperands + kMoeOperandsPerLayer * l, m, &c.layers[l]);
    if (err.failure()) return err;
  }
  const bool has_head = nargs == want + 2;
  const ffi::AnyBuffer hw = arg(has_head ? want : 0), hs = arg(has_head ? want + 1 : 0);
  ffi::AnyBuffer cache_in = arg(want - 1);
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
  c.ws = Qwen3MoeWorkspace(m);
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

void SelectExperts(const float* logits, int experts, int top_k, bool norm_topk, int* ids,
                   float* weights) {
  float m = -INFINITY;
  for (int e = 0; e < experts; ++e) m = std::max(m, logits[e]);
  // The kernel's warp: lane l adds the exps of experts l, l + 32, ... in order; the butterfly.
  float lane[32] = {};
  std::vector<float> p(experts);
  for (int e = 0; e < experts; ++e) {
    p[e] = std::exp(logits[e] - m);
    lane[e % 32] = lane[e % 32] + p[e];
  }
  for (int off = 16; off >= 1; off /= 2)
    for (int i = 0; i < off; ++i) lane[i] = lane[i] + lane[i + off];
  for (int e = 0; e < experts; ++e) p[e] = p[e] / lane[0];
  std::vector<bool> taken(experts, false);
  float total = 0.0f;
  for (int i = 0; i < top_k; ++i) {
    int best = -1;
    for (int e = 0; e < experts; ++e)  // strictly larger: ties go to the lower index
      if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
    taken[best] = true;
    ids[i] = best;
    weights[i] = p[best];
    total = total + p[best];
  }
  for (int i = 0; i < top_k; ++i)
    weights[i] = Rb(norm_topk ? weights[i] / total : weights[i]);
}

namespace {

using cpu::Bf16ToF32;
using cpu::F32ToBf16;

// Row n of w [N, K] over columns [c0, c0 + kc) times x[c0, ...), rounded to bf16.
float PartRow(const uint8_t* w, int n, int K, int c0, int kc, const float* x, float scale, int wb) {
  return Rb(Row(w + (static_cast<size_t>(n) * K + c0) * wb, kc, x + c0, scale, wb));
}

// resid += the sum over ranks of part(r, n) (rank order, float32, rounded once): sifar's rule;
// at R = 1 bf16(resid + part(0, n)).
template <class Part>
void AddRanks(int H, int R, std::vector<float>& resid, Part part) {
  for (int n = 0; n < H; ++n) {
    float acc = 0.0f;
    for (int r = 0; r < R; ++r) acc = r == 0 ? part(0, n) : acc + part(r, n);
    resid[n] = Rb(resid[n] + Rb(acc));
  }
}

// resid += the MoE block of layer L on xm (post-norm), recording the selection at sel_ids,
// sel_w. Rank r's partial: its columns of each chosen expert's down.
void CpuMoe(const MoeCall& c, const MoeLayerWeights& L, const std::vector<float>& xm,
            std::vector<float>& resid, int* sel_ids, float* sel_w) {
  const MoeShape& m = c.shape;
  const int H = m.s.hidden, I = m.s.ffn, E = m.experts, K = m.top_k, wb = m.s.wbytes;
  const int R = m.s.ranks, Ir = I / R;
  std::vector<float> logits(E);
  const uint8_t* router = reinterpret_cast<const uint8_t*>(L.router);
  for (int e = 0; e < E; ++e)
    logits[e] = Rb(Row(router + static_cast<size_t>(e) * H * 2, H, xm.data(), 1.0f, 2));
  SelectExperts(logits.data(), E, K, m.norm_topk, sel_ids, sel_w);
  std::vector<std::vector<float>> part(R, std::vector<float>(H, 0.0f));  // [R][H]
  std::vector<float> act(I);
  for (int i = 0; i < K; ++i) {
    const int e = sel_ids[i];
    const uint8_t* gu = L.gate_up + static_cast<size_t>(e) * 2 * I * H * wb;
    const uint8_t* dn = L.down + static_cast<size_t>(e) * H * I * wb;
    for (int j = 0; j < I; ++j) {
      const float g = Rb(Row(gu + static_cast<size_t>(j) * H * wb, H, xm.data(),
                             ExpertRowScale(L.gate_up_scale, L.gate_up_scale_kind, e, 2 * I, j),
                             wb));
      const float u = Rb(Row(gu + static_cast<size_t>(I + j) * H * wb, H, xm.data(),
                             ExpertRowScale(L.gate_up_scale, L.gate_up_scale_kind, e, 2 * I, I + j),
                             wb));
      act[j] = Rb(g / (1.0f + std::exp(-g)) * u);
    }
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < H; ++n) {
        const float y = PartRow(dn, n, I, r * Ir, Ir, act.data(),
                                ExpertRowScale(L.down_scale, L.down_scale_kind, e, H, n), wb);
        part[r][n] = part[r][n] + y * sel_w[i];
      }
  }
  AddRanks(H, R, resid, [&](int r, int n) { return Rb(part[r][n]); });
}

}  // namespace

void RunCpuQwen3MoeStep(const MoeCall& c) {
  const MoeShape& m = c.shape;
  const Shape& s = m.s;
  const int H = s.hidden, D = kHeadDim, KV = s.kv_heads, S = s.capacity;
  if (c.cache != c.cache_in) std::memcpy(c.cache, c.cache_in, c.cache_bytes);
  std::memset(c.work, 0, c.ws.base.counter_bytes);  // the status words, as the kernel's memset
  int32_t* sel_ids = reinterpret_cast<int32_t*>(c.work + c.ws.sel);
  float* sel_w = reinterpret_cast<float*>(sel_ids + static_cast<size_t>(s.layers) * m.top_k);
  std::vector<float> resid(H);
  for (int j = 0; j < H; ++j) resid[j] = Bf16ToF32(c.x[j]);
  for (int l = 0; l < s.layers; ++l) {
    const MoeLayerWeights& L = c.layers[l];
    const std::vector<float> xn = Norm(resid, L.input_norm, s.eps);
    const std::vector<float> qkv = Gemv(L.qkv, L.qkv_scale, L.scale_per_channel & 1,
                                        s.qkv_rows(), H, xn, s.wbytes);
    CpuAttention at{c.rope, c.cache + static_cast<size_t>(l) * 2 * KV * S * D, KV, s.group, S,
                    c.pos[0], c.pos[1], s.eps, L.q_norm, L.k_norm};
    const std::vector<float> att = AttendLayer(at, qkv);
    const int Q = s.q_dim(), Qr = Q / s.ranks;
    AddRanks(H, s.ranks, resid, [&](int r, int n) {
      return PartRow(L.o, n, Q, r * Qr, Qr, att.data(),
                     L.scale_per_channel & 2 ? L.o_scale[n] : L.o_scale[0], s.wbytes);
    });
    const std::vector<float> xm = Norm(resid, L.post_norm, s.eps);
    CpuMoe(c, L, xm, resid, sel_ids + static_cast<size_t>(l) * m.top_k,
           sel_w + static_cast<size_t>(l) * m.top_k);
  }
  const std::vector<float> out = Norm(resid, c.final_norm, s.eps);
  for (int j = 0; j < H; ++j) c.h[j] = F32ToBf16(out[j]);
  for (int r = 0; r < c.vocab; ++r)
    c.logits[r] = Row(c.head + static_cast<size_t>(r) * H * s.wbytes, H, out.data(),
                      c.head_per_channel ? c.head_scale[r] : c.head_scale[0], s.wbytes);
}

}  // namespace step

namespace {

ffi::Error CpuQwen3MoeStepImpl(ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> h,
                               ffi::Result<ffi::AnyBuffer> cache, ffi::Result<ffi::AnyBuffer> work,
                               ffi::Result<ffi::AnyBuffer> logits, int64_t layers,
                               int64_t kv_heads, int64_t group, int64_t top_k,
                               int64_t norm_topk_prob, float eps, int64_t ranks,
                               int64_t oneshot, int64_t timeout_ns) {
  step::MoeCall call;
  const step::MoeAttrs attrs{layers, kv_heads, group, top_k, norm_topk_prob, eps,
                             ranks,  oneshot,  timeout_ns};
  ffi::Error err = step::PlanQwen3MoeStep(args, *h, *cache, *work, *logits, attrs, &call);
  if (err.failure()) return err;
  const int pos = call.pos[0], start = call.pos[1];
  if (pos < 0 || pos >= call.shape.s.capacity || start < 0 || start > pos)
    return Invalid("qwen3_moe_step: slot " + std::to_string(pos) + " (first slot " +
                   std::to_string(start) + ") outside the cache's " +
                   std::to_string(call.shape.s.capacity) + " slots");
  step::RunCpuQwen3MoeStep(call);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuQwen3MoeStep, CpuQwen3MoeStepImpl,
                              WithQwen3MoeStepOperands(ffi::Ffi::Bind()));

}  // namespace sifar
