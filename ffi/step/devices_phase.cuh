// The all-reduce of the persistent step across devices (llama_step_tp.h) as a phase of the
// kernel: the rank's o and down partials are published to the communicator's memory, where
// every block of every rank reads them (the peers' through P2P / IPC pointers), reduces the
// whole vector itself, adds it to the residual stream and stages the next projection's normed
// input (allreduce_phase.cuh's ArReduce, with the peers' words in place of the virtual ranks').
//
// Phase k of a launch is the next epoch e of the communicator's lane (protocol.h): every
// block reads the lane's epoch (protocol block 0's) and the rank's Control at the start of
// the launch and advances e alike, and block 0 stores the last e into every protocol block's
// epoch at the end (the lane's plain all-reduces go on from there).
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
// scope: the peers are other GPUs (sifar only: oneshot's barriers order its partials). Why slot e & 1 is free when phase e writes it, and why a
// stale or future word is never accepted, launch after launch: docs/step_across_devices.md.
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

// What the rank's blocks read at the start of a launch (thread 0 of each; shared with the
// block through shared memory, so the whole block takes one decision).
struct DevStart {
  unsigned failed, drop, skew_max, skew_seed, mask, epoch;
  unsigned long long timeout_ns;
};

__device__ __forceinline__ void ReadDevStart(const step::StepComm& m, DevStart& s) {
  const Control* c = m.ctl[m.rank];
  s.failed = LoadRelaxedSys(&c->failed);
  s.drop = LoadRelaxedSys(&c->drop);
  s.skew_max = LoadRelaxedSys(&c->skew_max_ns);
  s.skew_seed = LoadRelaxedSys(&c->skew_seed);
  s.mask = EpochMask(LoadRelaxedSys(&c->epoch_mask));
  unsigned long long t;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(t) : "l"(&c->timeout_ns) : "memory");
  s.timeout_ns = t < static_cast<unsigned long long>(step::kMaxTimeoutNs)
                     ? t : static_cast<unsigned long long>(step::kMaxTimeoutNs);
  s.epoch = LoadRelaxedSys(m.epochs);  // protocol block 0's: every call of the lane has one
}

// One block's view of the step's all-reduce across devices.
struct DevAr {
  const step::StepComm* m;  // the kernel parameter's (param space)
  unsigned* status;         // step::StepStatus (this launch's)
  unsigned* arrive;         // the rank's arrivals at barriers across the ranks (this launch's)
  int nb, b, hidden;
  unsigned epoch, mask, tag, chain, skew_max, skew_seed;
  unsigned long long timeout_ns;
  unsigned rounds = 0;  // barriers across the ranks so far in this launch
  unsigned phases = 0;  // phases so far (k)
};

// The first wait past the timeout records the failure: the step's status words, the rank's
// error record (once per rank: error_claimed), every rank's Control.failed (they give up).
__device__ void DevFail(const DevAr& a, unsigned k, int missing) {
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
__device__ bool DevBarrier(DevAr& a, uint32_t value, unsigned k, DevWait& w) {
  const step::StepComm& m = *a.m;
  const unsigned target = ++a.rounds * static_cast<unsigned>(a.nb);
  bool ok = true;
  BlockSync();  // the block's writes (or reads) are done before it arrives
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(a.arrive) : "memory");
    while (true) {
      unsigned v;
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(a.arrive) : "memory");
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

// Phase k's start, before its partials are published: the next epoch and its tag; at the tag
// wrap the rank's tagged words and flags of both slots zeroed (this block's share of them)
// between barriers across the ranks on the two skipped epochs' values; the injected skew
// (testing.inject_skew: per rank, epoch and block); sifar: the fence that orders the words
// this block read before (the earlier phases) before the words it writes now. Block-wide.
__device__ void DevBegin(DevAr& a, unsigned k) {
  const unsigned prev = a.epoch;
  a.epoch = NextEpoch(prev, a.mask);
  a.tag = Tag(a.chain, a.epoch, a.mask);
  a.phases = k;
  if (WrapsAt(prev, a.epoch)) {
    DevWait w;
    if (DevBarrier(a, BarrierValue(a.epoch - 2, kTop), k, w)) {
      const step::StepComm& m = *a.m;
      for (int parity = 0; parity < 2; ++parity) {
        uint64_t* ll = m.own_ll[parity];
        for (size_t i = static_cast<size_t>(a.b) * kThreads + threadIdx.x; 2 * i < m.ll_words;
             i += static_cast<size_t>(a.nb) * kThreads)
          asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};"
                       ::"l"(ll + 2 * i), "l"(0ull), "l"(0ull) : "memory");
        if (a.b == 0 && threadIdx.x < kMaxBlocks) StoreRelaxedSys(m.own_flags[parity] + threadIdx.x, 0u);
      }
      // The barrier's release (BlockSync, the arrival's red.release, block 0's
      // st.release.sys into every peer's word) orders the clearing before what follows it.
      DevBarrier(a, BarrierValue(a.epoch - 1, kTop), k, w);
    }
  }
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
__device__ void DevReduce(DevAr& a, const bf16* old, bf16* out, int qlo, int qhi,
                          const uint16_t* scale, float eps, float4* xs, float* red, bf16* h) {
  const step::StepComm& m = *a.m;
  const int H = a.hidden, R = m.nranks;
  const unsigned k = a.phases;
  const uint32_t parity = SlotParity(a.epoch), tag = a.tag;
  const bool oneshot = m.algorithm == kOneshot;
  bool dead = false, retried = false;
  DevWait wt;  // this thread's waits in this phase, together
  if (oneshot) dead = !DevBarrier(a, BarrierValue(a.epoch, kTop), k, wt);
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
  if (oneshot && !DevBarrier(a, BarrierValue(a.epoch, kBottom), k, wt)) ss = NAN;
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

// After the last phase, block 0's thread 0: every protocol block's epoch of the lane and the
// lane's call count, unless the step failed (a failed communicator is re-initialised, its
// epochs zeroed, before anything uses them again).
__device__ void DevCommit(const DevAr& a, uint64_t calls) {
  if (a.b != 0 || threadIdx.x != 0) return;
  const step::StepComm& m = *a.m;
  if (LoadRelaxed(a.status + step::kFailed) || LoadRelaxedSys(&m.ctl[m.rank]->failed)) return;
  for (int blk = 0; blk < kMaxBlocks; ++blk) m.epochs[blk] = a.epoch;
  m.calls[m.algorithm] = calls + a.phases;
}

}  // namespace phase
}  // namespace cuda
}  // namespace sifar
