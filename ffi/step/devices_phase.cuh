// The all-reduce of the persistent step across devices (llama_step_tp.h) as a phase of the
// kernel: the rank's o and down partials are published to the communicator's memory, where
// every block of every rank reads them (the peers' through P2P / IPC pointers), reduces the
// whole vector itself, adds it to the residual stream and stages the next projection's normed
// input (allreduce_phase.cuh's ArReduce, with the peers' words in place of the virtual ranks').
//
// Phase k of a launch is the next epoch e of the communicator's lane (protocol.h): block 0
// alone reads the rank's Control and the lane's epochs at the start of the launch and decides
// for the whole grid (the launch words, read by the other blocks after the first grid
// barriers): where the step begins (protocol block 0's epoch, or two past it with barriers
// across the ranks first where other protocol blocks lag: lane_start.h), and whether this rank
// takes part at all (a failed communicator, testing.drop_rank: every block then runs the step
// without publishing, waiting or accepting a word, NaN, so every block still passes every grid
// barrier). Every block advances e alike, and block 0, once every block has finished its last
// phase, stores the last e into every protocol block's epoch (the lane's plain all-reduces go
// on from there).
//   sifar: row n's bf16 partial is the LL word PackLL(bits, Tag(chain, e)) at word n of the
//     rank's own tagged region of slot e & 1; a reader loads every rank's words of a quad at
//     once and re-reads only those whose tag is not exactly (chain, e). No flag, no barrier.
//   oneshot: the bf16 partials in the plain region of slot e & 1, a barrier across the ranks
//     before the reads (BarrierValue(e, top)) and one after (e, bottom).
// Barrier across the ranks (oneshot, and the tag wrap's two): every block arrives on the
// rank's arrival counter (release); block 0's thread 0, once all of the rank's blocks have
// arrived (acquire), stores the barrier word into every peer's workspace (release, system
// scope: cumulative over what it acquired); every block waits for the rank's blocks and every
// peer's word. Words of the plain all-reduces' format, so values only grow on each word.
// Memory order of the tagged words: a writer's fence.acq_rel.sys before it publishes, a
// reader's after its reads (fence-fence synchronisation through the word read), at system
// scope: the peers are other GPUs (sifar only: oneshot's barriers order its partials). Why
// slot e & 1 is free when phase e writes it, and why a stale or future word is never accepted,
// launch after launch: docs/step_across_devices.md.
// Every wait is bounded by the communicator's timeout (at most step::kMaxTimeoutNs, half the
// traps' bound); past it the block records the failure (the rank's error record, the phase in
// its `pad`; every rank's Control.failed; the step's status words), the missing values are
// NaN, and every later wait of the launch, on any rank, gives up at once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/protocol.h"
#include "step/allreduce_phase.cuh"
#include "step/device_math.cuh"
#include "step/lane_start.h"
#include "step/llama_step_tp.h"
#include "step/norm_phase.cuh"

namespace sifar {
namespace cuda {
namespace phase {

__device__ __forceinline__ void FenceAcqRelSys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ unsigned LoadRelaxedSys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void StoreRelaxedSys(unsigned* p, unsigned v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void LoadWordsSys(const uint64_t* p, uint64_t& a, uint64_t& b) {
  asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}
__device__ __forceinline__ uint2 LoadPlainSys(const uint16_t* p) {
  uint2 v;
  asm volatile("ld.relaxed.sys.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
  return v;
}

// The launch's words (Params::barriers, zeroed by the op; kDevices only): the grid barrier's
// counter, the arrivals at barriers across the ranks, the blocks done with their last phase,
// and block 0's decisions at the launch's start.
enum DevLaunchWord : int {
  kGridCounter = 0,
  kDevArrive = 1,
  kDevDone = 2,
  kDevStartFlags = 3,  // kStartValid | kStartOff | kStartBarrier | kStartClear
  kDevStartEpoch = 4,  // the epoch before phase 1
  kDevStartMask = 5,   // the tag's epoch bits
  kDevBarrierValue = 6,
  kDevClearValue = 7,
  kDevLaunchWords = 8
};
// The op's barrier area holds them (StepWorkspace: 256 bytes, whatever the ranks).
static_assert(kDevLaunchWords * sizeof(unsigned) <= 256, "the launch's words fit the barrier area");
enum DevStartFlag : unsigned { kStartValid = 1, kStartOff = 2, kStartBarrier = 4, kStartClear = 8 };

// What each block's thread 0 reads at the start of a launch (for the block's waits and skew;
// shared with the block through shared memory).
struct DevStart {
  unsigned skew_max, skew_seed;
  unsigned long long timeout_ns;
};

__device__ __forceinline__ void ReadDevStart(const step::StepComm& m, DevStart& s) {
  const Control* c = m.ctl[m.rank];
  s.skew_max = LoadRelaxedSys(&c->skew_max_ns);
  s.skew_seed = LoadRelaxedSys(&c->skew_seed);
  unsigned long long t;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(t) : "l"(&c->timeout_ns) : "memory");
  s.timeout_ns = t < static_cast<unsigned long long>(step::kMaxTimeoutNs)
                     ? t : static_cast<unsigned long long>(step::kMaxTimeoutNs);
}

// Block 0's thread 0, at the launch's start: the decisions every block takes (one decision
// for the grid: a block that read Control.failed on its own could leave the grid while the
// others wait at a grid barrier). Off: the communicator has failed, or testing.drop_rank
// (this rank never arrives). Else where the step begins on the lane (lane_start.h) from every
// protocol block's epoch. Stored before the block's first grid barrier (its release), read
// by every block after it (DevStartLane).
__device__ inline void DevDecide(const step::StepComm& m, int hidden, unsigned* words) {
  const Control* c = m.ctl[m.rank];
  const bool off = LoadRelaxedSys(&c->failed) || LoadRelaxedSys(&c->drop);
  const uint32_t mask = EpochMask(LoadRelaxedSys(&c->epoch_mask));
  // The epochs: nothing writes them before this launch's end (DevCommit, after every block's
  // last phase); the lane's earlier kernels and the host's writes precede it in stream order.
  const step::LaneStart ls = step::StepLaneStart(
      m.epochs, kMaxBlocks, step::StepBlocksWritten(hidden, m.algorithm), mask);
  words[kDevStartEpoch] = ls.epoch;
  words[kDevStartMask] = mask;
  words[kDevBarrierValue] = ls.barrier_value;
  words[kDevClearValue] = ls.clear_value;
  words[kDevStartFlags] = kStartValid | (off ? kStartOff : 0u) | (ls.barrier ? kStartBarrier : 0u) |
                          (ls.clear ? kStartClear : 0u);
}

// One block's view of the step's all-reduce across devices.
struct DevAr {
  const step::StepComm* m;  // the kernel parameter's (param space)
  unsigned* status;         // step::StepStatus (this launch's)
  unsigned* words;          // the launch's words (DevLaunchWord)
  int nb, b, hidden;
  unsigned epoch = 0, mask = kEpochTagMask, tag = 0, chain, skew_max, skew_seed;
  unsigned long long timeout_ns;
  unsigned rounds = 0;  // barriers across the ranks so far in this launch
  unsigned phases = 0;  // phases so far (k)
  // Block-uniform: this block publishes nothing, waits for nothing and takes no rank's word
  // in the rest of this launch (NaN):
  // block 0's decision (a failed or dropped rank), or a barrier of the launch's start or of a
  // wrap that failed (the clearing it guards did not happen).
  bool off = false;
};

// The first wait past the timeout records the failure: the step's status words, the rank's
// error record (once per rank: error_claimed), every rank's Control.failed (they give up).
__device__ inline void DevFail(const DevAr& a, unsigned k, int missing) {
  const step::StepComm& m = *a.m;
  if (atomicCAS(a.status + step::kFailed, 0u, 1u) == 0u) {  // once per rank and launch
    a.status[step::kFailedPhase] = k;
    a.status[step::kMissingRank] = static_cast<unsigned>(missing < 0 ? 0 : missing);
    a.status[step::kFailedBlock] = blockIdx.x;
    atomicAdd(m.stats + m.algorithm * kNumStats + kTimeouts, 1ull);
  }
  if (atomicCAS(&m.ctl[m.rank]->error_claimed, 0u, 1u) == 0u) {
    ErrorRecord* e = m.err;
    e->algorithm = m.algorithm;
    e->rank = m.rank;
    e->peer = missing;
    e->epoch = a.epoch;
    e->block = 0;  // the protocol block: the step's epochs are the lane's, block 0's (the
                   // grid's block, which may be >= kMaxBlocks, is the status's kFailedBlock)
    e->chain = m.chain;
    e->pad = k;  // the step's phase (sifar_jax.check() names it)
    __threadfence_system();
    StoreRelaxedSys(&e->failed, 1u);
  }
  for (int r = 0; r < m.nranks; ++r) StoreRelaxedSys(&m.ctl[r]->failed, 1u);
}

struct DevWait {
  unsigned n = 0;
  unsigned long long t0 = 0;
  // False: give up (this step failed, here, on another block, or on another rank).
  __device__ __forceinline__ bool Going(const DevAr& a, unsigned k, int missing) {
    if ((++n & 255u) != 0) return true;
    if (LoadRelaxed(a.status + step::kFailed) ||
        LoadRelaxedSys(&a.m->ctl[a.m->rank]->failed))
      return false;
    const unsigned long long t = GlobalNs();
    if (t0 == 0) t0 = t;
    else if (t - t0 > a.timeout_ns) {
      DevFail(a, k, missing);
      return false;
    }
    return true;
  }
};

// A barrier across the ranks at `value` (block-wide; see the header). False: the step failed.
__device__ inline bool DevBarrier(DevAr& a, uint32_t value, unsigned k, DevWait& w) {
  const step::StepComm& m = *a.m;
  const unsigned target = ++a.rounds * static_cast<unsigned>(a.nb);
  unsigned* arrive = a.words + kDevArrive;
  bool ok = true;
  BlockSync();  // the block's writes (or reads) are done before it arrives
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(arrive) : "memory");
    while (true) {
      unsigned v;
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(arrive) : "memory");
      if (v >= target) break;
      if (!w.Going(a, k, m.rank)) { ok = false; break; }
    }
    const uint32_t chain = ChainTag(m.chain);
    if (ok && a.b == 0)
      for (int p = 0; p < m.nranks; ++p)
        if (p != m.rank)
          asm volatile("st.release.sys.global.u64 [%0], %1;"
                       ::"l"(m.barrier[p] + m.rank), "l"(BarrierWord(chain, value)) : "memory");
    for (int p = 0; p < m.nranks && ok; ++p) {
      if (p == m.rank) continue;
      while (true) {
        uint64_t v;
        asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(m.barrier[m.rank] + p) : "memory");
        if (BarrierReached(v, chain, value)) break;
        if (!w.Going(a, k, p)) { ok = false; break; }
      }
    }
  }
  return !BlockAny(threadIdx.x == 0 && !ok);
}

// The whole tagged region of both slots of this rank (every source region) and the flags
// zeroed (this block's share), between barriers across the ranks at `before` and `after`
// (values no barrier of the lane has used yet): before the first, no rank has published
// anything of this phase; after the second, every rank has cleared. The release of the
// second barrier (BlockSync, the arrival's red.release, block 0's st.release.sys into every
// peer's word) orders the clearing before every later publication and read. A failed barrier
// leaves the block off. Block-wide.
__device__ inline void DevClearAcross(DevAr& a, uint32_t before, uint32_t after, unsigned k) {
  DevWait w;
  if (!DevBarrier(a, before, k, w)) {
    a.off = true;
    return;
  }
  const step::StepComm& m = *a.m;
  for (int parity = 0; parity < 2; ++parity) {
    uint64_t* ll = m.own_ll[parity];
    for (size_t i = static_cast<size_t>(a.b) * kThreads + threadIdx.x; 2 * i < m.ll_words;
         i += static_cast<size_t>(a.nb) * kThreads)
      asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};"
                   ::"l"(ll + 2 * i), "l"(0ull), "l"(0ull) : "memory");
    if (a.b == 0 && threadIdx.x < kMaxBlocks) StoreRelaxedSys(m.own_flags[parity] + threadIdx.x, 0u);
  }
  if (!DevBarrier(a, after, k, w)) a.off = true;
}

// Phase 1's start: block 0's decisions (DevDecide; the grid barriers since made them
// visible), then, where protocol blocks of the lane lag behind block 0 (lane_start.h), a
// barrier across the ranks (every peer has left the lane's earlier kernels, so no block of
// them still reads a slot this launch writes), with the clearing of the tagged words where a
// lagging block lies in an earlier tag cycle. Block-wide.
__device__ inline void DevStartLane(DevAr& a) {
  const unsigned flags = LoadRelaxed(a.words + kDevStartFlags);
  a.epoch = LoadRelaxed(a.words + kDevStartEpoch);
  a.mask = LoadRelaxed(a.words + kDevStartMask);
  a.off = !(flags & kStartValid) || (flags & kStartOff);
  if (a.off || !(flags & kStartBarrier)) return;
  const uint32_t before = LoadRelaxed(a.words + kDevBarrierValue);
  if (flags & kStartClear) {
    DevClearAcross(a, before, LoadRelaxed(a.words + kDevClearValue), 1);
  } else {
    DevWait w;
    if (!DevBarrier(a, before, 1, w)) a.off = true;
  }
}

// Phase k's start, before its partials are published: at k = 1 the launch's start
// (DevStartLane); the next epoch and its tag; at the tag wrap the rank's tagged words and
// flags of both slots zeroed between barriers across the ranks on the two skipped epochs'
// values (DevClearAcross); the injected skew (testing.inject_skew: per rank, epoch and
// block); sifar: the fence that orders the words this block read before (the earlier phases)
// before the words it writes now. Block-wide.
__device__ inline void DevBegin(DevAr& a, unsigned k) {
  if (k == 1) DevStartLane(a);
  const unsigned prev = a.epoch;
  a.epoch = NextEpoch(prev, a.mask);
  a.tag = Tag(a.chain, a.epoch, a.mask);
  a.phases = k;
  if (a.off) return;
  if (WrapsAt(prev, a.epoch))
    DevClearAcross(a, BarrierValue(a.epoch - 2, kTop), BarrierValue(a.epoch - 1, kTop), k);
  if (a.off) return;
  if (a.skew_max) {
    if (threadIdx.x == 0) {
      const unsigned long long d =
          SkewNs(a.skew_max, a.skew_seed ^ (static_cast<uint32_t>(a.b) * 0x9E3779B9u), a.m->rank,
                 a.epoch);
      const unsigned long long t0 = GlobalNs();
      while (GlobalNs() - t0 < d) __nanosleep(256);
    }
    BlockSync();
  }
  if (a.m->algorithm != kOneshot) FenceAcqRelSys();  // oneshot: its barriers order the slots
}

// This rank's partial of row n in the current phase (rounded to bf16).
__device__ __forceinline__ void DevPut(const DevAr& a, int n, float v) {
  if (a.off) return;  // this rank publishes nothing more
  const step::StepComm& m = *a.m;
  const uint32_t parity = SlotParity(a.epoch);
  const uint16_t bits = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  if (m.algorithm == kOneshot) {
    m.plain[parity][m.rank][n] = bits;  // ordered by the barrier's release
  } else {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;"
                 ::"l"(m.words[parity][m.rank] + n), "l"(PackLL(bits, a.tag)) : "memory");
  }
}

// ArReduce's phase across devices: every rank's partial of every row added in rank order in
// float32, rounded once, added to the residual stream `old`; xs <- the new stream's RMSNorm
// times `scale`; this block's quads [qlo, qhi) of the new stream to `out` (none: null); h (not
// null) <- the normed values as bf16. Block-wide.
__device__ inline void DevReduce(DevAr& a, const bf16* old, bf16* out, int qlo, int qhi,
                          const uint16_t* scale, float eps, float4* xs, float* red, bf16* h) {
  const step::StepComm& m = *a.m;
  const int H = a.hidden, R = m.nranks;
  const unsigned k = a.phases;
  const uint32_t parity = SlotParity(a.epoch), tag = a.tag;
  const bool oneshot = m.algorithm == kOneshot;
  bool dead = a.off, retried = false;
  DevWait wt;  // this thread's waits in this phase, together
  if (oneshot && !a.off) dead = !DevBarrier(a, BarrierValue(a.epoch, kTop), k, wt);
  else BlockSync();  // the GEMV's reads of xs are done
  float ss = 0.0f;
  for (int i = threadIdx.x; i < H / 4; i += kThreads) {
    const uint2 ov = __ldcg(reinterpret_cast<const uint2*>(old) + i);
    float acc[4];
#pragma unroll
    for (int p = 0; p < step::kMaxRanks; ++p) {
      if (p >= R) break;
      uint32_t u[4];
      if (oneshot) {
        const uint2 v = LoadPlainSys(m.plain[parity][p] + 4 * i);
        u[0] = v.x << 16, u[1] = v.x & 0xffff0000u, u[2] = v.y << 16, u[3] = v.y & 0xffff0000u;
      } else {
        const uint64_t* src = m.words[parity][p] + 4 * i;
        uint64_t w[4];
        LoadWordsSys(src, w[0], w[1]);
        LoadWordsSys(src + 2, w[2], w[3]);
        while (!dead && (LLTag(w[0]) != tag || LLTag(w[1]) != tag || LLTag(w[2]) != tag ||
                         LLTag(w[3]) != tag)) {
          retried = true;
          if (!wt.Going(a, k, p)) {
            dead = true;
          } else {
            LoadWordsSys(src, w[0], w[1]);
            LoadWordsSys(src + 2, w[2], w[3]);
          }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) u[j] = LLData(w[j]) << 16;
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float v = dead ? NAN : __uint_as_float(u[j]);
        acc[j] = p == 0 ? v : __fadd_rn(acc[j], v);
      }
    }
    const float e0[4] = {__uint_as_float(ov.x << 16), __uint_as_float(ov.x & 0xffff0000u),
                         __uint_as_float(ov.y << 16), __uint_as_float(ov.y & 0xffff0000u)};
    float e[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      e[j] = Rb(__fadd_rn(e0[j], Rb(acc[j])));
      ss = __fmaf_rn(e[j], e[j], ss);
    }
    xs[XQuad(i >> 2, i & 3)] = make_float4(e[0], e[1], e[2], e[3]);
    if (out && i >= qlo && i < qhi) {
      const uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(e[0])) |
                          (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(e[1]))) << 16);
      const uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(e[2])) |
                          (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(e[3]))) << 16);
      reinterpret_cast<uint2*>(out)[i] = make_uint2(lo, hi);
    }
  }
  if (!oneshot) FenceAcqRelSys();  // the words read here before this rank's later writes
  if (BlockAny(retried) && threadIdx.x == 0) {
    atomicAdd(a.status + step::kRetried, 1u);
    atomicAdd(m.stats + m.algorithm * kNumStats + kRetries, 1ull);
  }
  // oneshot: every rank done reading before the slot is written again; past the timeout a rank
  // may still read it, so this block's values become NaN too (through the norm).
  if (oneshot && !a.off && !DevBarrier(a, BarrierValue(a.epoch, kBottom), k, wt)) ss = NAN;
  const float inv = FinishRms(ss, H, eps, red);
  const bf16* sc = reinterpret_cast<const bf16*>(scale);
  for (int i = threadIdx.x; i < H / 4; i += kThreads) {
    float4& q = xs[XQuad(i >> 2, i & 3)];
    const float e[4] = {q.x, q.y, q.z, q.w};
    float y[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      y[j] = Rb(__fmul_rn(Rb(__fmul_rn(e[j], inv)), F(sc[4 * i + j])));
      if (h) h[4 * i + j] = __float2bfloat16_rn(y[j]);
    }
    q = make_float4(y[0], y[1], y[2], y[3]);
  }
  BlockSync();
}

// After the last phase, every block: its arrival on the launch's kDevDone (release: its
// failures, in the status words, before it); then block 0's thread 0, once every block has
// arrived (acquire), stores every protocol block's epoch of the lane and the lane's call
// count, unless the step failed on any block, or this rank was off (a failed communicator is
// re-initialised, its epochs zeroed, before anything uses them again).
__device__ inline void DevCommit(const DevAr& a, uint64_t calls) {
  BlockSync();  // the block's phases (and the head) are done
  if (threadIdx.x != 0) return;
  unsigned* done = a.words + kDevDone;
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(done) : "memory");
  if (a.b != 0) return;
  Deadline d;
  while (true) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(done) : "memory");
    if (v >= static_cast<unsigned>(a.nb)) break;
    d.Tick();
  }
  const step::StepComm& m = *a.m;
  if (a.off || a.phases == 0 || LoadRelaxed(a.status + step::kFailed) ||
      LoadRelaxedSys(&m.ctl[m.rank]->failed))
    return;
  for (int blk = 0; blk < kMaxBlocks; ++blk) m.epochs[blk] = a.epoch;
  m.calls[m.algorithm] = calls + a.phases;
}

}  // namespace phase
}  // namespace cuda
}  // namespace sifar
