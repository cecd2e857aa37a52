// The decode attention's checks (PlanAttention: both backends run them) and
// its CPU backend: the same chunks and merge as the CUDA kernels
// (attention.h), in plain loops.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "allreduce/plan.h"
#include "attention/attention.h"
#include "core/cpu_numbers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sifar {

namespace {
bool SameDims(const ffi::AnyBuffer& b, ffi::Span<const int64_t> dims) {
  const auto bd = b.dimensions();
  return bd.size() == dims.size() && std::equal(bd.begin(), bd.end(), dims.begin());
}
}  // namespace

ffi::Error PlanAttention(ffi::AnyBuffer qkv, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                         ffi::AnyBuffer pos, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                         ffi::AnyBuffer start, ffi::AnyBuffer out, ffi::AnyBuffer k_out,
                         ffi::AnyBuffer v_out, ffi::AnyBuffer workspace, int64_t length,
                         int64_t splits, int64_t layout, AttentionCall* call) {
  const ffi::DataType t = qkv.element_type();
  if ((t != ffi::DataType::F32 && t != ffi::DataType::BF16 && t != ffi::DataType::F16) ||
      !ElemOf(t, &call->elem))
    return Invalid("decode_attention supports float32, bfloat16 and float16");
  for (const ffi::AnyBuffer* b : {&k_cache, &v_cache, &out, &k_out, &v_out})
    if (b->element_type() != t)
      return Invalid("decode_attention: qkv, the caches and the output must have one dtype");
  if (pos.element_type() != ffi::DataType::S32 || start.element_type() != ffi::DataType::S32)
    return Invalid("decode_attention: pos and start must be int32");
  if (cos.element_type() != ffi::DataType::F32 || sin.element_type() != ffi::DataType::F32 ||
      workspace.element_type() != ffi::DataType::F32)
    return Invalid("decode_attention: cos, sin and the workspace must be float32");
  if (layout != attention::kBHSD && layout != attention::kBSHD)
    return Invalid("decode_attention: layout must be 0 (bhsd) or 1 (bshd)");
  const auto qd = qkv.dimensions(), kd = k_cache.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || cos.dimensions().size() != 2)
    return Invalid("decode_attention: expects qkv [B, KV, G + 2, D], caches of rank 4, "
                   "cos/sin [1 or B, D]");
  call->b = qd[0];
  call->kv = qd[1];
  call->group = qd[2] - 2;
  call->d = qd[3];
  call->layout = layout;
  call->s = layout == attention::kBHSD ? kd[2] : kd[1];
  const int64_t cache_kv = layout == attention::kBHSD ? kd[1] : kd[2];
  if (kd[0] != call->b || cache_kv != call->kv || kd[3] != call->d || !SameDims(v_cache, kd) ||
      !SameDims(k_out, kd) || !SameDims(v_out, kd))
    return Invalid("decode_attention: the caches do not match qkv [B, KV, G + 2, D]");
  call->trig_rows = cos.dimensions()[0];
  if ((call->trig_rows != 1 && call->trig_rows != call->b) || cos.dimensions()[1] != call->d ||
      !SameDims(sin, cos.dimensions()))
    return Invalid("decode_attention: cos and sin must be [1 or B, D]");
  if (pos.element_count() != 1 || start.element_count() != static_cast<size_t>(call->b))
    return Invalid("decode_attention: pos must hold one slot and start one per sequence");
  if (out.element_count() != static_cast<size_t>(call->b * call->kv * call->group * call->d))
    return Invalid("decode_attention: out must be [B, KV, G, D]");
  const int elem_bytes = static_cast<int>(qkv.size_bytes() / std::max<size_t>(qkv.element_count(), 1));
  if (const char* why = attention::Refusal(call->b, call->kv, call->group, call->d, call->s,
                                           length, splits, elem_bytes))
    return Invalid(std::string("decode_attention: ") + why);
  call->length = length;
  call->splits = splits;
  const size_t want = splits == 1 ? 1
                                  : static_cast<size_t>(call->b * call->kv * splits * call->group *
                                                        (call->d + 2));
  if (workspace.element_count() < want)
    return Invalid("decode_attention: the workspace holds " +
                   std::to_string(workspace.element_count()) + " floats, the call needs " +
                   std::to_string(want));
  for (const ffi::AnyBuffer* b : {&qkv, &k_out, &v_out})
    if (reinterpret_cast<uintptr_t>(b->untyped_data()) % attention::kVecBytes)
      return Invalid("decode_attention: qkv and the caches must be 16-byte aligned");
  call->qkv = qkv.untyped_data();
  call->k_cache = k_out.untyped_data();
  call->v_cache = v_out.untyped_data();
  call->pos = static_cast<const int32_t*>(pos.untyped_data());
  call->cos = static_cast<const float*>(cos.untyped_data());
  call->sin = static_cast<const float*>(sin.untyped_data());
  call->start = static_cast<const int32_t*>(start.untyped_data());
  call->out = out.untyped_data();
  call->workspace = static_cast<float*>(workspace.untyped_data());
  return ffi::Error::Success();
}

namespace {

float Load(Elem t, const void* p, int64_t i) {
  if (t == Elem::kF32) return static_cast<const float*>(p)[i];
  return cpu::HalfToF32(t, static_cast<const uint16_t*>(p)[i]);
}

void Store(Elem t, void* p, int64_t i, float v) {
  if (t == Elem::kF32)
    static_cast<float*>(p)[i] = v;
  else
    static_cast<uint16_t*>(p)[i] = cpu::F32ToHalf(t, v);
}

float Round(Elem t, float v) {
  if (t == Elem::kF32) return v;
  return cpu::HalfToF32(t, cpu::F32ToHalf(t, v));
}

// The rotary embedding of element i of a head's row x (HF's rotate_half), in
// float32, rounded to t.
float Rope(Elem t, const void* x, int64_t row, int64_t d, int64_t i, const float* cos,
           const float* sin) {
  const int64_t half = d / 2;
  const float xi = Load(t, x, row + i);
  const float partner = i < half ? -Load(t, x, row + i + half) : Load(t, x, row + i - half);
  return Round(t, xi * cos[i] + partner * sin[i]);
}

void RunAttention(const AttentionCall& c) {
  const int64_t g_n = c.group, d = c.d, chunk = attention::Chunk(c.length, c.splits);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const int64_t pos = c.pos[0];
  const int64_t slot = std::clamp<int64_t>(pos, 0, c.s - 1);  // as dynamic_update_slice
  std::vector<float> q(g_n * d), m(c.splits * g_n), l(c.splits * g_n),
      acc(c.splits * g_n * d), score(chunk);
  for (int64_t b = 0; b < c.b; ++b) {
    const float* cos = c.cos + (c.trig_rows == 1 ? 0 : b) * d;
    const float* sin = c.sin + (c.trig_rows == 1 ? 0 : b) * d;
    const int64_t lo = std::max<int64_t>(c.start[b], 0), hi = std::min(pos, c.length - 1);
    for (int64_t h = 0; h < c.kv; ++h) {
      const int64_t base = (b * c.kv + h) * (g_n + 2) * d;  // this KV group's rows in qkv
      for (int64_t g = 0; g < g_n; ++g)
        for (int64_t i = 0; i < d; ++i) q[g * d + i] = Rope(c.elem, c.qkv, base + g * d, d, i, cos, sin);
      const int64_t at = c.Row(b, h, slot);
      for (int64_t i = 0; i < d; ++i) {
        Store(c.elem, c.k_cache, at + i, Rope(c.elem, c.qkv, base + g_n * d, d, i, cos, sin));
        Store(c.elem, c.v_cache, at + i, Load(c.elem, c.qkv, base + (g_n + 1) * d + i));
      }
      const int64_t out_row = (b * c.kv + h) * g_n * d;
      if (lo > hi) {  // nothing visible: zeros
        for (int64_t i = 0; i < g_n * d; ++i) Store(c.elem, c.out, out_row + i, 0.0f);
        continue;
      }
      // Each chunk with visible slots: its maximum, sum of exps and weighted values.
      for (int64_t s = lo / chunk; s <= hi / chunk; ++s) {
        const int64_t j0 = std::max(s * chunk, lo), j1 = std::min(s * chunk + chunk - 1, hi);
        for (int64_t g = 0; g < g_n; ++g) {
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t j = j0; j <= j1; ++j) {
            const int64_t row = c.Row(b, h, j);
            float dot = 0.0f;
            for (int64_t i = 0; i < d; ++i)
              dot = std::fma(q[g * d + i], Load(c.elem, c.k_cache, row + i), dot);
            score[j - j0] = dot * scale;
            mx = std::max(mx, score[j - j0]);
          }
          float sum = 0.0f;
          float* a = &acc[(s * g_n + g) * d];
          std::fill(a, a + d, 0.0f);
          for (int64_t j = j0; j <= j1; ++j) {
            const float p = std::exp(score[j - j0] - mx);
            sum += p;
            const int64_t row = c.Row(b, h, j);
            for (int64_t i = 0; i < d; ++i) a[i] = std::fma(p, Load(c.elem, c.v_cache, row + i), a[i]);
          }
          m[s * g_n + g] = mx;
          l[s * g_n + g] = sum;
        }
      }
      // The merge: each chunk weighted by exp(m - max) / total, rounded once.
      for (int64_t g = 0; g < g_n; ++g) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t s = lo / chunk; s <= hi / chunk; ++s) mx = std::max(mx, m[s * g_n + g]);
        float total = 0.0f;
        for (int64_t s = lo / chunk; s <= hi / chunk; ++s)
          total += l[s * g_n + g] * std::exp(m[s * g_n + g] - mx);
        for (int64_t i = 0; i < d; ++i) {
          float v = 0.0f;
          for (int64_t s = lo / chunk; s <= hi / chunk; ++s)
            v = std::fma(acc[(s * g_n + g) * d + i], std::exp(m[s * g_n + g] - mx) / total, v);
          Store(c.elem, c.out, out_row + g * d + i, v);
        }
      }
    }
  }
}

ffi::Error CpuAttentionImpl(ffi::AnyBuffer qkv, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                            ffi::AnyBuffer pos, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                            ffi::AnyBuffer start, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                            ffi::Result<ffi::AnyBuffer> workspace, int64_t length, int64_t splits,
                            int64_t layout) {
  AttentionCall call;
  ffi::Error err = PlanAttention(qkv, k_cache, v_cache, pos, cos, sin, start, *out, *k_out,
                                 *v_out, *workspace, length, splits, layout, &call);
  if (err.failure()) return err;
  // The results alias the caches; where XLA gave a result its own buffer, it
  // starts as the input.
  for (auto [in, res] : {std::pair{&k_cache, &*k_out}, std::pair{&v_cache, &*v_out}})
    if (res->untyped_data() != in->untyped_data())
      std::memcpy(res->untyped_data(), in->untyped_data(), in->size_bytes());
  RunAttention(call);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuDecodeAttention, CpuAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // qkv [B, KV, G + 2, D]
                                  .Arg<ffi::AnyBuffer>()  // k cache (aliased to result 1)
                                  .Arg<ffi::AnyBuffer>()  // v cache (aliased to result 2)
                                  .Arg<ffi::AnyBuffer>()  // pos [] int32
                                  .Arg<ffi::AnyBuffer>()  // cos [1 or B, D] float32
                                  .Arg<ffi::AnyBuffer>()  // sin
                                  .Arg<ffi::AnyBuffer>()  // start [B] int32
                                  .Ret<ffi::AnyBuffer>()  // out [B, KV, G, D]
                                  .Ret<ffi::AnyBuffer>()  // k cache
                                  .Ret<ffi::AnyBuffer>()  // v cache
                                  .Ret<ffi::AnyBuffer>()  // workspace float32
                                  .Attr<int64_t>("length")
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("layout"));

}  // namespace sifar
