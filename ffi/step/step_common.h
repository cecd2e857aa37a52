// What the persistent steps' host code shares (step_common.cc): the operand checks' helpers
// (both backends of every step run them) and the CPU references' arithmetic, each in the CUDA
// kernels' order: the norms' sums of squares, the GEMV rows in fp8_matvec's lanes-32 order (e4m3
// or bf16 weights), one layer's attention (RoPE, the cache write, one softmax pass per head,
// with Qwen3's per-head q and k RMSNorm where given). The Llama step (llama_step.cc) and the
// Qwen3-MoE step (qwen3_moe_step.cc) are built from them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace sifar {
namespace step {

// ---- the operand checks -------------------------------------------------------------------------

std::string Dims(xla::ffi::AnyBuffer b);  // "[d0, d1, ...]"
bool HasDims(xla::ffi::AnyBuffer b, std::initializer_list<int64_t> want);
// A step's weight type: bytes per weight (1 e4m3, 2 bf16), 0 neither.
int WeightBytes(xla::ffi::DataType t);
const char* WeightName(int wbytes);  // "float8_e4m3fn" or "bfloat16"

// The lead operands every step takes: x [H] bf16 (H a multiple of kChunk), rope [2, kHeadDim]
// f32, pos [2] int32, final_norm [H] bf16; *hidden = H. `name` starts every message.
xla::ffi::Error PlanLead(const std::string& name, xla::ffi::AnyBuffer x, xla::ffi::AnyBuffer rope,
                         xla::ffi::AnyBuffer pos, xla::ffi::AnyBuffer final_norm, int* hidden);

// The operands and results after the layers: the cache [layers, 2, 1, kv_heads, S, kHeadDim]
// bf16 and its result, h [H] bf16, the optional head (head_w, head_s: null without it) of the
// step's weight type and its scale, the logits [V] f32 ([0] without a head).
struct StepTail {
  int capacity = 0, vocab = 0;
  const uint8_t* head = nullptr;
  const float* head_scale = nullptr;
  bool head_per_channel = false;
  float* logits = nullptr;
};
xla::ffi::Error PlanTail(const std::string& name, xla::ffi::AnyBuffer cache_in,
                         xla::ffi::AnyBuffer cache, xla::ffi::AnyBuffer h,
                         const xla::ffi::AnyBuffer* head_w, const xla::ffi::AnyBuffer* head_s,
                         xla::ffi::AnyBuffer logits, int64_t layers, int64_t kv_heads, int hidden,
                         int wbytes, StepTail* t);

// ---- the CPU references' arithmetic -------------------------------------------------------------

float Rb(float v);  // rounded to bf16

// The kernels' sum of squares of v: thread t of 256 adds the quads t, t + 256, ... (each
// quad's 4 in order, fma); each warp's lanes by a butterfly (lane 0's value); the 8 warps' values
// in order. For v of 128 values (a head) that is one warp's: lane l's quad, the butterfly.
float SumSquares(const std::vector<float>& v);

// x (as floats) -> bf16(bf16(x * inv) * scale) as floats, inv = 1 / sqrt(SumSquares / n + eps).
std::vector<float> Norm(const std::vector<float>& x, const uint16_t* scale, float eps);

// One output row of k weights of wb bytes (1 e4m3, 2 bf16): fp8_matvec's lanes-32 order
// (16-byte chunks, one fma chain each; lane l takes chunks l + 32 i; the lanes added by a
// butterfly), times the row's scale. Not rounded.
float Row(const uint8_t* w, int k, const float* x, float scale, int wb);

// n rows of k weights ([n, k]) times x, each rounded to bf16; scale per row (per_channel) or s[0].
std::vector<float> Gemv(const uint8_t* w, const float* s, bool per_channel, int n, int k,
                        const std::vector<float>& x, int wb);

// One layer's attention on the CPU, in place on the step's cache: for KV heads [0, kv_heads)
// of qkv (per KV head its `group` query heads, its key, its value, kHeadDim each), with
// q_norm/k_norm (bf16 [kHeadDim], or null: none) each query and key head RMSNormed (Norm, eps)
// before the rotary embedding; the new key and value written to slot pos, the queries attending
// slots [start, pos] in one float32 softmax pass per head. Returns the heads' outputs
// [kv_heads * group * kHeadDim], each rounded to bf16.
struct CpuAttention {
  const float* rope;  // [2, kHeadDim] cos, sin
  uint16_t* cache;    // this layer's [2, kv_heads, capacity, kHeadDim] (bhsd, batch 1)
  int kv_heads, group, capacity, pos, start;
  float eps = 0.0f;
  const uint16_t* q_norm = nullptr;
  const uint16_t* k_norm = nullptr;
};
std::vector<float> AttendLayer(const CpuAttention& a, const std::vector<float>& qkv);

}  // namespace step
}  // namespace sifar
