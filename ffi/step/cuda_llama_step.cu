// The Llama step (llama_step.h) as one persistent kernel: a cooperative launch of one block
// per SM (all resident), phases separated by grid barriers, 5 per layer:
//   norm + qkv | attention | o + residual | norm + gate_up + SwiGLU | down + residual
// and the final norm after the last. Each block is kWarps consumer warps, which run the phases,
// and one producer warp, which streams the block's share of every projection's weights, layer
// after layer, into a ring of shared-memory stages (ring_gemv.cuh: bulk copies, mbarriers); it
// runs ahead of the consumers across the barriers, the attention and the norms, bounded only by
// the ring (the weights never depend on the activations). A GEMV phase's rows are fp8_matvec's
// lanes-32 sums (the same bits; bf16 weights, kBf16, in the same order of 16-byte chunks).
// The attention splits each KV head's keys into up to kMaxSplits ranges, one block each; a
// range's partial softmax goes to the workspace and the head's last block (an atomic count per
// layer and head) merges them in split order. Every wait is bounded
// (device_math.cuh, Deadline) and traps past it: a lost block is a failed launch (an error
// from XLA), never a hang.
// Virtual ranks (kVirtual, ranks > 1: llama_step.h): the grid's blocks split into `ranks` equal
// sets, each running the whole step on its rank's slices with barriers of its own blocks; the
// barrier after o and after down becomes the all-reduce phase (allreduce_phase.cuh), whose
// waits fail the step (NaN, status words) instead of trapping.
// Across devices (kDevices: llama_step_tp.h): the grid is one rank of a communicator's axis
// running its shard; the same phases, the all-reduce reading the peers' memory
// (devices_phase.cuh: the lane's epochs, tagged words or oneshot's barriers across the ranks).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>

#include "allreduce/launch.h"
#include "allreduce/plan.h"
#include "core/cuda_check.h"
#include "step/allreduce_phase.cuh"
#include "step/attention_phase.cuh"
#include "step/device_math.cuh"
#include "step/devices_phase.cuh"
#include "step/grid_sync.cuh"
#include "step/llama_step.h"
#include "step/llama_step_tp.h"
#include "step/norm_phase.cuh"
#include "step/ring_gemv.cuh"
#include "step/step_launch.cuh"
#include "targets.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sifar {
namespace cuda {
namespace {

using namespace phase;  // NOLINT: the step's phases (device_math, grid_sync, ring, norm, attention)

// The kernel's modes: TP=1, virtual ranks (sets of blocks of this launch), one rank across
// devices.
enum Mode { kTp1 = 0, kVirtual = 1, kDevices = 2 };

struct Params {
  step::Shape s;
  float score_scale;
  const bf16* x;
  const float* rope;
  const int32_t* pos;
  const bf16* final_norm;
  bf16* cache;
  bf16* h;
  unsigned* status;    // step::StepStatus
  unsigned* barriers;  // [ranks] each rank's barrier, then [ranks] oneshot's arrivals;
                       // kDevices: the launch's words (devices_phase.cuh, DevLaunchWord)
  unsigned* heads;     // [layers][kv] the attention's counts
  uint32_t* ar;        // [2][ranks][H] the all-reduce's tagged words
  int oneshot, absent_rank;
  long long timeout_ns, skew_ns;
  bf16* qkv;
  bf16* attn;
  bf16* act;
  bf16* resid;  // [H]; [ranks][2][H] with ranks
  float* part;
  const uint8_t* head;  // the LM head [vocab, H], the layers' weight type (vocab 0: none)
  const float* head_scale;
  int head_per_channel, vocab;
  float* logits;
  int stages;     // ring stages per block
  int xs_bytes;   // shared memory before the ring: the GEMV input or the attention's scratch
  step::StepComm comm;  // kDevices: the communicator's memory (every rank's)
  step::LayerWeights layer[step::kMaxLayers];
};

// Projection p of layer l as rank `rank` takes it on its blocks (b of g): qkv's and
// gate_up's rows of its heads and FFN rows, o's and down's columns; "layer" s.layers is the
// head (p 0; nothing for p > 0), on every block of the grid. Widths and offsets in bytes
// (s.wbytes a weight).
__device__ __forceinline__ Mat LayerMat(const Params& P, int l, int p, int rank, int b, int g) {
  const step::Shape& s = P.s;
  const int H = s.hidden, R = s.ranks, wb = s.wbytes;
  if (l == s.layers) {
    return {P.head, p == 0 ? P.vocab : 0, H * wb, 1, 0, H * wb, static_cast<int>(blockIdx.x),
            static_cast<int>(gridDim.x)};
  }
  const step::LayerWeights& L = P.layer[l];
  const int qr = s.qkv_rows() / R, kr = s.q_dim() / R, fr = s.ffn / R;
  switch (p) {
    case 0: return {L.qkv + static_cast<size_t>(rank) * qr * H * wb, qr, H * wb, 1, 0, H * wb, b, g};
    case 1: return {L.o + rank * kr * wb, H, kr * wb, 1, 0, s.q_dim() * wb, b, g};
    case 2:
      return {L.gate_up + static_cast<size_t>(rank) * fr * H * wb, fr, H * wb, 2, s.ffn, H * wb, b, g};
    default: return {L.down + rank * fr * wb, H, fr * wb, 1, 0, s.ffn * wb, b, g};
  }
}

// The NaN answer of a slot outside the cache (every block alike).
__device__ void NanOut(const Params& P) {
  if (blockIdx.x == 0 && threadIdx.x < kThreads)
    for (int j = threadIdx.x; j < P.s.hidden; j += kThreads) P.h[j] = __float2bfloat16_rn(NAN);
  if (threadIdx.x < kThreads)
    for (int j = blockIdx.x * kThreads + threadIdx.x; j < P.vocab; j += gridDim.x * kThreads)
      P.logits[j] = NAN;
}

// The head after the last layer: xs holds the final norm of the stream (every block).
template <bool kB>
__device__ __forceinline__ void Head(const Params& P, Ring& ring, const float4* xs, int rank,
                                     int b, int g) {
  RingGemv<kB>(
      LayerMat(P, P.s.layers, 0, rank, b, g), ring, xs,
      [&](int n) { return make_float2(Scale(P.head_scale, P.head_per_channel, n), 0.0f); },
      [&](int n, float r0, float, float2 pre) { P.logits[n] = __fmul_rn(r0, pre.x); });
}

// qkv's GEMV of the rows from row0 on (a rank's first; 0 at TP=1), written to P.qkv from row0.
template <bool kB>
__device__ __forceinline__ void QkvGemv(const Params& P, const step::LayerWeights& L, const Mat& m,
                                        Ring& ring, const float4* xs, int row0) {
  RingGemv<kB>(
      m, ring, xs,
      [&](int n) {
        return make_float2(Scale(L.qkv_scale, L.scale_per_channel & 1, row0 + n), 0.0f);
      },
      [&](int n, float r0, float, float2 pre) {
        P.qkv[row0 + n] = __float2bfloat16_rn(__fmul_rn(r0, pre.x));
      });
}

// gate_up's GEMV and the SwiGLU of FFN rows from j0 on (a rank's first; 0 at TP=1), to P.act.
template <bool kB>
__device__ __forceinline__ void GateUpGemv(const Params& P, const step::LayerWeights& L,
                                           const Mat& m, Ring& ring, const float4* xs, int j0) {
  RingGemv<kB>(
      m, ring, xs,
      [&](int j) {
        const unsigned pc = L.scale_per_channel & 4;
        return make_float2(Scale(L.gate_up_scale, pc, j0 + j),
                           Scale(L.gate_up_scale, pc, P.s.ffn + j0 + j));
      },
      [&](int j, float r0, float r1, float2 pre) {
        const float gt = Rb(__fmul_rn(r0, pre.x)), u = Rb(__fmul_rn(r1, pre.y));
        P.act[j0 + j] = __float2bfloat16_rn(__fmul_rn(__fdiv_rn(gt, __fadd_rn(1.0f, expf(-gt))), u));
      });
}

// TP=1: grid barriers after every projection and the attention, the residual adds in the
// epilogues of o and down. kB: bf16 weights (else e4m3).
template <int G, bool kB>
__device__ __forceinline__ void Tp1Step(const Params& P, Ring& ring, unsigned char* smem,
                                        float* red, int* flag, int pos, int start) {
  float4* xs = reinterpret_cast<float4*>(smem);
  const step::Shape& s = P.s;
  const int b = blockIdx.x, g = gridDim.x;
  const auto mats = [&](int l, int p) { return LayerMat(P, l, p, 0, b, g); };
  unsigned nbar = 0;
  auto sync = [&]() { GridSync(P.barriers, ++nbar * gridDim.x); };
  for (int l = 0; l < s.layers; ++l) {
    const step::LayerWeights& L = P.layer[l];
    const bf16* rin = l == 0 ? P.x : P.resid;  // the residual stream before this layer
    StageNorm(xs, rin, L.input_norm, s.hidden, s.eps, red);
    QkvGemv<kB>(P, L, mats(l, 0), ring, xs, 0);
    sync();
    Attention<G>(P, l, reinterpret_cast<float*>(smem), flag, pos, start, 0, s.kv_heads, b, g);
    sync();
    StageX(xs, P.attn, s.q_dim());
    RingGemv<kB>(
        mats(l, 1), ring, xs,
        [&](int n) {
          return make_float2(Scale(L.o_scale, L.scale_per_channel & 2, n), LoadBf(rin + n));
        },
        [&](int n, float r0, float, float2 pre) {
          P.resid[n] = __float2bfloat16_rn(__fadd_rn(pre.y, Rb(__fmul_rn(r0, pre.x))));
        });
    sync();
    StageNorm(xs, P.resid, L.post_norm, s.hidden, s.eps, red);
    GateUpGemv<kB>(P, L, mats(l, 2), ring, xs, 0);
    sync();
    StageX(xs, P.act, s.ffn);
    RingGemv<kB>(
        mats(l, 3), ring, xs,
        [&](int n) {
          return make_float2(Scale(L.down_scale, L.scale_per_channel & 8, n), LoadBf(P.resid + n));
        },
        [&](int n, float r0, float, float2 pre) {
          P.resid[n] = __float2bfloat16_rn(__fadd_rn(pre.y, Rb(__fmul_rn(r0, pre.x))));
        });
    sync();
  }
  if (blockIdx.x == 0) {
    const float inv = InvRms(P.resid, s.hidden, s.eps, red);
    const bf16* sc = P.final_norm;
    for (int j = threadIdx.x; j < s.hidden; j += kThreads)
      P.h[j] = __float2bfloat16_rn(__fmul_rn(Rb(__fmul_rn(LoadBf(P.resid + j), inv)), F(sc[j])));
  }
  if (P.vocab > 0) {  // the head: every block norms the residual stream itself (no barrier)
    StageNorm(xs, P.resid, reinterpret_cast<const uint16_t*>(P.final_norm), s.hidden, s.eps, red);
    Head<kB>(P, ring, xs, 0, b, g);
  }
}

// The all-reduce phases of RanksStep. Begin(k): before phase k's partials are published;
// Put(k, n, v): this rank's partial of row n; Reduce(k, ...): ArReduce's contract.
// Between the virtual ranks of this launch (allreduce_phase.cuh):
struct VirtualPhases {
  ArCtx a;
  __device__ __forceinline__ void Begin(unsigned k) {
    Skew(a, k);
    FenceAcqRel();  // the words read before (the previous phases) ordered before these
  }
  __device__ __forceinline__ void Put(unsigned k, int n, float v) { ArPut(a, k, n, v); }
  __device__ __forceinline__ void Reduce(unsigned k, const bf16* old, bf16* out, int qlo, int qhi,
                                         const uint16_t* scale, float eps, float4* xs,
                                         float* red, bf16* h) {
    ArReduce(a, k, old, out, qlo, qhi, scale, eps, xs, red, h);
  }
};
// Between the devices of a communicator's axis, this launch one rank (devices_phase.cuh):
struct DevicePhases {
  DevAr a;
  __device__ __forceinline__ void Begin(unsigned k) { DevBegin(a, k); }
  __device__ __forceinline__ void Put(unsigned, int n, float v) { DevPut(a, n, v); }
  __device__ __forceinline__ void Reduce(unsigned, const bf16* old, bf16* out, int qlo, int qhi,
                                         const uint16_t* scale, float eps, float4* xs,
                                         float* red, bf16* h) {
    DevReduce(a, old, out, qlo, qhi, scale, eps, xs, red, h);
  }
};

// Virtual ranks: this block is block b of rank `rank`'s nb. Barriers of the rank's blocks after
// qkv, the attention and gate_up; after o and down the all-reduce phase, which also adds the
// residual and stages the next norm (the last one the final norm, for h and the head).
// Across devices the same with rank 0 of ranks 1 (the device's shard is the whole operand)
// and the phases across the devices (ar: DevicePhases).
template <int G, bool kB, typename Phases>
__device__ __forceinline__ void RanksStep(const Params& P, Ring& ring, unsigned char* smem,
                                          float* red, int* flag, int pos, int start, int rank,
                                          int b, int nb, Phases& ar) {
  float4* xs = reinterpret_cast<float4*>(smem);
  const step::Shape& s = P.s;
  const int R = s.ranks, H = s.hidden;
  const int qr = s.qkv_rows() / R, kr = s.q_dim() / R, fr = s.ffn / R;
  const auto mats = [&](int l, int p) { return LayerMat(P, l, p, rank, b, nb); };
  unsigned nbar = 0;
  auto sync = [&]() { GridSync(P.barriers + rank, ++nbar * nb); };
  bf16* resid = P.resid + static_cast<size_t>(rank) * 2 * H;  // [2][H], phase k writes k & 1
  const int qlo = b * (H / 4) / nb, qhi = (b + 1) * (H / 4) / nb;
  unsigned k = 0;  // all-reduce phases so far
  StageNorm(xs, P.x, P.layer[0].input_norm, H, s.eps, red);
  for (int l = 0; l < s.layers; ++l) {
    const step::LayerWeights& L = P.layer[l];
    QkvGemv<kB>(P, L, mats(l, 0), ring, xs, rank * qr);
    sync();
    Attention<G>(P, l, reinterpret_cast<float*>(smem), flag, pos, start,
                 rank * (s.kv_heads / R), s.kv_heads / R, b, nb);
    sync();
    StageX(xs, P.attn + rank * kr, kr);
    ar.Begin(++k);
    RingGemv<kB>(
        mats(l, 1), ring, xs,
        [&](int n) { return make_float2(Scale(L.o_scale, L.scale_per_channel & 2, n), 0.0f); },
        [&](int n, float r0, float, float2 pre) { ar.Put(k, n, __fmul_rn(r0, pre.x)); });
    ar.Reduce(k, k == 1 ? P.x : resid + ((k - 1) & 1) * H, resid + (k & 1) * H, qlo, qhi,
              L.post_norm, s.eps, xs, red, nullptr);
    GateUpGemv<kB>(P, L, mats(l, 2), ring, xs, rank * fr);
    sync();
    StageX(xs, P.act + rank * fr, fr);
    ar.Begin(++k);
    RingGemv<kB>(
        mats(l, 3), ring, xs,
        [&](int n) { return make_float2(Scale(L.down_scale, L.scale_per_channel & 8, n), 0.0f); },
        [&](int n, float r0, float, float2 pre) { ar.Put(k, n, __fmul_rn(r0, pre.x)); });
    const bool last = l + 1 == s.layers;
    ar.Reduce(k, resid + ((k - 1) & 1) * H, last ? nullptr : resid + (k & 1) * H, qlo, qhi,
              last ? reinterpret_cast<const uint16_t*>(P.final_norm) : P.layer[l + 1].input_norm,
              s.eps, xs, red, last && blockIdx.x == 0 ? P.h : nullptr);
  }
  if (P.vocab > 0) Head<kB>(P, ring, xs, rank, b, nb);
}

template <int G, int kMode, bool kB>
__global__ void __launch_bounds__(kBlockThreads, 1) LlamaStepKernel(const __grid_constant__ Params P) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float red[kWarps];
  __shared__ int flag;
  const step::Shape& s = P.s;
  const int pos = P.pos[0], start = P.pos[1];
  if (pos < 0 || pos >= s.capacity || start < 0 || start > pos) return NanOut(P);
  constexpr bool kTP = kMode != kTp1;
  __shared__ DevStart dstart;  // kDevices: the rank's skew and timeout
  __shared__ uint64_t dcalls;
  if constexpr (kMode == kDevices) {
    // Block 0 alone decides for the grid (DevDecide): a failed communicator or
    // testing.drop_rank makes every block run the step without publishing, waiting or taking
    // any rank's word (NaN; its peers time out), never leave early, so that no block waits at
    // a grid barrier for blocks that left; and where the step begins on the lane. The others
    // read the decisions after the first grid barriers (DevBegin of phase 1).
    if (threadIdx.x == 0) {
      ReadDevStart(P.comm, dstart);
      dcalls = 0;
      if (blockIdx.x == 0) {
        DevDecide(P.comm, s.hidden, P.barriers);
        dcalls = *reinterpret_cast<volatile uint64_t*>(P.comm.calls + P.comm.algorithm);
      }
    }
    __syncthreads();
  }
  unsigned char* ring_buf = smem + P.xs_bytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(ring_buf + static_cast<size_t>(P.stages) * kStageBytes);
  Ring ring{ring_buf, bars, bars + P.stages, P.stages, 0};
  if (threadIdx.x == 0) RingInit(ring);
  __syncthreads();  // the last barrier of all kBlockThreads threads
  const int nb = kTP ? static_cast<int>(gridDim.x) / s.ranks : static_cast<int>(gridDim.x);
  const int rank = kTP ? static_cast<int>(blockIdx.x) / nb : 0;
  const int b = static_cast<int>(blockIdx.x) - rank * nb;
  if (threadIdx.x >= kThreads) {
    Produce([&](int l, int p) { return LayerMat(P, l, p, rank, b, nb); },
            s.layers + (P.vocab > 0), ring);
    return;
  }
  if constexpr (kMode == kVirtual) {
    VirtualPhases ar{ArCtx{P.ar, P.status, P.barriers + s.ranks, s.ranks, rank, nb, s.hidden,
                           P.oneshot, P.absent_rank, P.timeout_ns, P.skew_ns}};
    RanksStep<G, kB>(P, ring, smem, red, &flag, pos, start, rank, b, nb, ar);
  } else if constexpr (kMode == kDevices) {
    DevicePhases ar;
    ar.a.m = &P.comm;
    ar.a.status = P.status;
    ar.a.words = P.barriers;  // [kGridCounter] is the grid barrier's (rank 0 of 1)
    ar.a.nb = nb;
    ar.a.b = b;
    ar.a.hidden = s.hidden;
    ar.a.chain = ChainTag(P.comm.chain);
    ar.a.skew_max = dstart.skew_max;
    ar.a.skew_seed = dstart.skew_seed;
    ar.a.timeout_ns = dstart.timeout_ns;
    RanksStep<G, kB>(P, ring, smem, red, &flag, pos, start, 0, b, nb, ar);
    DevCommit(ar.a, dcalls);
  } else {
    Tp1Step<G, kB>(P, ring, smem, red, &flag, pos, start);
  }
}

// The kernels by query heads per KV head (Llama 3.x: 3 for 3B, 4 for 1B and 8B, 8 for 70B),
// TP=1 or virtual ranks, and the weight type (bytes per weight: 1 e4m3, 2 bf16).
using KernelFn = void (*)(Params);
template <int kMode, bool kB>
KernelFn KernelOf(int group) {
  switch (group) {
    case 1: return LlamaStepKernel<1, kMode, kB>;
    case 2: return LlamaStepKernel<2, kMode, kB>;
    case 3: return LlamaStepKernel<3, kMode, kB>;
    case 4: return LlamaStepKernel<4, kMode, kB>;
    case 8: return LlamaStepKernel<8, kMode, kB>;
    default: return nullptr;
  }
}
// ranks: virtual ranks; devices: ranks across devices (this launch one of them).
KernelFn KernelFor(int group, int ranks, int wbytes, int devices = 1) {
  const int mode = devices > 1 ? kDevices : ranks > 1 ? kVirtual : kTp1;
  if (wbytes == 2) {
    return mode == kDevices   ? KernelOf<kDevices, true>(group)
           : mode == kVirtual ? KernelOf<kVirtual, true>(group)
                              : KernelOf<kTp1, true>(group);
  }
  return mode == kDevices   ? KernelOf<kDevices, false>(group)
         : mode == kVirtual ? KernelOf<kVirtual, false>(group)
                            : KernelOf<kTp1, false>(group);
}

// The launch of a planned step on the handler's device (its current one); comm: the
// communicator's memory of a step across devices (Shape::devices > 1), else null.
ffi::Error LaunchStep(cudaStream_t stream, const step::StepCall& call, const step::StepComm* comm) {
  const step::Shape& s = call.shape;
  const KernelFn kernel = KernelFor(s.group, s.ranks, s.wbytes, s.devices);
  if (!kernel)
    return Invalid("llama_step: " + std::to_string(s.group) + " query heads per KV head; the "
                   "kernel is built for 1, 2, 3, 4 and 8");
  Smem sm;
  int blocks = 0;
  cudaError_t e = GridBlocks(kernel, s, &sm, &blocks);
  if (e != cudaSuccess) return Launched(e);
  const int cap = StepMaxBlocks();
  if (cap > 0 && blocks > cap) blocks = std::max(cap, s.ranks);
  blocks = blocks / s.ranks * s.ranks;  // virtual ranks: equal sets of blocks
  if (blocks < 1)
    return Invalid("llama_step: this GPU cannot run the persistent step (no cooperative launch, "
                   "or no room for its input (" + std::to_string(sm.xs) + " bytes) and two " +
                   std::to_string(kStageBytes) + "-byte weight stages in one block's shared memory)");
  if (call.cache != call.cache_in) {  // XLA gave the aliased result a buffer of its own
    e = cudaMemcpyAsync(call.cache, call.cache_in, call.cache_bytes, cudaMemcpyDeviceToDevice,
                        stream);
    if (e != cudaSuccess) return Launched(e);
  }
  e = cudaMemsetAsync(call.work, 0, call.ws.counter_bytes, stream);  // status, counters, words
  if (e != cudaSuccess) return Launched(e);
  auto p = std::make_unique<Params>();
  p->s = s;
  p->score_scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  p->x = reinterpret_cast<const bf16*>(call.x);
  p->rope = call.rope;
  p->pos = call.pos;
  p->final_norm = reinterpret_cast<const bf16*>(call.final_norm);
  p->cache = reinterpret_cast<bf16*>(call.cache);
  p->h = reinterpret_cast<bf16*>(call.h);
  p->status = reinterpret_cast<unsigned*>(call.work + call.ws.status);
  p->barriers = reinterpret_cast<unsigned*>(call.work + call.ws.barriers);
  p->heads = reinterpret_cast<unsigned*>(call.work + call.ws.heads);
  p->ar = reinterpret_cast<uint32_t*>(call.work + call.ws.ar);
  p->oneshot = call.oneshot;
  p->absent_rank = call.absent_rank;
  p->timeout_ns = call.timeout_ns;
  p->skew_ns = call.skew_ns;
  p->qkv = reinterpret_cast<bf16*>(call.work + call.ws.qkv);
  p->attn = reinterpret_cast<bf16*>(call.work + call.ws.attn);
  p->act = reinterpret_cast<bf16*>(call.work + call.ws.act);
  p->resid = reinterpret_cast<bf16*>(call.work + call.ws.resid);
  p->part = reinterpret_cast<float*>(call.work + call.ws.part);
  p->head = call.head;
  p->head_scale = call.head_scale;
  p->head_per_channel = call.head_per_channel;
  p->vocab = call.vocab;
  p->logits = call.logits;
  p->stages = sm.stages;
  p->xs_bytes = static_cast<int>(sm.xs);
  if (comm) p->comm = *comm;
  std::copy(call.layers.begin(), call.layers.end(), p->layer);
  void* kargs[] = {p.get()};
  return Launched(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel),
                                              dim3(blocks), dim3(kBlockThreads), kargs, sm.total,
                                              stream));
}

ffi::Error CudaLlamaStepImpl(cudaStream_t stream, int32_t ordinal, ffi::RemainingArgs args,
                             ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::AnyBuffer> cache,
                             ffi::Result<ffi::AnyBuffer> work, ffi::Result<ffi::AnyBuffer> logits,
                             int64_t layers, int64_t kv_heads, int64_t group, float eps,
                             int64_t ranks, int64_t oneshot, int64_t timeout_ns, int64_t skew_ns,
                             int64_t absent_rank) {
  step::StepCall call;
  const step::StepAttrs attrs{layers, kv_heads, group, eps, ranks, oneshot, timeout_ns, skew_ns,
                              absent_rank};
  ffi::Error err = step::PlanLlamaStep(args, *h, *cache, *work, *logits, attrs, &call);
  if (err.failure()) return err;
  err = UseDevice(ordinal);
  if (err.failure()) return err;
  return LaunchStep(stream, call, nullptr);
}

// The step across devices: PlanLlamaStepTp's checks (the communicator, a failed group: an
// error before the launch, as the plain all-reduce's handler returns it; a command buffer's
// replay runs only the kernel, which reads the rank's Control and fills NaN on a failed
// communicator), then this rank's launch on XLA's stream.
ffi::Error CudaLlamaStepTpImpl(cudaStream_t stream, int32_t ordinal, ffi::RemainingArgs args,
                               ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::AnyBuffer> cache,
                               ffi::Result<ffi::AnyBuffer> work,
                               ffi::Result<ffi::AnyBuffer> logits, int64_t layers,
                               int64_t kv_heads, int64_t group, float eps, int64_t after,
                               int32_t axis_key, int32_t nranks, int32_t algorithm,
                               int32_t repeat, int32_t chain) {
  // While XLA records a command buffer, handler calls do not follow the run order.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) cudaGetLastError();
  step::StepCall call;
  RankCall rc;
  step::StepComm m;
  const step::StepAttrs attrs{layers, kv_heads, group, eps, 1, algorithm == kOneshot,
                              step::kMaxTimeoutNs, 0, -1};
  const step::TpAttrs tp{axis_key, nranks, algorithm, repeat, chain, after};
  ffi::Error err = step::PlanLlamaStepTp(ordinal, args, *h, *cache, *work, *logits, attrs, tp,
                                         &call, &rc, &m, /*device=*/true,
                                         capture == cudaStreamCaptureStatusNone);
  if (err.failure()) return err;
  err = UseDevice(ordinal);
  if (err.failure()) return err;
  return LaunchStep(stream, call, &m);
}

}  // namespace
}  // namespace cuda

void PreloadLlamaStepKernels() {
  cudaFuncAttributes attr;
  for (int g : {1, 2, 3, 4, 8})
    for (int wbytes : {1, 2}) {
      for (int ranks : {1, 2})
        SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, cuda::KernelFor(g, ranks, wbytes)));
      SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, cuda::KernelFor(g, 1, wbytes, 2)));
    }
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaLlamaStep, cuda::CudaLlamaStepImpl,
                              WithLlamaStepOperands(ffi::Ffi::Bind()
                                                        .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                        .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaLlamaStepTp, cuda::CudaLlamaStepTpImpl,
                              WithLlamaStepTpOperands(ffi::Ffi::Bind()
                                                          .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                          .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace sifar
