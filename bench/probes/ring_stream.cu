// Probe (leaves the tree once answered; its answer goes to docs/performance.md): what limits
// the persistent step's GEMV phase (ffi/step/ring_gemv.cuh, its second consumer version: full
// slabs branch-free, the epilogue's loads at the round's start)? The stream, or the consumers'
// math, and which e4m3 decode keeps up with the stream: conversion instructions (CvtDot, the
// product), the byte's bits placed in a float (BitsDot: 3 integer ops per weight), or two
// bytes at a time as bf16 pairs (PairsDot: 9 per 4 weights), the same times 2^120 by a float
// multiply (PairsMulDot: no input scaling), or one word of four by conversions and three as
// PairsMul (HybridMulDot: both pipes at once).
//
// The chain: 32 layers of Llama-3.1-8B's four FP8 projections (TP=1, or TP=2's per-rank
// shapes), each projection's output the next one's input (qkv -> o -> gate_up + SwiGLU ->
// down -> the next layer's qkv), a grid barrier after each, as one cooperative launch: the
// persistent step without its norms and attention. Every full variant's final output must
// equal the first's bit for bit; each is timed as the median of 15 launches after 3. Built
// once per rows-per-warp setting (ring_stream.sh).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "step/device_math.cuh"
#include "step/grid_sync.cuh"
#include "step/norm_phase.cuh"
#include "step/ring_gemv.cuh"
#include "dots.cuh"

using namespace sifar::cuda::phase;

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));   \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

constexpr int kMaxL = 32;
struct Chain {
  const uint8_t* w[4 * kMaxL];
  const float* sc[4 * kMaxL];
  int layers, H, Q, NQKV, F;
  bf16 *x, *y0, *y1, *act;
  unsigned* counter;
  int stages;
};

__device__ __forceinline__ Mat ChainMat(const Chain& C, int l, int p) {
  switch (p) {
    case 0: return {C.w[4 * l], C.NQKV, C.H, 1, 0};
    case 1: return {C.w[4 * l + 1], C.H, C.Q, 1, 0};
    case 2: return {C.w[4 * l + 2], C.F, C.H, 2, C.F};
    default: return {C.w[4 * l + 3], C.H, C.F, 1, 0};
  }
}

// xs <- in (RMS-normalised where norm: the step's qkv and gate_up inputs, so that the chain's
// values stay near 1), times the Dot's input scale (exact).
template <class Dot>
__device__ void StageIn(float4* xs, const bf16* in, int k, bool norm, float* red) {
  const float inv = norm ? InvRms(in, k, 1e-5f, red) : 1.0f;
  for (int i = threadIdx.x; i < k / 4; i += kThreads) {
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(in) + i);
    const float e[4] = {__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                        __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u)};
    float y[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) y[j] = StageMul<Dot>(norm ? Rb(__fmul_rn(e[j], inv)) : e[j]);
    xs[XQuad(i >> 2, i & 3)] = make_float4(y[0], y[1], y[2], y[3]);
  }
  BlockSync();
}

struct Epis {
  const Chain& C;
  int l;
  __device__ float2 pre(int p, int n) const {
    const float* s = C.sc[4 * l + p];
    return make_float2(__ldg(s + n), p == 2 ? __ldg(s + C.F + n) : 0.0f);
  }
  __device__ void operator()(int p, int n, float r0, float r1, float2 sc) const {
    switch (p) {
      case 0: C.y0[n] = __float2bfloat16_rn(__fmul_rn(r0, sc.x)); break;
      case 1: C.y1[n] = __float2bfloat16_rn(__fmul_rn(r0, sc.x)); break;
      case 2: {
        const float g = Rb(__fmul_rn(r0, sc.x)), u = Rb(__fmul_rn(r1, sc.y));
        C.act[n] = __float2bfloat16_rn(__fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u));
        break;
      }
      default: C.x[n] = __float2bfloat16_rn(__fmul_rn(r0, sc.x));
    }
  }
};

__device__ __forceinline__ const bf16* ChainIn(const Chain& C, int p, int* k) {
  switch (p) {
    case 0: *k = C.H; return C.x;
    case 1: *k = C.Q; return C.y0;
    case 2: *k = C.H; return C.y1;
    default: *k = C.F; return C.act;
  }
}

// The ring: 1 block per SM, kThreads consumers + 1 producer warp. MODE 0: everything; 1: the
// consumers only wait for and release each stage (no math, no staging), with the barriers;
// 2: the same without the barriers (the bare stream); 3: the math on whatever the stages hold,
// never waiting for a copy (the consumers' own ceiling, with the barriers).
template <class Dot, int MODE>
__global__ void __launch_bounds__(kThreads + 32, 1) RingChain(const __grid_constant__ Chain C) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float red[kWarps];
  const int max_k = max(max(C.H, C.Q), C.F);
  const size_t xs_bytes = (static_cast<size_t>(max_k) * 4 + 127) / 128 * 128;
  float4* xs = reinterpret_cast<float4*>(smem);
  Ring ring{smem + xs_bytes,
            reinterpret_cast<uint64_t*>(smem + xs_bytes + static_cast<size_t>(C.stages) * kStageBytes),
            nullptr, C.stages, 0};
  ring.empty = ring.full + C.stages;
  if (threadIdx.x == 0) RingInit(ring);
  __syncthreads();
  const auto mats = [&](int l, int p) { return ChainMat(C, l, p); };
  if (threadIdx.x >= kThreads) {
    if (MODE != 3) Produce(mats, C.layers, ring);  // compute only: no copies at all
    return;
  }
  unsigned bars = 0;
  for (int l = 0; l < C.layers; ++l)
    for (int p = 0; p < 4; ++p) {
      const Mat m = ChainMat(C, l, p);
      if (MODE == 0) {
        int k;
        const bf16* in = ChainIn(C, p, &k);
        StageIn<Dot>(xs, in, k, p % 2 == 0, red);
        const Epis epi{C, l};
        RingGemv<Dot>(m, ring, xs, [&](int n) { return epi.pre(p, n); },
                      [&](int n, float r0, float r1, float2 pre) { epi(p, n, r0, r1, pre); });
      } else if (MODE == 3) {  // timing only: the same math, no wait for the copies
        int k;
        const bf16* in = ChainIn(C, p, &k);
        StageIn<Dot>(xs, in, k, p % 2 == 0, red);
        const Epis epi{C, l};
        const Dot dot{};
        const Part pt = PartOf(m);
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sw = (lane >> 1) & 3;
        constexpr int R = kWarpRows, kU = kSlabChunks / 32;
        for (int r = 0; r < pt.rounds; ++r) {
          float acc[R];
#pragma unroll
          for (int i = 0; i < R; ++i) acc[i] = 0.0f;
          for (int sl = 0; sl < pt.slabs; ++sl) {  // every slab as if full, stage sl % stages
            const uint4* w = reinterpret_cast<const uint4*>(ring.buf + (sl % ring.stages) * kStageBytes +
                                                            R * warp * kSlab);
            const float4* x = xs + 4 * (sl % 2) * kSlabChunks;
            float4 q[kU][4];
            uint4 a[kU][R];
#pragma unroll
            for (int u = 0; u < kU; ++u) {
              const int c = lane + 32 * u;
#pragma unroll
              for (int j = 0; j < 4; ++j) q[u][j] = x[4 * c + (j ^ sw)];
#pragma unroll
              for (int i = 0; i < R; ++i) a[u][i] = w[i * kSlabChunks + c];
            }
#pragma unroll
            for (int u = 0; u < kU; ++u)
#pragma unroll
              for (int i = 0; i < R; ++i) acc[i] = __fadd_rn(acc[i], dot(a[u][i], q[u]));
          }
          float tot = 0.0f;
#pragma unroll
          for (int i = 0; i < R; ++i) tot = __fadd_rn(tot, WarpSum(acc[i]));
          const int item = SlotItem(m, pt, r, R * warp);
          if (lane == 0 && item >= 0) epi(p, item, tot, tot, epi.pre(p, item));
        }
      } else {
        const Part pt = PartOf(m);
        for (int i = 0; i < pt.rounds * pt.slabs; ++i, ++ring.n) {
          const int st = static_cast<int>(ring.n % ring.stages);
          MbarWait(ring.full + st, (ring.n / ring.stages) & 1);
          asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddr(ring.empty + st))
                       : "memory");
        }
      }
      if (MODE != 2) GridSync(C.counter, ++bars * gridDim.x);
    }
}

__global__ void FillW(uint8_t* w, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
    uint8_t b = h & 0xff;
    if ((b & 0x7f) == 0x7f) b &= 0xf7;  // no NaN
    if ((b & 0x78) > 0x58) b &= 0xcf;   // magnitudes up to ~2^4: a realistic spread
    w[i] = b;
  }
}

struct Shapes {
  const char* name;
  int H, Q, NQKV, F;
};

int main() {
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  sms = prop.multiProcessorCount;
  printf("device %s, %d SMs, L2 %d MB, smem opt-in %zu\n", prop.name, sms, prop.l2CacheSize >> 20,
         prop.sharedMemPerBlockOptin);
  // The copy ceiling: a 4 GiB device-to-device copy (bytes read + written).
  {
    size_t n = size_t(2) << 30;
    void *a, *b;
    CK(cudaMalloc(&a, n));
    CK(cudaMalloc(&b, n));
    CK(cudaMemset(a, 1, n));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int i = 0; i < 8; ++i) {
      CK(cudaEventRecord(e0));
      CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice));
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (i >= 2) t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    printf("d2d copy: %.3f TB/s (read + write)\n", 2.0 * n / (t[t.size() / 2] * 1e-3) / 1e12);
    CK(cudaFree(a));
    CK(cudaFree(b));
  }
  const Shapes shapes[2] = {{"tp1", 4096, 4096, 6144, 14336}, {"tp2_rank", 4096, 2048, 3072, 7168}};
  for (const Shapes& sh : shapes) {
    Chain C = {};
    C.layers = kMaxL, C.H = sh.H, C.Q = sh.Q, C.NQKV = sh.NQKV, C.F = sh.F;
    const size_t n[4] = {(size_t)sh.NQKV * sh.H, (size_t)sh.H * sh.Q, (size_t)2 * sh.F * sh.H,
                         (size_t)sh.H * sh.F};
    const int rows[4] = {sh.NQKV, sh.H, 2 * sh.F, sh.H}, ks[4] = {sh.H, sh.Q, sh.H, sh.F};
    double bytes = 0;
    std::vector<void*> allocs;
    for (int l = 0; l < kMaxL; ++l)
      for (int p = 0; p < 4; ++p) {
        uint8_t* w;
        CK(cudaMalloc(&w, n[p]));
        FillW<<<1024, 256>>>(w, n[p], 7919u * (4 * l + p) + 1);
        CK(cudaGetLastError());
        std::vector<float> s(rows[p]);
        for (int r = 0; r < rows[p]; ++r)
          s[r] = (0.5f + (float)((r * 37 + l * 11 + p) % 101) / 101.f) / (4.0f * std::sqrt((float)ks[p]));
        float* sd;
        CK(cudaMalloc(&sd, 4 * s.size()));
        CK(cudaMemcpy(sd, s.data(), 4 * s.size(), cudaMemcpyHostToDevice));
        C.w[4 * l + p] = w, C.sc[4 * l + p] = sd;
        allocs.push_back(w), allocs.push_back(sd);
        bytes += n[p];
      }
    std::vector<uint16_t> x0(sh.H);
    for (int j = 0; j < sh.H; ++j) {
      float v = std::sin(0.37f * j + 1.f) * 1.5f;
      uint32_t u;
      memcpy(&u, &v, 4);
      x0[j] = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    }
    CK(cudaMalloc(&C.x, 2 * sh.H));
    CK(cudaMalloc(&C.y0, 2 * sh.NQKV));
    CK(cudaMalloc(&C.y1, 2 * sh.H));
    CK(cudaMalloc(&C.act, 2 * sh.F));
    CK(cudaMalloc(&C.counter, 4));
    const int max_k = std::max(std::max(sh.H, sh.Q), sh.F);
    const size_t xs_bytes = ((size_t)max_k * 4 + 127) / 128 * 128;
    C.stages = (int)std::min<size_t>(8, (prop.sharedMemPerBlockOptin - xs_bytes - 1024) / (kStageBytes + 16));
    printf("\n[%s] %.3f GB of weights per chain, ring: %d stages of %d KiB\n", sh.name, bytes / 1e9,
           C.stages, kStageBytes / 1024);

    std::vector<uint16_t> ref;
    auto run = [&](const char* name, void* fn, int blocks_per_sm, int threads, size_t smem) {
      CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
      int per_sm = 0;
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, threads, smem));
      if (per_sm < blocks_per_sm) {
        printf("%-28s does not fit (%d blocks per SM)\n", name, per_sm);
        return;
      }
      const int blocks = blocks_per_sm * sms;
      cudaEvent_t e0, e1;
      CK(cudaEventCreate(&e0));
      CK(cudaEventCreate(&e1));
      std::vector<float> t;
      Chain Cr = C;
      void* args[] = {&Cr};
      for (int i = 0; i < 18; ++i) {
        CK(cudaMemcpy(C.x, x0.data(), 2 * sh.H, cudaMemcpyHostToDevice));
        CK(cudaMemset(C.counter, 0, 4));
        CK(cudaMemset(C.y0, 0xff, 2 * sh.NQKV));  // poisoned (NaN)
        CK(cudaEventRecord(e0));
        CK(cudaLaunchCooperativeKernel(fn, dim3(blocks), dim3(threads), args, smem, 0));
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        CK(cudaGetLastError());
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 3) t.push_back(ms);
      }
      std::sort(t.begin(), t.end());
      const float med = t[t.size() / 2];
      std::vector<uint16_t> out(sh.H);
      CK(cudaMemcpy(out.data(), C.x, 2 * sh.H, cudaMemcpyDeviceToHost));
      const char* check = "";
      if (std::string(name).find("nomath") == std::string::npos &&
          std::string(name).find("only") == std::string::npos) {
        int nonfinite = 0, zero = 0;
        for (uint16_t v : out) nonfinite += (v & 0x7f80) == 0x7f80, zero += (v & 0x7fff) == 0;
        if (ref.empty()) {
          ref = out;
          static char buf[96];
          uint32_t hash = 2166136261u;
          for (uint16_t v : out) hash = (hash ^ v) * 16777619u;
          snprintf(buf, sizeof buf, "reference (%d non-finite, %d zero of %d, hash %08x)", nonfinite, zero,
                   sh.H, hash);
          check = buf;
        } else {
          int diff = 0;
          for (int j = 0; j < sh.H; ++j) diff += out[j] != ref[j];
          static char buf[96];
          snprintf(buf, sizeof buf, "%s (%d of %d differ)", diff ? "BITS DIFFER" : "bits equal", diff, sh.H);
          check = buf;
        }
      }
      printf("%-28s %8.3f ms  %5.2f TB/s  p10-p90 %.3f-%.3f  %s\n", name, med, bytes / (med * 1e-3) / 1e12,
             t[t.size() / 10], t[t.size() * 9 / 10], check);
    };
    const size_t ring_smem = xs_bytes + (size_t)C.stages * (kStageBytes + 16);
    printf("consumer warps %d, rows per warp %d, slab %d bytes\n", kWarps, kWarpRows, kSlab);
    run("ring cvt", (void*)RingChain<CvtDot, 0>, 1, kThreads + 32, ring_smem);
    run("ring bits", (void*)RingChain<BitsDot, 0>, 1, kThreads + 32, ring_smem);
    run("ring pairs", (void*)RingChain<PairsDot, 0>, 1, kThreads + 32, ring_smem);
    run("ring pairsmul", (void*)RingChain<PairsMulDot, 0>, 1, kThreads + 32, ring_smem);
    run("ring hybridmul", (void*)RingChain<HybridMulDot, 0>, 1, kThreads + 32, ring_smem);
    run("ring cvt, compute only", (void*)RingChain<CvtDot, 3>, 1, kThreads + 32, ring_smem);
    run("ring bits, compute only", (void*)RingChain<BitsDot, 3>, 1, kThreads + 32, ring_smem);
    run("ring pairs, compute only", (void*)RingChain<PairsDot, 3>, 1, kThreads + 32, ring_smem);
    run("ring pairsmul, compute only", (void*)RingChain<PairsMulDot, 3>, 1, kThreads + 32, ring_smem);
    run("ring hybridmul, compute only", (void*)RingChain<HybridMulDot, 3>, 1, kThreads + 32, ring_smem);
    run("ring nomath + barriers", (void*)RingChain<CvtDot, 1>, 1, kThreads + 32, ring_smem);
    run("ring stream only", (void*)RingChain<CvtDot, 2>, 1, kThreads + 32, ring_smem);
    for (void* a : allocs) CK(cudaFree(a));
    CK(cudaFree(C.x));
    CK(cudaFree(C.y0));
    CK(cudaFree(C.y1));
    CK(cudaFree(C.act));
    CK(cudaFree(C.counter));
  }
  return 0;
}
