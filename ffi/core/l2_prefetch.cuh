// Bulk L2 prefetch: a thread hands a range of global memory to the SM's copy
// engine, which brings it into L2 (nothing reaches the SM).  Shared by the
// fused call's prefetch blocks (fused/) and the standalone prefetch op
// (prefetch/).  evict_last, so that the reading kernel's own misses replace
// other lines first: in the device comparison (2x H200, the fused call) it
// gained as much as the default policy and more than evict_normal.  A block
// that issued bulk prefetches retires only when they complete.
#pragma once

#include <cstddef>
#include <cstdint>

namespace sifar {
namespace cuda {

constexpr uint32_t kPrefetchChunk = 64 * 1024;  // bytes per bulk prefetch instruction

// p 16-byte aligned, bytes a multiple of 16.
__device__ __forceinline__ void PrefetchL2(const char* p, uint32_t bytes) {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;"
               ::"l"(p), "r"(bytes), "l"(policy) : "memory");
}

// Lane `lane` of `lanes` prefetches its contiguous share of [base, base + bytes)
// (bytes a multiple of 16; shares are multiples of 16, the last one shorter).
__device__ __forceinline__ void PrefetchLaneShare(const char* base, size_t bytes, size_t lane,
                                                  size_t lanes) {
  const size_t share = (bytes / lanes + 16) & ~static_cast<size_t>(15);
  const size_t begin = lane * share;
  const size_t end = begin + share < bytes ? begin + share : bytes;
  for (size_t at = begin; at < end; at += kPrefetchChunk) {
    const size_t left = end - at;
    PrefetchL2(base + at, static_cast<uint32_t>(left < kPrefetchChunk ? left : kPrefetchChunk));
  }
}

}  // namespace cuda
}  // namespace sifar
