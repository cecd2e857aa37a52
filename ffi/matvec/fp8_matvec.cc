// The FP8-weight product's checks (PlanFp8MatVec: both backends run them) and its CPU
// backend: the CUDA kernel's chunks, lanes, splits and summation order (fp8_matvec.h) in
// plain loops, so the two give the same bits.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "allreduce/plan.h"
#include "core/cpu_numbers.h"
#include "matvec/fp8_matvec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sifar {

namespace {

std::string Dims(ffi::AnyBuffer b) {
  std::string s = "[";
  for (int64_t d : b.dimensions()) s += (s.size() > 1 ? ", " : "") + std::to_string(d);
  return s + "]";
}

const char* CheckGrid(const Fp8MatVecCall& c) {
  if (c.m < 1 || c.k < 1 || c.n < 1 || c.e < 1) return "every dimension must be at least 1";
  if (c.k % fp8mv::kChunk) return "K must be a multiple of 16";
  if (c.block_n < 1 || c.block_k < 1) return "block_n and block_k must be at least 1";
  if (c.block_k < c.k && c.block_k % fp8mv::kChunk)
    return "block_k must be a multiple of 16 (or >= K: no blocks along K)";
  if (!fp8mv::ValidLanes(c.lanes)) return "lanes must be 4, 8, 16 or 32";
  if (!fp8mv::ValidSplit(c.ksplit)) return "ksplit must be 1, 2, 4 or 8";
  if (c.m > 65535) return "M must be at most 65535";
  return nullptr;
}

}  // namespace

ffi::Error PlanFp8MatVec(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                         ffi::AnyBuffer ids, ffi::AnyBuffer y, int64_t block_n, int64_t block_k,
                         int64_t lanes, int64_t ksplit, int64_t pdl, int64_t prefetch,
                         Fp8MatVecCall* call) {
  const ffi::DataType t = x.element_type();
  if ((t != ffi::DataType::F32 && t != ffi::DataType::BF16 && t != ffi::DataType::F16) ||
      !ElemOf(t, &call->elem))
    return Invalid("fp8_matvec: x must be float32, bfloat16 or float16");
  if (y.element_type() != t) return Invalid("fp8_matvec: x and y must have one dtype");
  if (w.element_type() != ffi::DataType::F8E4M3FN)
    return Invalid("fp8_matvec: w must be float8_e4m3fn");
  if (scale.element_type() != ffi::DataType::F32)
    return Invalid("fp8_matvec: the scale must be float32");
  if (ids.element_type() != ffi::DataType::S32) return Invalid("fp8_matvec: ids must be int32");
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions(),
             yd = y.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 3 || yd.size() != 2 ||
      ids.dimensions().size() != 1)
    return Invalid("fp8_matvec: expects x [M, K], w [E, N, K], scale [E, SN, SK], ids [M], "
                   "y [M, N]");
  Fp8MatVecCall& c = *call;
  c.m = xd[0], c.k = xd[1], c.e = wd[0], c.n = wd[1];
  c.sn = sd[1], c.sk = sd[2];
  c.block_n = block_n, c.block_k = block_k, c.lanes = lanes, c.ksplit = ksplit;
  c.pdl = pdl != 0, c.prefetch = prefetch != 0;
  if (wd[2] != c.k || yd[0] != c.m || yd[1] != c.n || ids.dimensions()[0] != c.m)
    return Invalid("fp8_matvec: x " + Dims(x) + ", w " + Dims(w) + ", ids " + Dims(ids) +
                   " and y " + Dims(y) + " do not agree");
  if (const char* why = CheckGrid(c)) return Invalid(std::string("fp8_matvec: ") + why);
  const int64_t want_sn = (c.n + block_n - 1) / block_n, want_sk = (c.k + block_k - 1) / block_k;
  if (sd[0] != c.e || c.sn != want_sn || c.sk != want_sk)
    return Invalid("fp8_matvec: scale " + Dims(scale) + " is not [E, ceil(N / block_n), "
                   "ceil(K / block_k)] = [" + std::to_string(c.e) + ", " +
                   std::to_string(want_sn) + ", " + std::to_string(want_sk) + "]");
  for (const ffi::AnyBuffer* b : {&x, &w, &y})
    if (reinterpret_cast<uintptr_t>(b->untyped_data()) % 16)
      return Invalid("fp8_matvec: x, w and y must be 16-byte aligned");
  c.x = x.untyped_data();
  c.w = static_cast<const uint8_t*>(w.untyped_data());
  c.scale = static_cast<const float*>(scale.untyped_data());
  c.ids = static_cast<const int32_t*>(ids.untyped_data());
  c.y = y.untyped_data();
  return ffi::Error::Success();
}

namespace {

float LoadX(Elem t, const void* p, int64_t i) {
  if (t == Elem::kF32) return static_cast<const float*>(p)[i];
  return cpu::HalfToF32(t, static_cast<const uint16_t*>(p)[i]);
}

void StoreY(Elem t, void* p, int64_t i, float v) {
  if (t == Elem::kF32)
    static_cast<float*>(p)[i] = v;
  else
    static_cast<uint16_t*>(p)[i] = cpu::F32ToHalf(t, v);
}

// One lane's partial sum for (x row xm, weight row wr, output row n): fp8_matvec.h's order.
float LanePartial(const Fp8MatVecCall& c, const float* xm, const float* wr, const float* srow,
                  int64_t c_begin, int64_t c_end, int64_t lane) {
  float acc = 0.0f;
  for (int64_t ch = c_begin + lane; ch < c_end; ch += c.lanes) {
    const int64_t k0 = ch * fp8mv::kChunk;
    float p = 0.0f;
    for (int j = 0; j < fp8mv::kChunk; ++j) p = std::fma(xm[k0 + j], wr[k0 + j], p);
    acc = c.KBlocked() ? std::fma(p, srow[k0 / c.block_k], acc) : acc + p;
  }
  return acc;
}

void RunFp8MatVec(const Fp8MatVecCall& c) {
  const int64_t chunks = c.k / fp8mv::kChunk;
  const int64_t per_split = (chunks + c.ksplit - 1) / c.ksplit;
  std::vector<float> xm(c.k), wr(c.k), lane(c.lanes);
  for (int64_t m = 0; m < c.m; ++m) {
    const int64_t e = std::clamp<int64_t>(c.ids[m], 0, c.e - 1);
    for (int64_t k = 0; k < c.k; ++k) xm[k] = LoadX(c.elem, c.x, m * c.k + k);
    for (int64_t n = 0; n < c.n; ++n) {
      const uint8_t* w = c.w + (e * c.n + n) * c.k;
      for (int64_t k = 0; k < c.k; ++k) wr[k] = cpu::E4m3ToF32(w[k]);
      const float* srow = c.scale + (e * c.sn + n / c.block_n) * c.sk;
      float total = 0.0f;
      for (int64_t s = 0; s < c.ksplit; ++s) {
        const int64_t cb = s * per_split, ce = std::min(chunks, cb + per_split);
        for (int64_t l = 0; l < c.lanes; ++l)
          lane[l] = LanePartial(c, xm.data(), wr.data(), srow, cb, ce, l);
        for (int64_t off = c.lanes / 2; off >= 1; off /= 2)
          for (int64_t i = 0; i < off; ++i) lane[i] = lane[i] + lane[i + off];
        total = s == 0 ? lane[0] : total + lane[0];
      }
      if (!c.KBlocked()) total = total * srow[0];
      StoreY(c.elem, c.y, m * c.n + n, total);
    }
  }
}

ffi::Error CpuFp8MatVecImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                            ffi::AnyBuffer ids, ffi::Result<ffi::AnyBuffer> y, int64_t block_n,
                            int64_t block_k, int64_t lanes, int64_t ksplit, int64_t pdl,
                            int64_t prefetch) {
  Fp8MatVecCall call;
  ffi::Error err = PlanFp8MatVec(x, w, scale, ids, *y, block_n, block_k, lanes, ksplit, pdl,
                                 prefetch, &call);
  if (err.failure()) return err;
  RunFp8MatVec(call);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuFp8MatVec, CpuFp8MatVecImpl,
                              WithFp8MatVecOperands(ffi::Ffi::Bind()));

}  // namespace sifar
