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

// The one list of algorithms.  Everything else is generated from it: the enum,
// the names, the CUDA launch and preload tables and kernel bodies, the CPU
// dispatch, and the Python ids (sifar_jax.algorithms reads them from the extension).
//
//   X(enum, id, name, line_bytes, tagged, exact, portable, description)
//   line_bytes  payload bytes one thread moves per line (8: an LL line of two
//               tagged 8-byte words; 16: a plain 16-byte line)
//   tagged      epoch-tagged (LL) words: validity travels with the data
//   exact       correct by construction under the PTX memory model; "auto"
//               only ever picks an exact algorithm
//   portable    has a CPU and a CUDA kernel (multicast needs NVSwitch)
#define SIFAR_ALGORITHMS(X)                                                                    \
  X(kOneshot, 0, "oneshot", 16, false, true, true,                                             \
    "top barrier, pull-reduce, bottom barrier")                                                \
  X(kTwoshot, 1, "twoshot", 16, false, true, true,                                             \
    "top barrier, reduce-scatter, mid barrier, all-gather, bottom barrier")                    \
  X(kOneshotDB, 2, "oneshot_db", 16, false, true, true,                                        \
    "dual buffering: top barrier, pull-reduce, no bottom barrier")                             \
  X(kSifarFlag, 3, "sifar_flag", 16, false, true, true,                                        \
    "dual buffering + speculative pull validated by a per-block flag (the paper; flags "      \
    "acquired before the payload)")                                                            \
  X(kSifar, 4, "sifar", 8, true, true, true,                                                   \
    "dual buffering + speculative pull of epoch-tagged words (default)")                       \
  X(kMulticast, 5, "multicast", 16, false, false, false,                                       \
    "redundant pull with NVLink multicast multimem.ld_reduce, flag-validated (the paper; "    \
    "opt-in, GPU only, not correct by construction)")                                          \
  X(kSifarPush, 6, "sifar_push", 8, true, true, true,                                          \
    "sifar with the tagged words pushed to the peers and polled locally")

enum Algorithm : int32_t {
#define SIFAR_ALG_ENUM(e, id, ...) e = id,
  SIFAR_ALGORITHMS(SIFAR_ALG_ENUM)
#undef SIFAR_ALG_ENUM
};
#define SIFAR_ALG_COUNT(...) +1
constexpr int kNumAlgorithms = 0 SIFAR_ALGORITHMS(SIFAR_ALG_COUNT);
#undef SIFAR_ALG_COUNT

struct AlgorithmInfo {
  int32_t id;
  const char* name;
  int line_bytes;
  bool tagged, exact, portable;
  const char* description;
};
constexpr AlgorithmInfo kAlgorithms[] = {
#define SIFAR_ALG_INFO(e, id, name, line, tagged, exact, portable, desc) \
  {id, name, line, tagged, exact, portable, desc},
    SIFAR_ALGORITHMS(SIFAR_ALG_INFO)
#undef SIFAR_ALG_INFO
};
static_assert(sizeof(kAlgorithms) / sizeof(kAlgorithms[0]) == kNumAlgorithms, "one row per id");
SIFAR_HD constexpr bool ValidAlgorithm(int a) { return a >= 0 && a < kNumAlgorithms; }
// Per-id properties as expressions (usable in device code and constant expressions).
#define SIFAR_ALG_TAGGED(e, id, name, line, tagged, ...) (a == id && tagged) ||
SIFAR_HD constexpr bool TaggedAlgorithm(int a) { return SIFAR_ALGORITHMS(SIFAR_ALG_TAGGED) false; }
#undef SIFAR_ALG_TAGGED
#define SIFAR_ALG_LINE(e, id, name, line, ...) a == id ? line:
SIFAR_HD constexpr int LineBytes(int a) { return SIFAR_ALGORITHMS(SIFAR_ALG_LINE) 16; }
#undef SIFAR_ALG_LINE
#define SIFAR_ALG_PORTABLE(e, id, name, line, tagged, exact, portable, ...) (a == id && portable) ||
SIFAR_HD constexpr bool PortableAlgorithm(int a) { return SIFAR_ALGORITHMS(SIFAR_ALG_PORTABLE) false; }
#undef SIFAR_ALG_PORTABLE
// An algorithm as a type: each backend defines one body per portable
// algorithm as an overload on it (Body(Alg<kSifar>, ...)), and its dispatch,
// generated from the table, names them; a portable row without a body does
// not compile.
template <int ALG>
struct Alg {
  static constexpr int kId = ALG;
};

constexpr int kMaxRanks = 8;
// Thread blocks of one all-reduce.  Every block keeps its own epoch, and a line
// of the payload always belongs to the same block (see BlockOfLine), so the
// dual-buffering argument holds per block without any grid-wide sync.
constexpr int kMaxBlocks = 64;
constexpr size_t kAlign = 256;

SIFAR_HD size_t AlignUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

// ---------------------------------------------------------------------------
// Epoch-tagged words (NCCL's LL format): 4 bytes of payload + a 4-byte tag,
// stored and loaded as ONE aligned 8-byte access, so a reader either sees the
// whole word of the call it expects or knows it is stale.  Validity travels
// with the data.  The tag is (chain, epoch): 8 bits of the call chain
// (docs/design.md, "Ordering") over the low bits of the epoch, so calls of
// two chains never accept each other's words.
// ---------------------------------------------------------------------------
SIFAR_HD uint64_t PackLL(uint32_t data, uint32_t tag) {
  return (static_cast<uint64_t>(tag) << 32) | data;
}
SIFAR_HD uint32_t LLData(uint64_t w) { return static_cast<uint32_t>(w); }
SIFAR_HD uint32_t LLTag(uint64_t w) { return static_cast<uint32_t>(w >> 32); }

// The epoch bits a tag carries.  A communicator may use fewer (Control::
// epoch_mask, a testing knob that makes the wrap cheap to reach).
constexpr uint32_t kEpochTagBits = 24;
constexpr uint32_t kEpochTagMask = (1u << kEpochTagBits) - 1;
SIFAR_HD uint32_t EpochMask(uint32_t control_mask) {
  return control_mask != 0 && control_mask <= kEpochTagMask ? control_mask : kEpochTagMask;
}
SIFAR_HD uint32_t Tag(uint32_t chain, uint32_t epoch, uint32_t mask) {
  return (chain << kEpochTagBits) | (epoch & mask);
}

// Epochs count a block's all-reduces (per lane).  An epoch whose tag bits are
// 0 is skipped, together with the next one so the slot parity keeps
// alternating: 0 is the tag of never-written words.  Crossing that point is
// the tag's wrap: old words could match again, so the ranks clear their tagged
// words first (WrapsAt, docs/design.md "Epochs and wrap").
SIFAR_HD uint32_t NextEpoch(uint32_t e, uint32_t mask) {
  const uint32_t n = e + 1;
  return (n & mask) == 0 ? n + 2 : n;
}
SIFAR_HD bool WrapsAt(uint32_t prev, uint32_t next) { return next - prev != 1; }

// Barrier flag values: monotonic in (epoch, phase) modulo 2^32, so a waiter
// tests "reached" with a wrap-safe difference and no flag is ever reset (no
// ABA between consecutive all-reduces; peers are never 2^31 phases apart).
// The two epochs a wrap skips give the clearing its two barriers.
enum BarrierPhase : uint32_t { kTop = 1, kMid = 2, kBottom = 3 };
SIFAR_HD uint32_t BarrierValue(uint32_t epoch, uint32_t phase) { return epoch * 4u + phase; }
SIFAR_HD bool Reached(uint32_t seen, uint32_t wanted) {
  return static_cast<int32_t>(seen - wanted) >= 0;
}
// A barrier word carries the writer's chain beside the value.  A waiter
// accepts a value past the one it wants (the peer already went on, which it
// could only do after checking this rank's word at equality), or exactly the
// one it wants from the same chain; so for every pair of ranks at least one
// side compares chains, and two chains never pass a barrier together
// unnoticed: the side that sees the mismatch times out and fails the group.
SIFAR_HD uint64_t BarrierWord(uint32_t chain, uint32_t value) {
  return (static_cast<uint64_t>(chain) << 32) | value;
}
SIFAR_HD bool BarrierReached(uint64_t seen, uint32_t chain, uint32_t wanted) {
  const int32_t d = static_cast<int32_t>(static_cast<uint32_t>(seen) - wanted);
  return d > 0 || (d == 0 && static_cast<uint32_t>(seen >> 32) == chain);
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

// Lines one block of the portable kernels owns (one per thread).
constexpr int kLinesPerBlock = 256;

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
//   Control        written by the host one field at a time; `failed` and
//                  `error_claimed` only by kernels
//   stats          [algorithm][calls, retries, timeouts], local only (the
//                  portable kernels count calls in their lanes instead)
//   trace          per-call records (testing/benchmarks), local only
//   Lane[lanes]    one per call chain slot (docs/design.md, "Ordering"):
//     epochs       per-block epoch counters, local only
//     calls        [algorithm] calls completed on this lane, written by block
//                  0 with its epoch (no atomic on the fast path); the host
//                  adds them to stats
//     barrier      [block][peer] arrival words (BarrierWord), written by the peers
//     Slot[2]      the dual payload buffers (or user-registered buffers)
//
// A Slot holds every payload region an algorithm may use, with disjoint
// regions for plain and epoch-tagged words so that stale bytes of one format
// can never validate as the other.
// ---------------------------------------------------------------------------
struct Control {
  // Read by every block at kernel start (two 16-byte loads by one thread).
  uint32_t failed;       // set by any rank that timed out: all ranks fail fast
  uint32_t skew_max_ns;  // testing.inject_skew: random wait before each call
  uint32_t skew_seed;
  uint32_t drop;         // testing.drop_rank: blocks >= drop-1 of this rank skip (0: none)
  uint32_t unused[2];    // keeps trace and epoch_mask where the start's second load reads them
  uint32_t trace;        // nonzero: record every call in the trace ring
  uint32_t epoch_mask;   // tag epoch bits (0: kEpochTagMask); testing only
  uint64_t timeout_ns;   // bound on every spin
  uint32_t error_claimed;  // the first failing thread of this rank wins it
  uint32_t pad0;
  uint64_t pad[2];
};
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
  uint32_t chain;
  uint32_t pad;
};

enum StatField { kCalls = 0, kRetries = 1, kTimeouts = 2, kNumStats = 3 };

// One record per call (block 0's view; `retried`: its warp 0's), in a ring of kTraceCapacity, when
// Control::trace is set: device %globaltimer (or host steady clock) times.
struct TraceRecord {
  uint64_t start_ns, end_ns;
  uint32_t epoch, chain;
  int32_t algorithm;
  uint32_t retried;  // block 0 re-read at least one stale word / flag
};
constexpr uint32_t kTraceCapacity = 4096;
struct TraceRing {
  unsigned long long next;  // records written so far (the ring index is next % capacity)
  unsigned long long pad;
  TraceRecord records[kTraceCapacity];
};

// Epoch-tagged words of one source rank: sifar (pull) reads them from the
// source's own slot, sifar_push writes them into every destination's slot.
SIFAR_HD size_t LLRegionBytes(size_t slot_bytes) { return 2 * slot_bytes; }

struct SlotLayout {
  size_t slot_bytes;  // max payload bytes
  size_t plain, tmp, ll, flags, total;
};

SIFAR_HD SlotLayout MakeSlotLayout(size_t slot_bytes, int nranks) {
  SlotLayout s{};
  s.slot_bytes = slot_bytes;
  size_t off = 0;
  s.plain = off;
  off = AlignUp(off + slot_bytes, kAlign);
  s.tmp = off;  // twoshot: this rank's reduced piece, gathered by the peers
  off = AlignUp(off + slot_bytes, kAlign);
  s.ll = off;  // [source rank][2x payload]: every 4 payload bytes travel with a 4-byte tag
  off = AlignUp(off + static_cast<size_t>(nranks) * LLRegionBytes(slot_bytes), kAlign);
  s.flags = off;  // sifar_flag: per-block validation word
  off = AlignUp(off + kMaxBlocks * sizeof(uint32_t), kAlign);
  s.total = off;
  return s;
}

struct LaneLayout {
  size_t epochs, calls, barrier, slots, total;  // offsets within a lane
};

struct WorkspaceLayout {
  SlotLayout slot;
  LaneLayout lane;
  int lanes;
  size_t control, stats, trace, lanes_at, total;
  // Lane 0's epochs (the multicast kernel keeps its epochs there).
  size_t epochs;
  SIFAR_HD size_t LaneAt(int l) const { return lanes_at + static_cast<size_t>(l) * lane.total; }
};

SIFAR_HD WorkspaceLayout MakeWorkspaceLayout(size_t slot_bytes, int nranks, int lanes) {
  WorkspaceLayout w{};
  w.slot = MakeSlotLayout(slot_bytes, nranks);
  w.lanes = lanes;
  size_t off = 0;
  w.lane.epochs = off;
  off = AlignUp(off + kMaxBlocks * sizeof(uint32_t), kAlign);
  w.lane.calls = off;
  off = AlignUp(off + kNumAlgorithms * sizeof(uint64_t), kAlign);
  w.lane.barrier = off;
  off = AlignUp(off + kMaxBlocks * kMaxRanks * sizeof(uint64_t), kAlign);
  w.lane.slots = off;
  off += 2 * w.slot.total;
  w.lane.total = AlignUp(off, kAlign);
  off = 0;
  w.control = off;
  off = AlignUp(off + sizeof(Control), kAlign);
  w.stats = off;
  off = AlignUp(off + kNumAlgorithms * kNumStats * sizeof(unsigned long long), kAlign);
  w.trace = off;
  off = AlignUp(off + sizeof(TraceRing), kAlign);
  w.lanes_at = off;
  off += static_cast<size_t>(lanes) * w.lane.total;
  w.total = AlignUp(off, kAlign);
  w.epochs = w.lanes_at + w.lane.epochs;
  return w;
}

// The lane a call chain runs on, and the chain bits its tags carry.
SIFAR_HD int LaneOf(uint32_t chain, int lanes) { return static_cast<int>(chain % lanes); }
SIFAR_HD uint32_t ChainTag(uint32_t chain) { return chain & 0xffu; }

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
