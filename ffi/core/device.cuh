// The device primitives every CUDA kernel shares (the all-reduce's, the fused
// call's, multicast's), on the protocol of protocol.h: kernel arguments, the
// PTX memory-ordering helpers, the element arithmetic, the workspace view,
// timeouts and failure records, the NaN fill, barriers, the tag wrap's
// clearing, the pull of epoch-tagged lines and the call framing.  One thread
// moves one line per round; a line always belongs to the same block
// (BlockOfLine), and every block keeps its own epoch, so no kernel needs a
// grid-wide synchronisation.
//
// Memory-ordering helpers are named for what they guarantee; peers' memory is
// only read with strong (volatile / acquire, system-scope) loads, so no stale
// L1 line is ever used.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/protocol.h"

namespace sifar {
namespace cuda {

constexpr int kThreads = 256;
static_assert(kThreads == kLinesPerBlock, "one line per thread");
// Lines of one round of the grid (every block moves kThreads of them).
constexpr size_t kRoundLines = static_cast<size_t>(kMaxBlocks) * kThreads;

struct KernelArgs {
  const void* in;
  void* out;
  size_t nbytes;  // payload, a multiple of 16
  int rank;
  int nranks;
  int repeat;  // back-to-back all-reduces in this launch (benchmarks)
  uint32_t chain;  // the call chain (docs/design.md, "Ordering"): its tag bits
  size_t lane_at;  // offset of the chain's lane in every workspace
  char* ws[kMaxRanks];  // every rank's workspace (P2P pointers)
  char* slots[kMaxRanks];  // explicit buffers (every rank's), or all null: internal slots
  ErrorRecord* err;     // this rank's failure record (host-mapped)
  WorkspaceLayout lay;
};

// --------------------------------------------------------------- PTX ----
__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Acquire: everything the peer wrote before its release is visible after.
__device__ __forceinline__ uint32_t LoadAcquireSys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Release: this thread's (and, after a bar.sync, its block's) earlier writes
// are visible to whoever acquires the flag.
__device__ __forceinline__ void StoreReleaseSys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint64_t LoadAcquireSys64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void StoreReleaseSys64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// Relaxed system-scope accesses: never served from a stale L1 line.
__device__ __forceinline__ uint32_t LoadStrong(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void StoreStrong(uint32_t* p, uint32_t v) {
  asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint4 LoadStrong16(const void* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
// Epoch-tagged line: two 8-byte words, each single-copy atomic (a vector
// access is a set of element accesses), so each word is whole or stale.
__device__ __forceinline__ void StoreLL(uint64_t* p, uint64_t a, uint64_t b) {
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}
__device__ __forceinline__ void LoadLL(const uint64_t* p, uint64_t& a, uint64_t& b) {
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}
__device__ __forceinline__ uint64_t LoadLLWord(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// ------------------------------------------------------------ numbers ----
// Partials are added in rank order in fp32 and rounded once, so every rank
// (and the CPU backend) gets the same bits.
template <typename T>
struct Elem;
template <>
struct Elem<float> {
  using Acc = float;
  static constexpr int kPerWord = 1;
  static constexpr uint32_t kNaNWord = 0x7fc00000u;
  __device__ static void Add(float* acc, uint32_t w, bool first) {
    float v = __uint_as_float(w);
    acc[0] = first ? v : acc[0] + v;
  }
  __device__ static uint32_t Round(const float* acc) { return __float_as_uint(acc[0]); }
};
template <>
struct Elem<__nv_bfloat16> {
  using Acc = float;
  static constexpr int kPerWord = 2;
  static constexpr uint32_t kNaNWord = 0x7fc07fc0u;
  __device__ static void Add(float* acc, uint32_t w, bool first) {
    float lo = __uint_as_float(w << 16), hi = __uint_as_float(w & 0xffff0000u);
    acc[0] = first ? lo : acc[0] + lo;
    acc[1] = first ? hi : acc[1] + hi;
  }
  __device__ static uint32_t Round(const float* acc) {
    uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(acc[0]));
    uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(acc[1]));
    return lo | (hi << 16);
  }
};
template <>
struct Elem<__half> {
  using Acc = float;
  static constexpr int kPerWord = 2;
  static constexpr uint32_t kNaNWord = 0x7e007e00u;
  __device__ static void Add(float* acc, uint32_t w, bool first) {
    float lo = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
    float hi = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
    acc[0] = first ? lo : acc[0] + lo;
    acc[1] = first ? hi : acc[1] + hi;
  }
  __device__ static uint32_t Round(const float* acc) {
    uint32_t lo = __half_as_ushort(__float2half_rn(acc[0]));
    uint32_t hi = __half_as_ushort(__float2half_rn(acc[1]));
    return lo | (hi << 16);
  }
};

// 32-bit integers (int32 and uint32 alike): exact two's-complement sums, as
// lax.psum wraps.  A failed call fills them with INT32_MIN (no NaN exists).
template <>
struct Elem<uint32_t> {
  using Acc = uint32_t;
  static constexpr int kPerWord = 1;
  static constexpr uint32_t kNaNWord = 0x80000000u;
  __device__ static void Add(uint32_t* acc, uint32_t w, bool first) { acc[0] = first ? w : acc[0] + w; }
  __device__ static uint32_t Round(const uint32_t* acc) { return acc[0]; }
};
template <typename T>
using Acc = typename Elem<T>::Acc;

// Adds a 16-byte line of plain payload into acc (4 words).
template <typename T>
__device__ __forceinline__ void AddLine(Acc<T>* acc, uint4 v, bool first) {
  constexpr int K = Elem<T>::kPerWord;
  Elem<T>::Add(acc + 0 * K, v.x, first);
  Elem<T>::Add(acc + 1 * K, v.y, first);
  Elem<T>::Add(acc + 2 * K, v.z, first);
  Elem<T>::Add(acc + 3 * K, v.w, first);
}
template <typename T>
__device__ __forceinline__ uint4 RoundLine(const Acc<T>* acc) {
  constexpr int K = Elem<T>::kPerWord;
  return make_uint4(Elem<T>::Round(acc), Elem<T>::Round(acc + K), Elem<T>::Round(acc + 2 * K),
                    Elem<T>::Round(acc + 3 * K));
}

// ---------------------------------------------------------- workspace ----
struct Ws {
  const KernelArgs& a;
  __device__ Control* ctl(int r) const { return reinterpret_cast<Control*>(a.ws[r] + a.lay.control); }
  __device__ char* lane(int r) const { return a.ws[r] + a.lane_at; }
  __device__ uint32_t* epochs() const {
    return reinterpret_cast<uint32_t*>(lane(a.rank) + a.lay.lane.epochs);
  }
  __device__ uint64_t* barrier(int r) const {
    return reinterpret_cast<uint64_t*>(lane(r) + a.lay.lane.barrier);
  }
  __device__ unsigned long long* stat(int alg, int field) const {
    return reinterpret_cast<unsigned long long*>(a.ws[a.rank] + a.lay.stats) + alg * kNumStats + field;
  }
  __device__ TraceRing* trace() const { return reinterpret_cast<TraceRing*>(a.ws[a.rank] + a.lay.trace); }
  // This lane's count of completed calls of `alg` (block 0 writes it).
  __device__ uint64_t* calls(int alg) const {
    return reinterpret_cast<uint64_t*>(lane(a.rank) + a.lay.lane.calls) + alg;
  }
  // The internal slot of this parity, or the user's buffer.
  __device__ char* slot_of(int r, uint32_t parity) const {
    return a.slots[r] ? a.slots[r] : lane(r) + a.lay.lane.slots + parity * a.lay.slot.total;
  }
  __device__ char* slot(int r, uint32_t e) const { return slot_of(r, SlotParity(e)); }
  __device__ uint4* plain(int r, uint32_t e) const {
    return reinterpret_cast<uint4*>(slot(r, e) + a.lay.slot.plain);
  }
  __device__ uint4* tmp(int r, uint32_t e) const {
    return reinterpret_cast<uint4*>(slot(r, e) + a.lay.slot.tmp);
  }
  // Epoch-tagged words from rank `src`, in rank `owner`'s slot.
  __device__ uint64_t* ll_of(int owner, int src, uint32_t parity) const {
    return reinterpret_cast<uint64_t*>(slot_of(owner, parity) + a.lay.slot.ll +
                                       src * LLRegionBytes(a.lay.slot.slot_bytes));
  }
  __device__ uint64_t* ll(int owner, int src, uint32_t e) const { return ll_of(owner, src, SlotParity(e)); }
  __device__ uint32_t* flags(int r, uint32_t e) const {
    return reinterpret_cast<uint32_t*>(slot(r, e) + a.lay.slot.flags);
  }
};

// Per-thread state of one all-reduce call.
struct CallState {
  uint32_t epoch;
  uint32_t tag;       // Tag(chain, epoch): what this call's words and flags carry
  uint64_t deadline;  // 0 until the first wait: the fast path never reads the clock
  uint64_t timeout_ns;
  bool retried;
  int failed_peer;  // >= 0 once this thread timed out waiting for that rank; -2: comm failed
};

// Gives up when another rank declared the communicator failed or the deadline
// passed (checked every 16th spin: the clock and the flag cost a load each).
__device__ __forceinline__ bool ExpiredNow(const Ws& w, CallState& s, int peer) {
  if (LoadStrong(&w.ctl(w.a.rank)->failed)) {
    s.failed_peer = -2;  // another rank already failed: give up at once
    return true;
  }
  const uint64_t now = GlobalTimerNs();
  if (s.deadline == 0) {
    s.deadline = now + s.timeout_ns;
  } else if (now > s.deadline) {
    s.failed_peer = peer;
    return true;
  }
  return false;
}
__device__ __forceinline__ bool Expired(const Ws& w, CallState& s, int peer, uint32_t spins) {
  return (spins & 15u) == 15u && ExpiredNow(w, s, peer);
}

// The first thread of this rank to time out describes the failure (the
// protocol block and its epoch: a thread block that runs several protocol
// blocks names the one it was waiting for); every rank of the group is told
// to fail fast.
__device__ inline void RecordFailureOf(const Ws& w, int algorithm, const CallState& s,
                                       uint32_t block, uint32_t epoch) {
  if (atomicCAS(&w.ctl(w.a.rank)->error_claimed, 0u, 1u) == 0u) {
    ErrorRecord* e = w.a.err;
    e->algorithm = algorithm;
    e->rank = w.a.rank;
    e->peer = s.failed_peer;
    e->epoch = epoch;
    e->block = block;
    e->chain = w.a.chain;
    __threadfence_system();
    StoreStrong(&e->failed, 1u);
  }
  for (int r = 0; r < w.a.nranks; ++r) StoreStrong(&w.ctl(r)->failed, 1u);
}
// The same for the protocol block this thread block is (one block per thread block).
__device__ inline void RecordFailure(const Ws& w, int algorithm, const CallState& s) {
  RecordFailureOf(w, algorithm, s, blockIdx.x, s.epoch);
}

// Lines of this block, round by round: the same ownership for every size.
#define SIFAR_FOR_EACH_LINE(line, nlines)                                                \
  for (size_t line = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;           \
       line < (nlines); line += kRoundLines)

// A failed call must never return a stale number: a warp that sees the
// failure fills EVERY element of an output (not only its block's lines,
// whose size differs between algorithms), so no line is left unwritten.  A
// line whose own block succeeded holds NaN or its correct sum, never stale
// data.  Warp-wide (every lane of the calling warp takes part), or, with
// (threadIdx.x, kThreads), block-wide where the whole block decided.
template <typename T>
__device__ void FillNaN(void* out, size_t nbytes, uint32_t first = threadIdx.x & 31u,
                        uint32_t stride = 32) {
  const uint32_t n = Elem<T>::kNaNWord;
  for (size_t line = first; line < nbytes / 16; line += stride)
    reinterpret_cast<uint4*>(out)[line] = make_uint4(n, n, n, n);
}

// ---------------------------------------------------------- barriers ----
// Every rank's block `blockIdx.x` has written `value` (of this chain), and
// this block's earlier writes to its own workspace are visible to them.
// Block-wide.
// `block`: the protocol's block (BlockOfLine) whose barrier words these are,
// blockIdx.x except where one thread block runs several (the fused kernel's
// wide rows).
__device__ inline bool AllRanksReachedValueOf(const Ws& w, CallState& s, uint32_t value,
                                              uint32_t block) {
  __syncthreads();
  const int t = threadIdx.x;
  bool ok = true;
  if (t < w.a.nranks && t != w.a.rank) {
    const uint32_t chain = ChainTag(w.a.chain);
    StoreReleaseSys64(w.barrier(t) + block * kMaxRanks + w.a.rank, BarrierWord(chain, value));
    const uint64_t* f = w.barrier(w.a.rank) + block * kMaxRanks + t;
    for (uint32_t spins = 0; !BarrierReached(LoadAcquireSys64(f), chain, value); ++spins)
      if (Expired(w, s, t, spins)) {
        ok = false;
        break;
      }
  }
  return __syncthreads_and(ok) != 0;
}
__device__ __forceinline__ bool AllRanksReachedValue(const Ws& w, CallState& s, uint32_t value) {
  return AllRanksReachedValueOf(w, s, value, blockIdx.x);
}
__device__ inline bool AllRanksReached(const Ws& w, CallState& s, uint32_t phase) {
  return AllRanksReachedValue(w, s, BarrierValue(s.epoch, phase));
}

// The tag wrap (docs/design.md, "Epochs and wrap"): between two barriers that
// use the two skipped epochs' values, every rank zeroes the tagged words and
// flags of this block's lines in both slots of its own workspace, over the
// whole slot (a rare large payload may have left old words past today's size).
// `block` as in AllRanksReachedValueOf.
__device__ inline bool ClearTaggedAtWrapOf(const Ws& w, CallState& s, uint32_t block) {
  if (!AllRanksReachedValueOf(w, s, BarrierValue(s.epoch - 2, kTop), block)) return false;
  const KernelArgs& a = w.a;
  const size_t lines = a.lay.slot.slot_bytes / 8;  // LL lines of one source region
  for (uint32_t parity = 0; parity < 2; ++parity) {
    for (int src = 0; src < a.nranks; ++src) {
      uint64_t* region = w.ll_of(a.rank, src, parity);
      for (size_t line = static_cast<size_t>(block) * kThreads + threadIdx.x; line < lines;
           line += kRoundLines)
        StoreLL(region + 2 * line, 0, 0);
    }
    if (threadIdx.x == 0)
      StoreStrong(reinterpret_cast<uint32_t*>(w.slot_of(a.rank, parity) + a.lay.slot.flags) +
                      block, 0u);
  }
  __threadfence_system();
  return AllRanksReachedValueOf(w, s, BarrierValue(s.epoch - 1, kTop), block);
}
__device__ __forceinline__ bool ClearTaggedAtWrap(const Ws& w, CallState& s) {
  return ClearTaggedAtWrapOf(w, s, blockIdx.x);
}

// ------------------------------------------------------- tagged pull ----
// sifar: publish epoch-tagged words; pull every peer's words at once; re-read
// only the words whose tag is stale.  No flag and no barrier: correct without
// any timing assumption, because validity travels inside each 8-byte word.
// One polling load per peer line stays in flight while waiting (more, spaced
// in time, measured no faster: docs/performance.md).  NR bounds the ranks at
// compile time (registers).
// PUSH (sifar_push): the same words are stored into every peer's slot and each
// rank polls its own memory, trading N-1 remote stores for local polls.
//
// One LL line: publishes `mine` (this rank's 8 payload bytes of the line) and
// returns in `sum` the rank-order sum of every rank's, rounded once.  False:
// this thread timed out (s.failed_peer) or saw the communicator fail.
// WAVE_IN_LOOP: where the first polling wave sits, a measured choice per kernel
// (below).
template <typename T, int NR, bool PUSH, bool WAVE_IN_LOOP = (NR <= 4)>
__device__ __forceinline__ bool PullLine(const Ws& w, CallState& s, size_t line, uint2 mine,
                                         uint2& sum) {
  const KernelArgs& a = w.a;
  const uint32_t e = s.epoch, tag = s.tag;
  const uint64_t lo = PackLL(mine.x, tag), hi = PackLL(mine.y, tag);
  if (PUSH) {
#pragma unroll
    for (int p = 0; p < NR; ++p)
      if (p < a.nranks && p != a.rank) StoreLL(w.ll(p, a.rank, e) + 2 * line, lo, hi);
  } else {
    StoreLL(w.ll(a.rank, a.rank, e) + 2 * line, lo, hi);
  }
  // Where peer p's words for this line are read from.
  auto src = [&](int p) { return (PUSH ? w.ll(a.rank, p, e) : w.ll(p, p, e)) + 2 * line; };
  uint32_t missing = 0;  // bit 2p+k: word k of peer p not yet seen fresh
#pragma unroll
  for (int p = 0; p < NR; ++p)
    if (p < a.nranks && p != a.rank) missing |= 3u << (2 * p);
  uint64_t v[NR][2];
  uint64_t got[NR][2];  // a re-read loads both words of a peer: the fresh ones kept here
  auto wave = [&] {  // one polling load per peer whose words are still missing
#pragma unroll
    for (int p = 0; p < NR; ++p)
      if ((missing >> (2 * p)) & 3u) LoadLL(src(p), v[p][0], v[p][1]);
  };
  // Where the first wave sits is a measured choice (docs/performance.md, issue 38's A/B): at
  // the top of the loop by default for NR <= 4, since written before the loop ptxas hoisted its
  // address arithmetic above the publish store and left the loads one instruction behind it
  // (sifar 8 KB N=2/4 5-10% slower, presumably more stale first reads); before the loop for the
  // all-reduce's NR = 8, where the top-of-loop wave measured 12-17% slower.  The fused kernel
  // takes the top of the loop at every NR (N=8 2-4% faster there than before the loop).
  constexpr bool kWaveInLoop = WAVE_IN_LOOP;
  if constexpr (!kWaveInLoop) wave();
  for (uint32_t spins = 0; missing; ++spins) {
    if constexpr (kWaveInLoop) {
      wave();  // the clock and the failure flag are read with this wave in flight
      if (spins && Expired(w, s, (__ffs(missing) - 1) / 2, spins - 1)) return false;
    }
#pragma unroll
    for (int p = 0; p < NR; ++p)
#pragma unroll
      for (int k = 0; k < 2; ++k)
        if (((missing >> (2 * p + k)) & 1u) && LLTag(v[p][k]) == tag) {
          got[p][k] = v[p][k];
          missing &= ~(1u << (2 * p + k));
        }
    if constexpr (kWaveInLoop) {
      if (missing) s.retried = true;  // mis-speculation: this wave was (partly) stale
    } else {
      if (!missing) break;
      s.retried = true;
      wave();
      if (Expired(w, s, (__ffs(missing) - 1) / 2, spins)) return false;
    }
  }
  Acc<T> acc[2 * Elem<T>::kPerWord];
#pragma unroll
  for (int p = 0; p < NR; ++p) {
    if (p >= a.nranks) break;
    const uint32_t w0 = p == a.rank ? mine.x : LLData(got[p][0]);
    const uint32_t w1 = p == a.rank ? mine.y : LLData(got[p][1]);
    Elem<T>::Add(acc, w0, p == 0);
    Elem<T>::Add(acc + Elem<T>::kPerWord, w1, p == 0);
  }
  sum = make_uint2(Elem<T>::Round(acc), Elem<T>::Round(acc + Elem<T>::kPerWord));
  return true;
}

// Several LL lines of one thread at once, each of its own block (the fused
// kernel's wide rows run several of the protocol's blocks per thread block):
// PublishLine publishes a line of the block at `epoch` (tag `tag`); PollLines
// then keeps one load in flight per peer word of every line of a chunk of C
// (so their remote round trips overlap, where PullLine's per-line loop would
// add them up) and re-reads only the stale words.  A word once fresh stays so
// until this call of its block ends (a peer rewrites that slot two epochs
// later, after this block's next call), so the loaded words are the results.
// Lines whose bit in `want` is clear are not read (sum = mine).  False: this thread timed out
// (s.failed_peer) or saw the communicator fail.
__device__ __forceinline__ void PublishLine(const Ws& w, size_t line, uint32_t epoch, uint32_t tag,
                                            uint2 mine) {
  StoreLL(w.ll(w.a.rank, w.a.rank, epoch) + 2 * line, PackLL(mine.x, tag), PackLL(mine.y, tag));
}
template <typename T, int NR, int C>
__device__ __forceinline__ bool PollLines(const Ws& w, CallState& s, uint32_t want,
                                          const size_t (&line)[C], const uint32_t (&epoch)[C],
                                          const uint32_t (&tag)[C], const uint2 (&mine)[C],
                                          uint2 (&sum)[C]) {
  const KernelArgs& a = w.a;
  uint32_t missing[C];  // bit 2p+k of line i: word k of peer p not yet seen fresh
  uint64_t v[C][NR][2];
#pragma unroll
  for (int i = 0; i < C; ++i) {
    missing[i] = 0;
    if ((want >> i) & 1u) {
#pragma unroll
      for (int p = 0; p < NR; ++p)
        if (p < a.nranks && p != a.rank) missing[i] |= 3u << (2 * p);
    }
  }
#pragma unroll
  for (int i = 0; i < C; ++i)
#pragma unroll
    for (int p = 0; p < NR; ++p)
      if ((missing[i] >> (2 * p)) & 3u) LoadLL(w.ll(p, p, epoch[i]) + 2 * line[i], v[i][p][0], v[i][p][1]);
  for (uint32_t spins = 0;; ++spins) {
    uint32_t left = 0;
    int peer = -1;  // a peer still missing (the failure record's)
#pragma unroll
    for (int i = 0; i < C; ++i) {
#pragma unroll
      for (int p = 0; p < NR; ++p)
#pragma unroll
        for (int k = 0; k < 2; ++k)
          if (((missing[i] >> (2 * p + k)) & 1u) && LLTag(v[i][p][k]) == tag[i])
            missing[i] &= ~(1u << (2 * p + k));
      if (missing[i] && peer < 0) peer = (__ffs(missing[i]) - 1) / 2;
      left |= missing[i];
    }
    if (!left) break;
    s.retried = true;  // mis-speculation: this wave was (partly) stale
#pragma unroll
    for (int i = 0; i < C; ++i)
#pragma unroll
      for (int p = 0; p < NR; ++p)
        if ((missing[i] >> (2 * p)) & 3u) LoadLL(w.ll(p, p, epoch[i]) + 2 * line[i], v[i][p][0], v[i][p][1]);
    if (Expired(w, s, peer, spins)) return false;
  }
#pragma unroll
  for (int i = 0; i < C; ++i) {
    sum[i] = mine[i];
    if (!((want >> i) & 1u)) continue;
    Acc<T> acc[2 * Elem<T>::kPerWord];
#pragma unroll
    for (int p = 0; p < NR; ++p) {
      if (p >= a.nranks) break;
      const uint32_t w0 = p == a.rank ? mine[i].x : LLData(v[i][p][0]);
      const uint32_t w1 = p == a.rank ? mine[i].y : LLData(v[i][p][1]);
      Elem<T>::Add(acc, w0, p == 0);
      Elem<T>::Add(acc + Elem<T>::kPerWord, w1, p == 0);
    }
    sum[i] = make_uint2(Elem<T>::Round(acc), Elem<T>::Round(acc + Elem<T>::kPerWord));
  }
  return true;
}

// ------------------------------------------------------- call framing ----
// Shared by every portable kernel (AllReduceKernel, the fused kernels of
// fused/cuda_fused.cu): each protocol block reads its start (ReadBlockStartOf),
// begins every call (BeginCall), ends it (EndCall) and commits its epoch
// (CommitBlockOf); what runs between BeginCall and EndCall is the algorithm's
// body, or the sifar pull and the fused op's epilogue.
//
// What one thread of each block reads at kernel start and shares: every warp
// of a block must take the same path (a warp that left on `failed` while the
// others wait at a barrier would hang or split the block).
struct BlockStart {
  uint4 c0;  // failed, skew_max_ns, skew_seed, drop
  uint4 c1;  // unused, unused, trace, epoch_mask
  uint64_t timeout_ns;
  uint32_t epoch;
  uint64_t calls;  // block 0: this lane's count for the algorithm
  uint64_t start_ns;
  __device__ bool failed() const { return c0.x != 0; }
  // testing.drop_rank: this block (the protocol's `block`) never arrives.
  __device__ bool dropped_at(uint32_t block) const { return c0.w != 0 && block + 1 >= c0.w; }
  __device__ bool dropped() const { return c0.w != 0 && blockIdx.x + 1 >= c0.w; }
  __device__ uint32_t mask() const { return EpochMask(c1.w); }
};

// Thread 0: the loads issued together into registers (one memory latency:
// the "memory" clobbers keep each shared store after every load), while the
// other threads already load their input.
// `block`: the protocol's block whose epoch is read (blockIdx.x but in the
// fused kernel's wide rows): an index, or ThisBlock.
struct ThisBlock {  // blockIdx.x, read where it is used (as the plain kernels always did)
  __device__ __forceinline__ operator uint32_t() const { return blockIdx.x; }
};
template <typename Block>
__device__ __forceinline__ void ReadBlockStartOf(const Ws& w, int alg, BlockStart& b,
                                                 Block block) {
  const Control* ctl = w.ctl(w.a.rank);
  const uint4 c0 = LoadStrong16(ctl);
  const uint4 c1 = LoadStrong16(&ctl->unused[0]);
  const uint64_t timeout_ns = LoadLLWord(&ctl->timeout_ns);
  const uint32_t epoch = LoadStrong(w.epochs() + static_cast<uint32_t>(block));
  const uint64_t calls = static_cast<uint32_t>(block) == 0 ? LoadLLWord(w.calls(alg)) : 0;
  b.c0 = c0;
  b.c1 = c1;
  b.timeout_ns = timeout_ns;
  b.epoch = epoch;
  b.calls = calls;
  b.start_ns = GlobalTimerNs();
}
__device__ __forceinline__ void ReadBlockStart(const Ws& w, int alg, BlockStart& b) {
  ReadBlockStartOf(w, alg, b, ThisBlock{});
}

// Starts one call of this block: the next epoch, its tag, a fresh call
// state.  Returns whether the tag wraps here (the caller then clears, with
// ClearTaggedAtWrap, block-wide).
__device__ __forceinline__ bool NextCall(const Ws& w, const BlockStart& st, uint32_t& epoch,
                                         CallState& s) {
  const uint32_t prev = epoch, mask = st.mask();
  epoch = NextEpoch(epoch, mask);
  s.epoch = epoch;
  s.tag = Tag(ChainTag(w.a.chain), epoch, mask);
  s.retried = false;
  s.failed_peer = -1;
  s.deadline = 0;
  return WrapsAt(prev, epoch);
}

// testing.inject_skew: a deterministic per-(rank, epoch) wait.
__device__ __forceinline__ void InjectSkew(const Ws& w, const BlockStart& st, uint32_t epoch) {
  if (st.c0.y) {
    const uint64_t until = GlobalTimerNs() + SkewNs(st.c0.y, st.c0.z, w.a.rank, epoch);
    while (GlobalTimerNs() < until) {
    }
  }
}

// Starts one call of protocol block `block` (blockIdx.x but in the fused
// kernel's wide rows), as every portable kernel does: the next epoch and tag;
// the thread block's agreement on `ok` where the call has block-wide barriers
// (AGREE) or the tag wraps (its clearing is block-wide); the injected skew
// (`skew`: once per thread block); the wrap's clearing.  Returns false when
// the call is skipped (`ok` was false: the block failed earlier); else `ok`
// becomes the wrap's outcome (a failed wait is the caller's to record).
// Block-wide where AGREE or on a wrap: every thread calls it.
template <bool AGREE>
__device__ __forceinline__ bool BeginCall(const Ws& w, const BlockStart& st, uint32_t& epoch,
                                          CallState& s, bool& ok, uint32_t block,
                                          bool skew = true) {
  const bool wraps = NextCall(w, st, epoch, s);
  if (AGREE || wraps) ok = __syncthreads_and(ok) != 0;
  if (!ok) return false;
  if (skew) InjectSkew(w, st, epoch);
  if (wraps) ok = ClearTaggedAtWrapOf(w, s, block);
  return true;
}

// Ends one call: mis-speculations and timeouts counted per warp (rare, so
// are these atomics).  Whole warps (the votes need every lane).  Returns
// whether this warp re-read anything.
__device__ __forceinline__ bool EndCall(const Ws& w, int alg, const CallState& s) {
  const bool warp_retried = __any_sync(0xffffffffu, s.retried);
  const bool warp_timed_out = __any_sync(0xffffffffu, s.failed_peer >= 0);
  if ((threadIdx.x & 31u) == 0) {
    if (warp_retried) atomicAdd(w.stat(alg, kRetries), 1ull);
    if (warp_timed_out) atomicAdd(w.stat(alg, kTimeouts), 1ull);
  }
  return warp_retried;
}

// Thread 0 of a block whose calls all completed: the block's epoch, and on
// block 0 the lane's call count (a plain store beside the epoch's: no atomic
// on the fast path) and the call trace.
// `block`: the protocol's block (blockIdx.x but in the fused kernel's wide rows).
__device__ __forceinline__ void CommitBlockOf(const Ws& w, int alg, const BlockStart& st,
                                              uint32_t epoch, bool retried, uint32_t block) {
  if (threadIdx.x != 0) return;
  w.epochs()[block] = epoch;
  if (block != 0) return;
  *w.calls(alg) = st.calls + static_cast<uint64_t>(w.a.repeat);
  if (st.c1.z) {  // the call trace (testing / benchmarks)
    TraceRing* ring = w.trace();
    const unsigned long long k = atomicAdd(&ring->next, 1ull);
    TraceRecord& r = ring->records[k % kTraceCapacity];
    r.start_ns = st.start_ns;
    r.end_ns = GlobalTimerNs();
    r.epoch = epoch;
    r.chain = w.a.chain;
    r.algorithm = alg;
    r.retried = retried;
  }
}
__device__ __forceinline__ void CommitBlock(const Ws& w, int alg, const BlockStart& st,
                                            uint32_t epoch, bool retried) {
  CommitBlockOf(w, alg, st, epoch, retried, blockIdx.x);
}

}  // namespace cuda
}  // namespace sifar
