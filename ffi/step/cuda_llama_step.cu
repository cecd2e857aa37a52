// The Llama step (llama_step.h) as one persistent kernel: a cooperative launch of every
// block that fits (all resident), phases separated by grid barriers, 5 per layer:
//   norm + qkv | attention | o + residual | norm + gate_up + SwiGLU | down + residual
// and the final norm after the last. The GEMV phases are fp8_matvec's lanes-32 row kernel
// (a warp per output row, 8 16-byte loads in flight per lane, double-buffered in
// registers); a phase's last batch of loads is followed by the NEXT projection's first
// batch, so each warp's first weights are on their way while the grid waits at the barrier
// (the weights never depend on the activations). The attention splits each KV head's keys
// into up to kMaxSplits ranges, one block each; a range's partial softmax goes to the
// workspace and the head's last block (an atomic count per layer and head) merges them in
// split order. Grid barriers spin a bounded time and trap past it: a lost block is a
// failed launch (an error from XLA), never a hang.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <string>

#include "allreduce/launch.h"
#include "allreduce/plan.h"
#include "core/cuda_check.h"
#include "step/attention_phase.cuh"
#include "step/device_math.cuh"
#include "step/gemv_phase.cuh"
#include "step/grid_sync.cuh"
#include "step/llama_step.h"
#include "step/norm_phase.cuh"
#include "targets.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sifar {
namespace cuda {
namespace {

using namespace phase;  // NOLINT: the step's phases (device_math, grid_sync, gemv, norm, attention)

struct Params {
  step::Shape s;
  float score_scale;
  const bf16* x;
  const float* rope;
  const int32_t* pos;
  const bf16* final_norm;
  bf16* cache;
  bf16* h;
  unsigned* counters;  // [0] the grid barrier, [1 + l * kv + head] the attention's counts
  bf16* qkv;
  bf16* attn;
  bf16* act;
  bf16* resid;
  float* part;
  step::LayerWeights layer[step::kMaxLayers];
};









__device__ __forceinline__ Mat LayerMat(const Params& P, int l, int p) {
  const step::LayerWeights& L = P.layer[l];
  const step::Shape& s = P.s;
  switch (p) {
    case 0: return {L.qkv, s.qkv_rows(), s.hidden, 1, 0};
    case 1: return {L.o, s.hidden, s.q_dim(), 1, 0};
    case 2: return {L.gate_up, s.ffn, s.hidden, 2, s.ffn};
    default: return {L.down, s.hidden, s.ffn, 1, 0};
  }
}

template <int G>
__global__ void __launch_bounds__(kThreads, 2) LlamaStepKernel(const __grid_constant__ Params P) {
  extern __shared__ float4 smem4[];
  __shared__ float red[kWarps];
  __shared__ int flag;
  float4* xs = smem4;
  const step::Shape& s = P.s;
  const int pos = P.pos[0], start = P.pos[1];
  if (pos < 0 || pos >= s.capacity || start < 0 || start > pos) {  // every block alike
    if (blockIdx.x == 0)
      for (int j = threadIdx.x; j < s.hidden; j += kThreads) P.h[j] = __float2bfloat16_rn(NAN);
    return;
  }
  unsigned bars = 0;
  auto sync = [&]() { GridSync(P.counters, ++bars * gridDim.x); };
  uint4 A[kU], B[kU];
  const int first = blockIdx.x * kWarps + threadIdx.x / 32;
  const auto mats = [&](int l, int p) { return LayerMat(P, l, p); };
  Issue(A, LayerMat(P, 0, 0), first, 0);
  for (int l = 0; l < s.layers; ++l) {
    const step::LayerWeights& L = P.layer[l];
    const bf16* rin = l == 0 ? P.x : P.resid;  // the residual stream before this layer
    StageNorm(xs, rin, L.input_norm, s.hidden, s.eps, red);
    Gemv(mats, l, 0, 0, -1, xs, A, B, [&](int n, float r0, float) {
      P.qkv[n] = __float2bfloat16_rn(__fmul_rn(r0, Scale(L.qkv_scale, L.scale_per_channel & 1, n)));
    });
    sync();
    Attention<G>(P, l, reinterpret_cast<float*>(smem4), &flag, pos, start);
    Issue(A, LayerMat(P, l, 1), first, 0);  // o's first weights in flight across the barrier,
    sync();                                 // not held through the attention (its registers)
    StageX(xs, P.attn, s.q_dim());
    Gemv(mats, l, 1, l, 2, xs, A, B, [&](int n, float r0, float) {
      const float v = Rb(__fmul_rn(r0, Scale(L.o_scale, L.scale_per_channel & 2, n)));
      P.resid[n] = __float2bfloat16_rn(__fadd_rn(LoadBf(rin + n), v));
    });
    sync();
    StageNorm(xs, P.resid, L.post_norm, s.hidden, s.eps, red);
    Gemv(mats, l, 2, l, 3, xs, A, B, [&](int j, float r0, float r1) {
      const unsigned pc = L.scale_per_channel & 4;
      const float g = Rb(__fmul_rn(r0, Scale(L.gate_up_scale, pc, j)));
      const float u = Rb(__fmul_rn(r1, Scale(L.gate_up_scale, pc, s.ffn + j)));
      P.act[j] = __float2bfloat16_rn(__fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u));
    });
    sync();
    StageX(xs, P.act, s.ffn);
    Gemv(mats, l, 3, l + 1, l + 1 < s.layers ? 0 : -1, xs, A, B, [&](int n, float r0, float) {
      const float v = Rb(__fmul_rn(r0, Scale(L.down_scale, L.scale_per_channel & 8, n)));
      P.resid[n] = __float2bfloat16_rn(__fadd_rn(LoadBf(P.resid + n), v));
    });
    sync();
  }
  if (blockIdx.x == 0) {
    const float inv = InvRms(P.resid, s.hidden, s.eps, red);
    const bf16* sc = P.final_norm;
    for (int j = threadIdx.x; j < s.hidden; j += kThreads)
      P.h[j] = __float2bfloat16_rn(__fmul_rn(Rb(__fmul_rn(LoadBf(P.resid + j), inv)), F(sc[j])));
  }
}

size_t AttentionSmem(const step::Shape& s) {
  return sizeof(float) * (static_cast<size_t>(s.group) * kHeadDim + 2 * kHeadDim +
                          static_cast<size_t>(kWarps) * s.group * (kHeadDim + 2));
}

// The kernels by query heads per KV head (Llama 3.x: 3 for 3B, 4 for 1B and 8B, 8 for 70B).
using KernelFn = void (*)(Params);
KernelFn KernelFor(int group) {
  switch (group) {
    case 1: return LlamaStepKernel<1>;
    case 2: return LlamaStepKernel<2>;
    case 3: return LlamaStepKernel<3>;
    case 4: return LlamaStepKernel<4>;
    case 8: return LlamaStepKernel<8>;
    default: return nullptr;
  }
}

// Blocks of the cooperative grid on this device for `smem` bytes each (0: none fit), or the
// CUDA error that stopped the query.
cudaError_t GridBlocks(KernelFn kernel, size_t smem, int* blocks) {
  *blocks = 0;
  int dev = 0, sms = 0, coop = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev);
  if (e == cudaSuccess && smem > 48 * 1024)
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem));
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
  if (e == cudaSuccess && coop) *blocks = per_sm * sms;
  return e;
}

ffi::Error CudaLlamaStepImpl(cudaStream_t stream, int32_t ordinal, ffi::RemainingArgs args,
                             ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::AnyBuffer> cache,
                             ffi::Result<ffi::AnyBuffer> work, int64_t layers, int64_t kv_heads,
                             int64_t group, float eps) {
  step::StepCall call;
  ffi::Error err = step::PlanLlamaStep(args, *h, *cache, *work, layers, kv_heads, group, eps,
                                       &call);
  if (err.failure()) return err;
  err = UseDevice(ordinal);
  if (err.failure()) return err;
  const step::Shape& s = call.shape;
  const size_t smem = std::max(sizeof(float) * static_cast<size_t>(s.max_k()), AttentionSmem(s));
  const KernelFn kernel = KernelFor(s.group);
  if (!kernel)
    return Invalid("llama_step: " + std::to_string(s.group) + " query heads per KV head; the "
                   "kernel is built for 1, 2, 3, 4 and 8");
  int blocks = 0;
  cudaError_t e = GridBlocks(kernel, smem, &blocks);
  if (e != cudaSuccess) return Launched(e);
  if (blocks < 1)
    return Invalid("llama_step: this GPU cannot run the persistent step (no cooperative launch, "
                   "or " + std::to_string(smem) + " bytes of shared memory per block do not fit)");
  if (call.cache != call.cache_in) {  // XLA gave the aliased result a buffer of its own
    e = cudaMemcpyAsync(call.cache, call.cache_in, call.cache_bytes, cudaMemcpyDeviceToDevice,
                        stream);
    if (e != cudaSuccess) return Launched(e);
  }
  e = cudaMemsetAsync(call.work + call.ws.counters, 0, call.ws.counter_bytes, stream);
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
  p->counters = reinterpret_cast<unsigned*>(call.work + call.ws.counters);
  p->qkv = reinterpret_cast<bf16*>(call.work + call.ws.qkv);
  p->attn = reinterpret_cast<bf16*>(call.work + call.ws.attn);
  p->act = reinterpret_cast<bf16*>(call.work + call.ws.act);
  p->resid = reinterpret_cast<bf16*>(call.work + call.ws.resid);
  p->part = reinterpret_cast<float*>(call.work + call.ws.part);
  std::copy(call.layers.begin(), call.layers.end(), p->layer);
  void* kargs[] = {p.get()};
  return Launched(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel),
                                              dim3(blocks), dim3(kThreads), kargs, smem, stream));
}

}  // namespace
}  // namespace cuda

void PreloadLlamaStepKernels() {
  cudaFuncAttributes attr;
  for (int g : {1, 2, 3, 4, 8})
    SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, cuda::KernelFor(g)));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaLlamaStep, cuda::CudaLlamaStepImpl,
                              WithLlamaStepOperands(ffi::Ffi::Bind()
                                                        .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                        .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace sifar
