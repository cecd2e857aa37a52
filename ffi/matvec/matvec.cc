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

ffi::Error PlanMatVec(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer ids, ffi::AnyBuffer y,
                      ffi::AnyBuffer workspace, int64_t splits, int64_t lanes,
                      MatVecCall* call) {
  const ffi::DataType t = x.element_type();
  if ((t != ffi::DataType::F32 && t != ffi::DataType::BF16 && t != ffi::DataType::F16) ||
      !ElemOf(t, &call->elem))
    return Invalid("matvec supports float32, bfloat16 and float16");
  if (w.element_type() != t || y.element_type() != t)
    return Invalid("matvec: x, w and y must have one dtype");
  if (ids.element_type() != ffi::DataType::S32) return Invalid("matvec: ids must be int32");
  if (workspace.element_type() != ffi::DataType::F32)
    return Invalid("matvec: the workspace must be float32");
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || ids.dimensions().size() != 1)
    return Invalid("matvec: expects x [M, K], w [E, K, N], ids [M], y [M, N]");
  call->m = xd[0];
  call->k = xd[1];
  call->e = wd[0];
  call->n = wd[2];
  call->splits = splits;
  call->lanes = lanes;
  if (wd[1] != call->k || yd[0] != call->m || yd[1] != call->n ||
      ids.dimensions()[0] != call->m)
    return Invalid("matvec: x [M, K], w [E, K, N], ids [M] and y [M, N] do not agree");
  const int elem_bytes = static_cast<int>(x.size_bytes() / std::max<size_t>(x.element_count(), 1));
  if (const char* why = matvec::Refusal(call->m, call->k, call->n, call->e, splits, lanes,
                                        elem_bytes))
    return Invalid(std::string("matvec: ") + why);
  const size_t want = splits == 1 ? 1 : static_cast<size_t>(call->m * splits * call->n);
  if (workspace.element_count() < want)
    return Invalid("matvec: the workspace holds " + std::to_string(workspace.element_count()) +
                   " floats, the call needs " + std::to_string(want));
  for (const ffi::AnyBuffer* b : {&x, &w, &y})
    if (reinterpret_cast<uintptr_t>(b->untyped_data()) % matvec::kVecBytes)
      return Invalid("matvec: x, w and y must be 16-byte aligned");
  call->x = x.untyped_data();
  call->w = w.untyped_data();
  call->ids = static_cast<const int32_t*>(ids.untyped_data());
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

// The kernel's sums (matvec.h): per split, each row group's rows in order,
// then the groups in order; the splits in order.
void RunMatVec(const MatVecCall& c) {
  const int64_t rows = matvec::SplitRows(c.k, c.splits);
  const int groups = static_cast<int>(matvec::kThreads / c.lanes);
  std::vector<float> group(groups), split(c.splits);
  for (int64_t m = 0; m < c.m; ++m) {
    const int64_t e = std::clamp<int64_t>(c.ids[m], 0, c.e - 1);
    const int64_t wbase = e * c.k * c.n;
    for (int64_t n = 0; n < c.n; ++n) {
      for (int64_t s = 0; s < c.splits; ++s) {
        const int64_t k0 = s * rows, k1 = std::min(c.k, k0 + rows);
        for (int g = 0; g < groups; ++g) {
          float acc = 0.0f;
          for (int64_t k = k0 + g; k < k1; k += groups)
            acc = std::fma(Load(c.elem, c.x, m * c.k + k), Load(c.elem, c.w, wbase + k * c.n + n),
                           acc);
          group[g] = acc;
        }
        float sum = group[0];
        for (int g = 1; g < groups; ++g) sum += group[g];
        split[s] = sum;
      }
      float total = split[0];
      for (int64_t s = 1; s < c.splits; ++s) total += split[s];
      Store(c.elem, c.y, m * c.n + n, total);
    }
  }
}

ffi::Error CpuMatVecImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer ids,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> workspace,
                         int64_t splits, int64_t lanes) {
  MatVecCall call;
  ffi::Error err = PlanMatVec(x, w, ids, *y, *workspace, splits, lanes, &call);
  if (err.failure()) return err;
  RunMatVec(call);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuMatVec, CpuMatVecImpl,
                              WithMatVecOperands(ffi::Ffi::Bind()));

}  // namespace sifar
