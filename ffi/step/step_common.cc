// The persistent steps' shared host code (step_common.h): operand-check helpers and the CPU
// references' arithmetic in the kernels' orders. Compiled with -ffp-contract=off (CMakeLists):
// one rounding per operation, as written.
#include "step/step_common.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "allreduce/plan.h"
#include "core/cpu_numbers.h"
#include "step/llama_step.h"

namespace ffi = xla::ffi;

namespace sifar {
namespace step {

std::string Dims(ffi::AnyBuffer b) {
  std::string s = "[";
  for (int64_t d : b.dimensions()) s += (s.size() > 1 ? ", " : "") + std::to_string(d);
  return s + "]";
}

bool HasDims(ffi::AnyBuffer b, std::initializer_list<int64_t> want) {
  auto d = b.dimensions();
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want)
    if (d[i++] != w) return false;
  return true;
}

int WeightBytes(ffi::DataType t) {
  return t == ffi::DataType::F8E4M3FN ? 1 : t == ffi::DataType::BF16 ? 2 : 0;
}
const char* WeightName(int wbytes) { return wbytes == 2 ? "bfloat16" : "float8_e4m3fn"; }

ffi::Error PlanLead(const std::string& name, ffi::AnyBuffer x, ffi::AnyBuffer rope,
                    ffi::AnyBuffer pos, ffi::AnyBuffer fnorm, int* hidden) {
  if (x.element_type() != ffi::DataType::BF16 || x.dimensions().size() != 1)
    return Invalid(name + "x must be bf16 [H], got " + Dims(x));
  *hidden = static_cast<int>(x.dimensions()[0]);
  if (*hidden % kChunk)
    return Invalid(name + "H must be a multiple of " + std::to_string(kChunk));
  if (rope.element_type() != ffi::DataType::F32 || !HasDims(rope, {2, kHeadDim}))
    return Invalid(name + "rope must be float32 [2, " + std::to_string(kHeadDim) + "], got " +
                   Dims(rope));
  if (pos.element_type() != ffi::DataType::S32 || !HasDims(pos, {2}))
    return Invalid(name + "pos must be int32 [2] (slot, first slot), got " + Dims(pos));
  if (fnorm.element_type() != ffi::DataType::BF16 || !HasDims(fnorm, {*hidden}))
    return Invalid(name + "final_norm must be bf16 [H], got " + Dims(fnorm));
  return ffi::Error::Success();
}

ffi::Error PlanTail(const std::string& name, ffi::AnyBuffer cache_in, ffi::AnyBuffer cache,
                    ffi::AnyBuffer h, const ffi::AnyBuffer* head_w, const ffi::AnyBuffer* head_s,
                    ffi::AnyBuffer logits, int64_t layers, int64_t kv_heads, int hidden,
                    int wbytes, StepTail* t) {
  auto cd = cache_in.dimensions();
  if (cache_in.element_type() != ffi::DataType::BF16 || cd.size() != 6 || cd[0] != layers ||
      cd[1] != 2 || cd[2] != 1 || cd[3] != kv_heads || cd[5] != kHeadDim)
    return Invalid(name + "cache must be bf16 [layers, 2, 1, kv_heads, S, " +
                   std::to_string(kHeadDim) + "] (bhsd, batch 1), got " + Dims(cache_in));
  t->capacity = static_cast<int>(cd[4]);
  if (cache.size_bytes() != cache_in.size_bytes()) return Invalid(name + "cache result size");
  if (h.element_type() != ffi::DataType::BF16 || !HasDims(h, {hidden}))
    return Invalid(name + "h must be bf16 [H], got " + Dims(h));
  if (head_w) {
    ffi::AnyBuffer hw = *head_w, hs = *head_s;
    if (WeightBytes(hw.element_type()) != wbytes || hw.dimensions().size() != 2 ||
        hw.dimensions()[1] != hidden || hw.dimensions()[0] < 1)
      return Invalid(name + "head must be " + WeightName(wbytes) +
                     " [V, H] (the layers' weight type), got " + Dims(hw));
    t->vocab = static_cast<int>(hw.dimensions()[0]);
    if (hs.element_type() != ffi::DataType::F32 ||
        (hs.element_count() != 1 && hs.element_count() != t->vocab))
      return Invalid(name + "head's scale must be float32 with 1 (per tensor) or " +
                     std::to_string(t->vocab) + " (per row) values, got " + Dims(hs));
    if (reinterpret_cast<uintptr_t>(hw.untyped_data()) % 16)
      return Invalid(name + "head must be 16-byte aligned");
    t->head = static_cast<const uint8_t*>(hw.untyped_data());
    t->head_scale = static_cast<const float*>(hs.untyped_data());
    t->head_per_channel = hs.element_count() == t->vocab && t->vocab > 1;
  }
  if (logits.element_type() != ffi::DataType::F32 || !HasDims(logits, {t->vocab}))
    return Invalid(name + "logits must be float32 [" + std::to_string(t->vocab) + "], got " +
                   Dims(logits));
  t->logits = static_cast<float*>(logits.untyped_data());
  return ffi::Error::Success();
}

using cpu::Bf16ToF32;
using cpu::F32ToBf16;

float Rb(float v) { return Bf16ToF32(F32ToBf16(v)); }

float SumSquares(const std::vector<float>& v) {
  float t[kThreads] = {};
  for (size_t j = 0; j < v.size(); ++j) {
    float& a = t[(j / 4) % kThreads];
    a = std::fma(v[j], v[j], a);
  }
  float total = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) {
    float* lane = t + 32 * w;
    for (int off = 16; off >= 1; off /= 2)
      for (int i = 0; i < off; ++i) lane[i] = lane[i] + lane[i + off];
    total += lane[0];
  }
  return total;
}

std::vector<float> Norm(const std::vector<float>& x, const uint16_t* scale, float eps) {
  const float inv = 1.0f / std::sqrt(SumSquares(x) / static_cast<float>(x.size()) + eps);
  std::vector<float> y(x.size());
  for (size_t j = 0; j < x.size(); ++j) y[j] = Rb(Rb(x[j] * inv) * Bf16ToF32(scale[j]));
  return y;
}

namespace {

// Weight j of a row of wb-byte weights (1 e4m3, 2 bf16) as a float.
float Weight(const uint8_t* w, int j, int wb) {
  if (wb == 1) return cpu::E4m3ToF32(w[j]);
  uint16_t v;
  std::memcpy(&v, w + 2 * static_cast<size_t>(j), 2);
  return Bf16ToF32(v);
}

}  // namespace

float Row(const uint8_t* w, int k, const float* x, float scale, int wb) {
  const int per = 16 / wb;  // weights per chunk
  float lane[32] = {};
  for (int ch = 0; ch < k / per; ++ch) {
    float p = 0.0f;
    for (int j = 0; j < per; ++j) p = std::fma(x[per * ch + j], Weight(w, per * ch + j, wb), p);
    lane[ch % 32] = lane[ch % 32] + p;
  }
  for (int off = 16; off >= 1; off /= 2)
    for (int i = 0; i < off; ++i) lane[i] = lane[i] + lane[i + off];
  return lane[0] * scale;
}

std::vector<float> Gemv(const uint8_t* w, const float* s, bool per_channel, int n, int k,
                        const std::vector<float>& x, int wb) {
  std::vector<float> y(n);
  for (int r = 0; r < n; ++r)
    y[r] = Rb(Row(w + static_cast<size_t>(r) * k * wb, k, x.data(), per_channel ? s[r] : s[0], wb));
  return y;
}

std::vector<float> AttendLayer(const CpuAttention& a, const std::vector<float>& qkv) {
  const int D = kHeadDim, G = a.group, KV = a.kv_heads, S = a.capacity, pos = a.pos,
            start = a.start;
  auto slot = [&](int kv01, int h, int j) {
    return a.cache + (((static_cast<size_t>(kv01) * KV + h) * S + j) * D);
  };
  auto rope = [&](const float* v, float* out) {
    for (int d = 0; d < D; ++d) {
      const float rot = d < D / 2 ? -v[d + D / 2] : v[d - D / 2];
      out[d] = Rb(v[d] * a.rope[d] + rot * a.rope[D + d]);
    }
  };
  // A query or key head as the rotary embedding takes it: RMSNormed where a scale is given.
  auto head = [&](const float* v, const uint16_t* scale) {
    std::vector<float> x(v, v + D);
    return scale ? Norm(x, scale, a.eps) : x;
  };
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<float> att(static_cast<size_t>(KV) * G * D);
  for (int h = 0; h < KV; ++h) {
    const float* base = qkv.data() + static_cast<size_t>(h) * (G + 2) * D;
    std::vector<float> q(G * D), k(D), v(D);
    for (int g = 0; g < G; ++g) rope(head(base + g * D, a.q_norm).data(), q.data() + g * D);
    rope(head(base + G * D, a.k_norm).data(), k.data());
    for (int d = 0; d < D; ++d) v[d] = base[(G + 1) * D + d];
    for (int d = 0; d < D; ++d) {
      slot(0, h, pos)[d] = F32ToBf16(k[d]);
      slot(1, h, pos)[d] = F32ToBf16(v[d]);
    }
    for (int g = 0; g < G; ++g) {
      std::vector<float> sc(pos + 1 - start);
      float m = -INFINITY;
      for (int j = start; j <= pos; ++j) {
        const uint16_t* kj = slot(0, h, j);
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += q[g * D + d] * Bf16ToF32(kj[d]);
        sc[j - start] = dot * scale;
        m = std::max(m, sc[j - start]);
      }
      float den = 0.0f;
      std::vector<float> num(D, 0.0f);
      for (int j = start; j <= pos; ++j) {
        const float p = std::exp(sc[j - start] - m);
        den += p;
        const uint16_t* vj = slot(1, h, j);
        for (int d = 0; d < D; ++d) num[d] += p * Bf16ToF32(vj[d]);
      }
      for (int d = 0; d < D; ++d) att[(static_cast<size_t>(h) * G + g) * D + d] = Rb(num[d] / den);
    }
  }
  return att;
}

}  // namespace step
}  // namespace sifar
