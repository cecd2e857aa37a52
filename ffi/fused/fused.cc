// psum_add_rmsnorm's checks (PlanFusedCall: both backends run them) and the
// fused ops' CPU backend (RunCpuFused): the sifar all-reduce of
// allreduce/cpu_allreduce.cc (the same epochs, slots and tags as a plain call
// of the communicator), then the epilogue's reference.  AddRmsNorm's is the
// epilogue the CUDA kernel runs, with its rounding points:
//   new_residual = round(float(allreduce(x)) + float(residual))
//   s            = 1 / sqrt(sum(float(new_residual)^2) / hidden + eps)   (fp32)
//   normed       = round(float(weight) * float(round(float(new_residual) * s)))
// (models/llama.py's RMSNorm), with the kernel's order of the fp32 sum of
// squares (RowSumOfSquares).  Only the scale's last bits may differ from the
// kernel's (its rsqrt is the GPU's approximation), so the two agree exactly
// on `new_residual` and within an ulp on `normed`.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "allreduce/plan.h"
#include "core/cpu_numbers.h"
#include "fused/fused.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sifar {

ffi::Error PlanFusedCall(int ordinal, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                         ffi::AnyBuffer weight, const ffi::RemainingArgs& rest,
                         ffi::AnyBuffer normed, ffi::AnyBuffer new_residual, int32_t axis_key,
                         int32_t nranks, int32_t algorithm, int32_t repeat, int32_t chain,
                         float eps, int64_t prefetch_bytes, RankCall* call, FusedCall* fused) {
  const ffi::DataType t = x.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16 && t != ffi::DataType::F16)
    return Invalid("psum_add_rmsnorm supports float32, bfloat16 and float16");
  for (const ffi::AnyBuffer* b : {&residual, &weight, &normed, &new_residual})
    if (b->element_type() != t) return Invalid("psum_add_rmsnorm: operands of different dtypes");
  const size_t bytes = x.size_bytes();
  if (residual.size_bytes() != bytes || normed.size_bytes() != bytes)
    return Invalid("psum_add_rmsnorm: x, residual and the outputs differ in size");
  if (algorithm != kSifar)
    return Invalid(std::string("psum_add_rmsnorm runs the sifar algorithm, not '") +
                   AlgorithmName(algorithm) + "'");
  fused->hidden = weight.element_count();
  fused->row_bytes = weight.size_bytes();
  fused->padded_row_bytes = FusedPaddedRowBytes(fused->row_bytes);
  fused->row_blocks = FusedRowBlocks(fused->row_bytes);
  if (fused->row_blocks == 0 || bytes % fused->row_bytes != 0)
    return Invalid("psum_add_rmsnorm: rows of " + std::to_string(fused->row_bytes) +
                   " bytes are not a layout the fused kernel supports");
  for (const ffi::AnyBuffer* b : {&residual, &weight, &normed})
    if (reinterpret_cast<uintptr_t>(b->untyped_data()) % 16)
      return Invalid("buffers must be 16-byte aligned");
  fused->residual = residual.untyped_data();
  fused->weight = weight.untyped_data();
  fused->normed = normed.untyped_data();
  fused->eps = eps;
  if (prefetch_bytes < 0 || prefetch_bytes % 16 != 0)
    return Invalid("psum_add_rmsnorm: prefetch_bytes must be a non-negative multiple of 16");
  if (prefetch_bytes > 0) {
    auto target = rest.get<ffi::AnyBuffer>(0);
    if (target.has_error())
      return Invalid("psum_add_rmsnorm: prefetch_bytes is set but the prefetch operand is missing");
    if (static_cast<size_t>(prefetch_bytes) > target->size_bytes())
      return Invalid("psum_add_rmsnorm: prefetch_bytes (" + std::to_string(prefetch_bytes) +
                     ") exceeds the prefetch operand's " + std::to_string(target->size_bytes()) +
                     " bytes");
    if (reinterpret_cast<uintptr_t>(target->untyped_data()) % 16)
      return Invalid("psum_add_rmsnorm: the prefetch operand must be 16-byte aligned");
    fused->prefetch = target->untyped_data();
    fused->prefetch_bytes = static_cast<size_t>(prefetch_bytes);
  }
  ffi::Error err = PlanCall(ordinal, x, new_residual, nullptr, axis_key, nranks, algorithm,
                            repeat, chain, call);
  if (err.failure()) return err;
  // The payload the kernel moves: every row padded (FusedPaddedRowBytes).
  const size_t padded = bytes / fused->row_bytes * fused->padded_row_bytes;
  if (padded > call->comm->slot_bytes())
    return Invalid("psum_add_rmsnorm: rows of " + std::to_string(fused->row_bytes) +
                   " bytes padded to " + std::to_string(fused->padded_row_bytes) +
                   " make a payload of " + std::to_string(padded) + " bytes, over the slot of " +
                   std::to_string(call->comm->slot_bytes()) + " bytes");
  return ffi::Error::Success();
}

namespace {

// Element i of a buffer of type t, as fp32.
float Load(Elem t, const void* p, size_t i) {
  if (t == Elem::kF32) {
    float v;
    std::memcpy(&v, static_cast<const char*>(p) + 4 * i, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, static_cast<const char*>(p) + 2 * i, 2);
  return cpu::HalfToF32(t, h);
}
// Rounds v to type t, stores it as element i, and returns the rounded value.
float Store(Elem t, void* p, size_t i, float v) {
  if (t == Elem::kF32) {
    std::memcpy(static_cast<char*>(p) + 4 * i, &v, 4);
    return v;
  }
  const uint16_t h = cpu::F32ToHalf(t, v);
  std::memcpy(static_cast<char*>(p) + 2 * i, &h, 2);
  return cpu::HalfToF32(t, h);
}
float Round(Elem t, float v) {
  if (t == Elem::kF32) return v;
  return cpu::HalfToF32(t, cpu::F32ToHalf(t, v));
}

// The fp32 sum of v[i]^2 over a padded row (FusedPaddedRowBytes: the data,
// then zeros) in the CUDA kernel's order: the elements of each 8-byte line in
// order, then the lines of each warp's share of the row as a pairwise tree
// (the kernel's shuffle butterfly), then the row's warps of each block in
// order, then the blocks in order.
float RowSumOfSquares(const float* v, size_t padded_hidden, size_t per_line) {
  const size_t lines = padded_hidden / per_line;
  std::vector<float> t(lines);
  for (size_t l = 0; l < lines; ++l) {
    float s = 0.f;
    for (size_t k = 0; k < per_line; ++k) {
      const float sq = v[l * per_line + k] * v[l * per_line + k];
      s = s + sq;
    }
    t[l] = s;
  }
  const size_t width = std::min<size_t>(lines, 32);  // lines is a power of two
  for (size_t o = 1; o < width; o <<= 1)
    for (size_t i = 0; i < lines; i += 2 * o) t[i] = t[i] + t[i + o];  // within each width
  const size_t block = std::min<size_t>(lines, kLinesPerBlock);
  float total = 0.f;
  for (size_t b = 0; b < lines / block; ++b) {
    float part = t[b * block];
    for (size_t k = 32; k < block; k += 32) part = part + t[b * block + k];
    total = b == 0 ? part : total + part;
  }
  return total;
}

}  // namespace

namespace cpu {

// The CPU references of the fused epilogues (SIFAR_FUSED_EPILOGUES, fused.h):
// Run computes every output from the all-reduce's result, which `kept` holds
// on entry; Fail fills every output with NaN.
struct AddRmsNorm {
  // `kept` (the new residual) holds allreduce(x) on entry; both outputs on return.
  static void Run(Elem t, const FusedCall& f, size_t rows, void* kept) {
    const size_t h = f.hidden;
    const size_t elem_bytes = t == Elem::kF32 ? 4 : 2;
    const size_t per_line = 8 / elem_bytes;
    // The row as the kernel lays it out: the data, then zeros (masked lanes).
    std::vector<float> v(f.padded_row_bytes / elem_bytes, 0.f);
    for (size_t row = 0; row < rows; ++row) {
      const size_t at = row * h;
      for (size_t i = 0; i < h; ++i)
        v[i] = Store(t, kept, at + i, Load(t, kept, at + i) + Load(t, f.residual, at + i));
      const float ss = RowSumOfSquares(v.data(), v.size(), per_line);
      const float scale = 1.f / std::sqrt(ss / static_cast<float>(h) + f.eps);
      for (size_t i = 0; i < h; ++i) {
        const float y = Round(t, v[i] * scale);
        Store(t, f.normed, at + i, Load(t, f.weight, i) * y);
      }
    }
  }
  static void Fail(Elem t, const FusedCall& f, void* kept, size_t bytes) {
    FillFailed(t, kept, bytes);
    FillFailed(t, f.normed, bytes);
  }
};

}  // namespace cpu

// The CPU backend's fused call: the sifar all-reduce of
// allreduce/cpu_allreduce.cc (its call framing: epochs, slots, tags, skew,
// wrap, failures) into the kept output, then the epilogue's reference,
// dispatched from the table.  Never a plausible number after a failure.
ffi::Error RunCpuFused(const RankCall& call, const FusedCall& fused) {
  if (call.nbytes == 0) return ffi::Error::Success();
  const ffi::Error err = RunCpuAllReduce(call);
  const size_t rows = call.nbytes / fused.row_bytes;
  switch (fused.epilogue) {
#define SIFAR_CPU_EPILOGUE(e, name)                                       \
  case e:                                                                 \
    if (err.failure()) cpu::name::Fail(call.elem, fused, call.out, call.nbytes); \
    else cpu::name::Run(call.elem, fused, rows, call.out);                \
    return err;
    SIFAR_FUSED_EPILOGUES(SIFAR_CPU_EPILOGUE)
#undef SIFAR_CPU_EPILOGUE
    default: return Invalid("fused call: unknown epilogue");
  }
}

namespace {

ffi::Error CpuPsumAddRmsNormImpl(int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                                 ffi::AnyBuffer weight, ffi::RemainingArgs rest,
                                 ffi::Result<ffi::AnyBuffer> normed,
                                 ffi::Result<ffi::AnyBuffer> new_residual, int32_t axis_key,
                                 int32_t nranks, int32_t algorithm, int32_t repeat, int32_t chain,
                                 float eps, int64_t prefetch_bytes) {
  RankCall call;
  FusedCall fused;
  ffi::Error err = PlanFusedCall(ordinal, x, residual, weight, rest, *normed, *new_residual,
                                 axis_key, nranks, algorithm, repeat, chain, eps, prefetch_bytes,
                                 &call, &fused);
  if (err.failure()) return err;
  return RunCpuFused(call, fused);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuPsumAddRmsNorm, CpuPsumAddRmsNormImpl,
                              WithAllReduceAttrs(ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // residual
                                  .Arg<ffi::AnyBuffer>()  // weight
                                  // [prefetch target], then "after": never read
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()  // normed
                                  .Ret<ffi::AnyBuffer>())  // new residual
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("prefetch_bytes"));

}  // namespace sifar
