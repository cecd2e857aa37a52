// The SiFAR protocol shared by the CPU reference backend and the CUDA backend:
// algorithm ids, the symmetric workspace layout, epochs, slot parity, the
// epoch-tagged (LL) word format and the barrier flag values.  Everything here
// is plain data and inline arithmetic so both backends run the same rules.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define SIFAR_HD __host__ __device__ __forceinline__
#else
#define SIFAR_HD inline
#endif

namespace sifar {

// Keep in sync with sifar_jax/algorithms.py.
enum Algorithm : int32_t {
  kOneshot = 0,    // top barrier, pull-reduce, bottom barrier
  kTwoshot = 1,    // top barrier, reduce-scatter, mid barrier, all-gather, bottom barrier
  kOneshotDB = 2,  // dual-buffered oneshot: no bottom barrier
  kSifarFlag = 3,  // paper: speculative pull, per-block flag reduced alongside, re-pull on mismatch
  kSifar = 4,      // dual buffering + speculative pull of epoch-tagged words (correct by construction)
  kMulticast = 5,  // redundant pull through NVLink multicast (GPU only, opt-in)
  kSifarPush = 6,  // sifar with the words pushed into the peers' inboxes, polled locally
  kNumAlgorithms = 7,
};

constexpr int kMaxRanks = 8;
// Thread blocks of one all-reduce.  Every block keeps its own epoch, and a line
// of the payload always belongs to the same block (see BlockOfLine), so the
// dual-buffering argument holds per block without any grid-wide sync.
constexpr int kMaxBlocks = 64;
constexpr size_t kAlign = 256;

SIFAR_HD size_t AlignUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

// ---------------------------------------------------------------------------
// Epoch-tagged words (NCCL's LL format): 4 bytes of payload + 4 bytes of epoch,
// stored and loaded as ONE aligned 8-byte access, so a reader either sees the
// whole word of epoch e or knows it is stale.  Validity travels with the data.
// ---------------------------------------------------------------------------
SIFAR_HD uint64_t PackLL(uint32_t data, uint32_t epoch) {
  return (static_cast<uint64_t>(epoch) << 32) | data;
}
SIFAR_HD uint32_t LLData(uint64_t w) { return static_cast<uint32_t>(w); }
SIFAR_HD uint32_t LLEpoch(uint64_t w) { return static_cast<uint32_t>(w >> 32); }

// Epochs count a block's all-reduces from 1.  They skip 0 and 1 when the
// 32-bit counter wraps: 0 is the tag of never-written words, and skipping two
// keeps the slot parity alternating (0xffffffff is odd, 2 is even).
SIFAR_HD uint32_t NextEpoch(uint32_t e) { return e + 1 == 0 ? 2u : e + 1; }

// Barrier flag values: monotonic in (epoch, phase) modulo 2^32, so a waiter
// tests "reached" with a wrap-safe difference and no flag is ever reset (no
// ABA between consecutive all-reduces; peers are never 2^31 phases apart).
enum BarrierPhase : uint32_t { kTop = 1, kMid = 2, kBottom = 3 };
SIFAR_HD uint32_t BarrierValue(uint32_t epoch, uint32_t phase) { return epoch * 4u + phase; }
SIFAR_HD bool Reached(uint32_t seen, uint32_t wanted) {
  return static_cast<int32_t>(seen - wanted) >= 0;
}

// Dual buffering: consecutive epochs alternate slots.  Finishing epoch e-1
// proves every peer started e-1, hence finished e-2, so slot e%2 is free at e.
SIFAR_HD uint32_t SlotParity(uint32_t epoch) { return epoch & 1u; }

// Line -> block ownership, the same for every payload size: a line is the unit
// one thread moves (16 bytes of plain payload or one 16-byte LL line holding
// 8 payload bytes).
SIFAR_HD int BlockOfLine(size_t line, int lines_per_block) {
  return static_cast<int>((line / lines_per_block) % kMaxBlocks);
}
SIFAR_HD int BlocksFor(size_t lines, int lines_per_block) {
  size_t b = (lines + lines_per_block - 1) / lines_per_block;
  return static_cast<int>(b < static_cast<size_t>(kMaxBlocks) ? b : kMaxBlocks);
}

// Twoshot: within each block's run of lines, rank r reduces the r-th of N
// contiguous pieces (so every block works on every rank).
struct Piece {
  size_t begin, end;
};
SIFAR_HD Piece PieceOf(size_t run_begin, size_t run_end, int rank, int nranks) {
  size_t n = run_end - run_begin;
  size_t per = (n + nranks - 1) / nranks;
  size_t b = run_begin + per * rank;
  size_t e = b + per;
  if (b > run_end) b = run_end;
  if (e > run_end) e = run_end;
  return {b, e};
}

// ---------------------------------------------------------------------------
// Workspace layout.  Each rank owns one workspace; peers read (and for
// barriers write) it directly: P2P pointers on GPUs, shared memory on the CPU.
//
//   Control        written by the host at set-up and by any rank on failure
//                  (the ErrorRecord lives apart, in host-visible memory)
//   epochs         per-block epoch counters, local only
//   barrier        [block][peer] arrival values, written by the peers
//   stats          [algorithm][calls, retries, timeouts], local only
//   Slot[2]        the dual payload buffers (or user-registered buffers)
//
// A Slot holds every payload region an algorithm may use, with disjoint
// regions for plain and epoch-tagged words so that stale bytes of one format
// can never validate as the other.
// ---------------------------------------------------------------------------
struct Control {
  // Read by every block at kernel start (one 16-byte load each).
  uint32_t failed;       // set by any rank that timed out: all ranks fail fast
  uint32_t skew_max_ns;  // testing.inject_skew: random wait before each call
  uint32_t skew_seed;
  uint32_t drop;         // testing.drop_rank: this rank skips its all-reduces
  // Read when a speculative read comes back stale.
  uint32_t poll_depth;   // sifar: polling loads kept in flight per peer line (1..kMaxPollDepth)
  uint32_t poll_gap_ns;  // sifar: spacing between those loads
  uint32_t error_claimed;  // the first failing thread of this rank wins it
  uint32_t pad0;
  uint64_t timeout_ns;   // bound on every spin
  uint64_t pad[3];
};
constexpr uint32_t kMaxPollDepth = 4;
constexpr uint32_t kDefaultPollDepth = 1;
constexpr uint32_t kDefaultPollGapNs = 0;
static_assert(sizeof(Control) == 64, "Control is one cache-line-sized record");

// A failure description, written once per rank by its first thread that
// times out: it wins Control::error_claimed, fills the fields, then
// publishes `failed`.  Host-visible memory: the host reads it without a copy.
struct ErrorRecord {
  uint32_t failed;
  int32_t algorithm;
  int32_t rank;
  int32_t peer;  // the rank that never arrived (-1 if unknown)
  uint32_t epoch;
  int32_t block;
  uint32_t pad[2];
};

enum StatField { kCalls = 0, kRetries = 1, kTimeouts = 2, kNumStats = 3 };

// Epoch-tagged words of one source rank: sifar (pull) reads them from the
// source's own slot, sifar_push writes them into every destination's slot.
SIFAR_HD size_t LLRegionBytes(size_t slot_bytes) { return 2 * slot_bytes; }

struct SlotLayout {
  size_t slot_bytes;  // max payload bytes
  size_t plain, tmp, ll, flags, total;
};

SIFAR_HD SlotLayout MakeSlotLayout(size_t slot_bytes) {
  SlotLayout s{};
  s.slot_bytes = slot_bytes;
  size_t off = 0;
  s.plain = off;
  off = AlignUp(off + slot_bytes, kAlign);
  s.tmp = off;  // twoshot: this rank's reduced piece, gathered by the peers
  off = AlignUp(off + slot_bytes, kAlign);
  s.ll = off;  // [source rank][2x payload]: every 4 payload bytes travel with a 4-byte epoch
  off = AlignUp(off + kMaxRanks * LLRegionBytes(slot_bytes), kAlign);
  s.flags = off;  // sifar_flag: per-block validation word
  off = AlignUp(off + kMaxBlocks * sizeof(uint32_t), kAlign);
  s.total = off;
  return s;
}

struct WorkspaceLayout {
  SlotLayout slot;
  size_t control, epochs, barrier, stats, slots, total;
};

SIFAR_HD WorkspaceLayout MakeWorkspaceLayout(size_t slot_bytes) {
  WorkspaceLayout w{};
  w.slot = MakeSlotLayout(slot_bytes);
  size_t off = 0;
  w.control = off;
  off = AlignUp(off + sizeof(Control), kAlign);
  w.epochs = off;
  off = AlignUp(off + kMaxBlocks * sizeof(uint32_t), kAlign);
  w.barrier = off;
  off = AlignUp(off + kMaxBlocks * kMaxRanks * sizeof(uint32_t), kAlign);
  w.stats = off;
  off = AlignUp(off + kNumAlgorithms * kNumStats * sizeof(unsigned long long), kAlign);
  w.slots = off;
  off += 2 * w.slot.total;
  w.total = AlignUp(off, kAlign);
  return w;
}

// Deterministic per-(seed, rank, epoch) skew so every backend injects the same
// kind of disorder; splitmix-style mixing.
SIFAR_HD uint32_t SkewNs(uint32_t max_ns, uint32_t seed, int rank, uint32_t epoch) {
  if (max_ns == 0) return 0;
  uint64_t z = (static_cast<uint64_t>(seed) << 40) ^ (static_cast<uint64_t>(rank) << 32) ^ epoch;
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<uint32_t>(z % (static_cast<uint64_t>(max_ns) + 1));
}

}  // namespace sifar
