// One decoding step's attention for one new token per sequence:
//   - the rotary embedding of the step's query heads and key (cos/sin given),
//   - its key and value written into the KV cache at slot `pos` (in place),
//   - attention of each query head over the visible slots [start[b], pos] of
//     the cache's first `length` slots (one bucket), GQA: the G query heads
//     of a KV group share its keys and values,
// in two kernels where XLA:GPU ran ten per layer (RoPE, the two cache updates,
// two dots, the softmax's reductions, converts; docs/performance.md).
//
// Work split (flash-decoding): the `length` slots are cut into `splits`
// chunks of Chunk(length, splits) slots; block (split, kv head, b) computes
// its chunk's scores for the G query heads, their maximum m, the sum l of
// exp(score - m) and the unnormalised sum acc of exp(score - m) * value, all
// float32, into the workspace.  Chunks past pos are never read (their blocks
// exit), so a step's cost follows pos, not the bucket.  A second kernel
// merges the chunks that hold visible slots (each weighted by
// exp(m - max) / total) and rounds once.  With one split, the first writes
// the output itself.  The CPU backend runs the same chunks and merge in plain
// loops (its sums in another order: equal to float32 rounding, not in bits).
//
// Rounding as the model's XLA code: the rotated query and key are rounded to
// the activation dtype (the key is stored so; each product and the sum of the
// rotation rounded on their own, no fma); scores, softmax and the value sums
// stay float32 (the XLA code rounds the probabilities to the activation dtype
// before its value matmul: here they are not, so the kernels are the more
// exact of the two).
#pragma once

#include <cstdint>

#include "core/elem_type.h"
#include "core/protocol.h"  // SIFAR_HD
#include "xla/ffi/api/ffi.h"

namespace sifar {

namespace attention {

constexpr int kThreads = 128;   // threads per block of either pass
constexpr int kMaxChunk = 512;  // slots per chunk: the block's scores live in shared memory
constexpr int kMaxGroup = 8;    // query heads per KV head (accumulators per thread)
constexpr int kVecBytes = 16;
constexpr int kMaxSplits = 1024;  // chunks the merge weighs at once (shared memory)

// The cache's two layouts (models/sharding.py KV_LAYOUTS): [B, KV heads, S, D] or [B, S, KV heads, D].
enum Layout : int64_t { kBHSD = 0, kBSHD = 1 };

SIFAR_HD int64_t Chunk(int64_t length, int64_t splits) {
  return (length + splits - 1) / splits;
}

// Why the call cannot run, or nullptr.
inline const char* Refusal(int64_t b, int64_t kv_heads, int64_t group, int64_t d, int64_t s,
                           int64_t length, int64_t splits, int elem_bytes) {
  if (b < 1 || kv_heads < 1 || group < 1 || d < 2 || s < 1) return "every dimension must be >= 1";
  if (group > kMaxGroup) return "at most 8 query heads per KV head";
  if (d != 16 && d != 32 && d != 64 && d != 128 && d != 256)
    return "head_dim must be 16, 32, 64, 128 or 256";
  if (d * elem_bytes > 32 * kVecBytes) return "a head's row must fit one warp's 16-byte loads";
  if (length < 1 || length > s) return "length must be in [1, cache slots]";
  if (splits < 1 || splits > length) return "splits must be in [1, length]";
  if (Chunk(length, splits) > kMaxChunk) return "a chunk holds at most 512 slots: raise splits";
  if (splits > kMaxSplits) return "at most 1024 chunks (splits)";
  if (b > 65535 || kv_heads > 65535) return "batch and KV heads must be at most 65535";
  return nullptr;
}

}  // namespace attention

// One checked call.  qkv [B, KV, G + 2, D]: each KV group's G query heads,
// then its key, then its value, before the rotary embedding; caches in
// `layout`; cos/sin [Bc, D] float32 (Bc = 1: shared, or B); start [B] int32;
// out [B, KV, G, D]; workspace float32: each chunk's value sums
// [B, KV, splits, G, D], then its statistics (max, sum) [B, KV, splits, G, 2].
struct AttentionCall {
  Elem elem = Elem::kF32;
  int64_t b = 0, kv = 0, group = 0, d = 0, s = 0, length = 0, splits = 1;
  int64_t layout = attention::kBHSD;
  int64_t trig_rows = 1;  // Bc
  const void* qkv = nullptr;
  void* k_cache = nullptr;  // the results (aliased to the inputs)
  void* v_cache = nullptr;
  const int32_t* pos = nullptr;
  const float* cos = nullptr;
  const float* sin = nullptr;
  const int32_t* start = nullptr;
  void* out = nullptr;
  float* workspace = nullptr;

  // Workspace records: one per (b, kv head, chunk, query head).
  SIFAR_HD int64_t Records() const { return b * kv * splits * group; }

  // Element offset of (b, h, slot) in either cache.
  SIFAR_HD int64_t Row(int64_t bi, int64_t h, int64_t slot) const {
    return layout == attention::kBHSD ? ((bi * kv + h) * s + slot) * d
                                      : ((bi * s + slot) * kv + h) * d;
  }
};

xla::ffi::Error PlanAttention(xla::ffi::AnyBuffer qkv, xla::ffi::AnyBuffer k_cache,
                              xla::ffi::AnyBuffer v_cache, xla::ffi::AnyBuffer pos,
                              xla::ffi::AnyBuffer cos, xla::ffi::AnyBuffer sin,
                              xla::ffi::AnyBuffer start, xla::ffi::AnyBuffer out,
                              xla::ffi::AnyBuffer k_out, xla::ffi::AnyBuffer v_out,
                              xla::ffi::AnyBuffer workspace, int64_t length, int64_t splits,
                              int64_t layout, AttentionCall* call);

}  // namespace sifar
