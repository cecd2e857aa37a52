// The batch-1 matrix-vector product's checks (PlanMatVec: both backends run
// them) and its CPU backend: the CUDA kernel's work split and summation order
// (matvec.h) in plain loops, so the two give the same bits.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "allreduce/plan.h"
#include "core/cpu_numbers.h"
#include "matvec/matvec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sifar {

ffi::Error PlanMatVec(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer ids,
                      ffi::AnyBuffer scale, ffi::AnyBuffer y, ffi::AnyBuffer workspace,
                      int64_t splits, int64_t lanes, int64_t x_div, int64_t epilogue,
                      int64_t group, MatVecCall* call) {
  const ffi::DataType t = x.element_type();
  if ((t != ffi::DataType::F32 && t != ffi::DataType::BF16 && t != ffi::DataType::F16) ||
      !ElemOf(t, &call->elem))
    return Invalid("matvec supports float32, bfloat16 and float16");
  if (w.element_type() != t || y.element_type() != t || scale.element_type() != t)
    return Invalid("matvec: x, w, scale and y must have one dtype");
  if (ids.element_type() != ffi::DataType::S32) return Invalid("matvec: ids must be int32");
  if (workspace.element_type() != ffi::DataType::F32)
    return Invalid("matvec: the workspace must be float32");
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || ids.dimensions().size() != 1)
    return Invalid("matvec: expects x [X, K], w [E, K, N], ids [M]");
  if (epilogue != matvec::kPlain && epilogue != matvec::kSwiGlu && epilogue != matvec::kCombine)
    return Invalid("matvec: unknown epilogue " + std::to_string(epilogue));
  call->m = ids.dimensions()[0];
  call->k = xd[1];
  call->e = wd[0];
  call->n = wd[2];
  call->splits = splits;
  call->lanes = lanes;
  call->x_div = x_div;
  call->group = group;
  call->epilogue = static_cast<int>(epilogue);
  if (x_div < 1 || xd[0] * x_div != call->m)
    return Invalid("matvec: x has " + std::to_string(xd[0]) + " rows; ids' " +
                   std::to_string(call->m) + " rows must be x_div times that");
  if (wd[1] != call->k) return Invalid("matvec: x [X, K] and w [E, K, N] do not agree on K");
  if (epilogue == matvec::kSwiGlu && call->n % 2) return Invalid("matvec: SwiGLU needs an even N");
  if (epilogue == matvec::kCombine &&
      (group < 1 || call->m % group || scale.element_count() != static_cast<size_t>(call->m)))
    return Invalid("matvec: combining needs M a multiple of group and scale [M]");
  if (y.element_count() != static_cast<size_t>(call->Outputs()))
    return Invalid("matvec: y holds " + std::to_string(y.element_count()) + " elements, the " +
                   "call writes " + std::to_string(call->Outputs()));
  const int elem_bytes = static_cast<int>(x.size_bytes() / std::max<size_t>(x.element_count(), 1));
  if (const char* why = matvec::Refusal(call->m, call->k, call->n, call->e, splits, lanes,
                                        elem_bytes))
    return Invalid(std::string("matvec: ") + why);
  const size_t want = call->Direct() ? 1 : static_cast<size_t>(call->m * splits * call->n);
  if (workspace.element_count() < want)
    return Invalid("matvec: the workspace holds " + std::to_string(workspace.element_count()) +
                   " floats, the call needs " + std::to_string(want));
  for (const ffi::AnyBuffer* b : {&x, &w, &y})
    if (reinterpret_cast<uintptr_t>(b->untyped_data()) % matvec::kVecBytes)
      return Invalid("matvec: x, w and y must be 16-byte aligned");
  call->x = x.untyped_data();
  call->w = w.untyped_data();
  call->ids = static_cast<const int32_t*>(ids.untyped_data());
  call->scale = scale.untyped_data();
  call->y = y.untyped_data();
  call->workspace = static_cast<float*>(workspace.untyped_data());
  return ffi::Error::Success();
}

namespace {

float Load(Elem t, const void* p, int64_t i) {
  switch (t) {
    case Elem::kF32: return static_cast<const float*>(p)[i];
    default: return cpu::HalfToF32(t, static_cast<const uint16_t*>(p)[i]);
  }
}

void Store(Elem t, void* p, int64_t i, float v) {
  if (t == Elem::kF32)
    static_cast<float*>(p)[i] = v;
  else
    static_cast<uint16_t*>(p)[i] = cpu::F32ToHalf(t, v);
}

float Round(Elem t, float v) {
  return t == Elem::kF32 ? v : cpu::HalfToF32(t, cpu::F32ToHalf(t, v));
}

// The kernel's sums (matvec.h): per split, each row group's rows in order,
// then the groups in order; the splits in order; then the epilogue.
void RunMatVec(const MatVecCall& c) {
  const int64_t rows = matvec::SplitRows(c.k, c.splits);
  const int groups = static_cast<int>(matvec::kThreads / c.lanes);
  std::vector<float> group(groups), split(c.splits), sums(c.m * c.n);
  for (int64_t m = 0; m < c.m; ++m) {
    const int64_t e = std::clamp<int64_t>(c.ids[m], 0, c.e - 1);
    const int64_t wbase = e * c.k * c.n, xbase = (m / c.x_div) * c.k;
    for (int64_t n = 0; n < c.n; ++n) {
      for (int64_t s = 0; s < c.splits; ++s) {
        const int64_t k0 = s * rows, k1 = std::min(c.k, k0 + rows);
        for (int g = 0; g < groups; ++g) {
          float acc = 0.0f;
          for (int64_t k = k0 + g; k < k1; k += groups)
            acc = std::fma(Load(c.elem, c.x, xbase + k), Load(c.elem, c.w, wbase + k * c.n + n),
                           acc);
          group[g] = acc;
        }
        float sum = group[0];
        for (int g = 1; g < groups; ++g) sum += group[g];
        split[s] = sum;
      }
      float total = split[0];
      for (int64_t s = 1; s < c.splits; ++s) total += split[s];
      sums[m * c.n + n] = Round(c.elem, total);
    }
  }
  if (c.epilogue == matvec::kPlain) {
    for (int64_t i = 0; i < c.m * c.n; ++i) Store(c.elem, c.y, i, sums[i]);
  } else if (c.epilogue == matvec::kSwiGlu) {
    const int64_t half = c.n / 2;
    for (int64_t m = 0; m < c.m; ++m)
      for (int64_t j = 0; j < half; ++j) {
        const float g = sums[m * c.n + j], u = sums[m * c.n + half + j];
        Store(c.elem, c.y, m * half + j, (g / (1.0f + std::exp(-g))) * u);
      }
  } else {
    for (int64_t t = 0; t < c.m / c.group; ++t)
      for (int64_t n = 0; n < c.n; ++n) {
        float acc = 0.0f;
        for (int64_t j = 0; j < c.group; ++j) {
          const int64_t m = t * c.group + j;
          acc = std::fma(Load(c.elem, c.scale, m), sums[m * c.n + n], acc);
        }
        Store(c.elem, c.y, t * c.n + n, acc);
      }
  }
}

ffi::Error CpuMatVecImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer ids,
                         ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> workspace, int64_t splits, int64_t lanes,
                         int64_t x_div, int64_t epilogue, int64_t group) {
  MatVecCall call;
  ffi::Error err = PlanMatVec(x, w, ids, scale, *y, *workspace, splits, lanes, x_div, epilogue,
                              group, &call);
  if (err.failure()) return err;
  RunMatVec(call);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuMatVec, CpuMatVecImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()  // w [E, K, N]
                                  .Arg<ffi::AnyBuffer>()  // ids [M] int32
                                  .Arg<ffi::AnyBuffer>()  // scale [M] (matvec::kCombine)
                                  .Ret<ffi::AnyBuffer>()  // y (Epilogue)
                                  .Ret<ffi::AnyBuffer>()  // workspace [M, splits, N] float32
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("lanes")
                                  .Attr<int64_t>("x_div")
                                  .Attr<int64_t>("epilogue")
                                  .Attr<int64_t>("group"));

}  // namespace sifar
