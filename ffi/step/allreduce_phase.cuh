// The all-reduce of the persistent step's virtual ranks (llama_step.h) as a phase of the
// kernel: the o and down projections of each rank publish their bf16 partials, and every block
// of every rank reduces the whole vector itself (a redundant pull: each block needs all of it
// for the next norm), adds it to the residual stream and stages the next projection's normed
// input, in place of the grid barrier that follows a projection at TP=1.
//
// sifar: a partial is a tagged word, (phase k << 16) | bf16 bits, in one of two buffers (phase
// k uses buffer k & 1: dual buffering). A reader loads every rank's words at once and re-reads
// only those whose tag is not k yet (speculation, validated per word): no flag, no barrier
// across the ranks. Buffer k & 1 is written again at phase k + 2 only: its writer has read
// phase k + 1's words of every rank, which each rank publishes after a barrier of its own
// blocks that every reader of phase k passed after reading (one GEMV phase lies between two
// all-reduces). Fences order it: a writer's fence.acq_rel before it publishes, a reader's
// after it read (fence-fence synchronisation through the word it read).
// oneshot (the baseline): the same words in one buffer, barriers across the ranks (every
// block of every rank arrives) before the reads and after them.
// Every wait is bounded by timeout_ns (a thread's waits of one phase together; at most half of
// the traps' kWaitNs, so that the producer warp, which waits for the consumers to free its
// ring, never traps first): past it the step fails (the status words, StepStatus, are what
// says so), the missing values are NaN, and every later wait of the launch gives up at once.
// A failure before the last phase spreads NaN to h and every logit; in the last phase only to
// what the failing blocks compute.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "step/device_math.cuh"
#include "step/norm_phase.cuh"

namespace sifar {
namespace cuda {
namespace phase {

struct ArCtx {
  uint32_t* words;    // [2][ranks][hidden] tagged words (zeroed by the op)
  unsigned* status;   // step::StepStatus
  unsigned* arrive;   // [ranks] oneshot's arrivals, per rank
  int ranks, rank, nb, hidden, oneshot, absent;
  long long timeout_ns, skew_ns;
};

__device__ __forceinline__ void FenceAcqRel() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

__device__ __forceinline__ unsigned LoadRelaxed(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint4 LoadWords(const uint32_t* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

// Phase k's buffer of rank p.
__device__ __forceinline__ uint32_t* ArWords(const ArCtx& a, unsigned k, int p) {
  return a.words + (static_cast<size_t>(a.oneshot ? 0 : (k & 1)) * a.ranks + p) * a.hidden;
}

// This rank's partial of row n in phase k (rounded to bf16).
__device__ __forceinline__ void ArPut(const ArCtx& a, unsigned k, int n, float v) {
  if (a.rank == a.absent) return;  // tests: a rank that never publishes
  const uint32_t w = (k << 16) | __bfloat16_as_ushort(__float2bfloat16_rn(v));
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(ArWords(a, k, a.rank) + n), "r"(w)
               : "memory");
}

// The first wait past the timeout records the failure; every wait gives up once one has.
__device__ inline void ArFail(const ArCtx& a, unsigned k, int missing) {
  if (atomicCAS(a.status + step::kFailed, 0u, 1u) == 0u) {
    a.status[step::kFailedPhase] = k;
    a.status[step::kMissingRank] = static_cast<unsigned>(missing);
    a.status[step::kFailedBlock] = blockIdx.x;
  }
}
struct ArWait {
  unsigned n = 0;
  unsigned long long t0 = 0;
  // False: give up (the step failed, here or elsewhere).
  __device__ __forceinline__ bool Going(const ArCtx& a, unsigned k, int missing) {
    if ((++n & 255u) != 0) return true;
    if (LoadRelaxed(a.status + step::kFailed)) return false;
    const unsigned long long t = GlobalNs();
    if (t0 == 0) t0 = t;
    else if (t - t0 > static_cast<unsigned long long>(a.timeout_ns)) {
      ArFail(a, k, missing);
      return false;
    }
    return true;
  }
};

// Tests: the block sleeps a pseudo-random time below skew_ns before phase k's partials (a hash
// of the block, the phase and the clock: every launch, rank and block its own skew).
__device__ inline void Skew(const ArCtx& a, unsigned k) {
  if (a.skew_ns <= 0) return;
  if (threadIdx.x == 0) {
    const unsigned long long t0 = GlobalNs();
    uint32_t h = static_cast<uint32_t>(t0 >> 6) ^ (blockIdx.x * 0x9E3779B9u) ^ (k * 0x85EBCA6Bu);
    h ^= h >> 16, h *= 0x7feb352du, h ^= h >> 15, h *= 0x846ca68bu, h ^= h >> 16;
    const unsigned long long d = h % static_cast<unsigned long long>(a.skew_ns);
    while (GlobalNs() - t0 < d) __nanosleep(256);
  }
  BlockSync();
}

// Whether any consumer thread of the block passes true (a block barrier too).
__device__ __forceinline__ bool BlockAny(bool v) {
  unsigned r;
  asm volatile("{ .reg .pred p, q; setp.ne.u32 q, %1, 0; bar.red.or.pred p, 1, %2, q; selp.u32 %0, 1, 0, p; }"
               : "=r"(r) : "r"(static_cast<unsigned>(v)), "n"(kThreads) : "memory");
  return r != 0;
}

// oneshot's barrier across the ranks: every block of every rank has arrived `round` times
// (the block's writes before it visible after it). False: the step failed. w: thread 0's wait
// clock of this phase (both barriers of a phase share it).
__device__ inline bool CrossBarrier(const ArCtx& a, unsigned round, unsigned k, ArWait& w) {
  bool ok = true;
  BlockSync();  // the block's writes (or reads) are done before it arrives
  if (threadIdx.x == 0) {
    if (a.rank != a.absent)  // a release, cumulative over the block's writes through the barrier
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(a.arrive + a.rank) : "memory");
    const unsigned target = round * static_cast<unsigned>(a.nb);
    for (int p = 0; p < a.ranks && ok; ++p) {
      while (true) {
        unsigned v;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(a.arrive + p) : "memory");
        if (v >= target) break;
        if (!w.Going(a, k, p)) { ok = false; break; }
      }
    }
  }
  return !BlockAny(threadIdx.x == 0 && !ok);
}

// Phase k: every rank's partial of every row added in rank order in float32, rounded once,
// added to the residual stream `old` (bf16 [hidden]); xs <- the new stream's RMSNorm times
// `scale` (StageNorm's values); this block's quads [qlo, qhi) of the new stream to `out`
// (none: null); h (not null) <- the normed values as bf16. Block-wide.
__device__ inline void ArReduce(const ArCtx& a, unsigned k, const bf16* old, bf16* out, int qlo,
                         int qhi, const uint16_t* scale, float eps, float4* xs, float* red,
                         bf16* h) {
  const int H = a.hidden, R = a.ranks;
  bool dead = false, retried = false;
  ArWait wt;  // this thread's waits in this phase, together
  if (a.oneshot) dead = !CrossBarrier(a, 2 * k - 1, k, wt);  // every rank's partials written
  else BlockSync();  // the GEMV's reads of xs are done
  float ss = 0.0f;
  for (int i = threadIdx.x; i < H / 4; i += kThreads) {
    const uint2 ov = __ldcg(reinterpret_cast<const uint2*>(old) + i);
    uint4 w[step::kMaxRanks];
#pragma unroll
    for (int p = 0; p < step::kMaxRanks; ++p)
      if (p < R) w[p] = LoadWords(ArWords(a, k, p) + 4 * i);
    float acc[4];
#pragma unroll
    for (int p = 0; p < step::kMaxRanks; ++p) {
      if (p >= R) break;
      if (!a.oneshot) {
        while (!dead && ((w[p].x >> 16) != k || (w[p].y >> 16) != k || (w[p].z >> 16) != k ||
                         (w[p].w >> 16) != k)) {
          retried = true;
          if (!wt.Going(a, k, p)) dead = true;
          else w[p] = LoadWords(ArWords(a, k, p) + 4 * i);
        }
      }
      const uint32_t u[4] = {w[p].x, w[p].y, w[p].z, w[p].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float v = dead ? NAN : __uint_as_float(u[j] << 16);
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
  FenceAcqRel();  // the words read here before this rank's later writes (the header's argument)
  if (BlockAny(retried) && threadIdx.x == 0) atomicAdd(a.status + step::kRetried, 1u);
  // oneshot: every rank done reading before the buffer is written again; past the timeout a
  // rank may still read it, so this block's values become NaN too (through the norm).
  if (a.oneshot && !CrossBarrier(a, 2 * k, k, wt)) ss = NAN;
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

}  // namespace phase
}  // namespace cuda
}  // namespace sifar
