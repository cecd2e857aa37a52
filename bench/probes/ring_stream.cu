// Probe (leaves the tree once answered; its answer goes to docs/performance.md): does the
// persistent step's GEMV phase stream FP8 weights faster when one producer warp per block
// feeds a ring of shared-memory stages with bulk copies (ffi/step/ring_gemv.cuh) than as the
// row kernel's register double buffers (ffi/step/gemv_phase.cuh, the product today)? And is
// the e4m3 decode by conversion instructions (Chunk) or by integer ops (ChunkScaled) the
// consumers' limit?
//
// The chain: 32 layers of Llama-3.1-8B's four FP8 projections (TP=1, or TP=2's per-rank
// shapes), each projection's output the next one's input (qkv -> o -> gate_up + SwiGLU ->
// down -> the next layer's qkv), a grid barrier after each, as one cooperative launch: the
// persistent step without its norms and attention. Every variant's final output must equal
// the row kernel's bit for bit (the same lanes-32 sums); each is timed as the median of 15
// launches after 3.
//   nvcc -O3 -std=c++17 -arch=sm_90 -Iffi -I"$(python3 -c 'import jax.ffi; print(jax.ffi.include_dir())')" \
//     bench/probes/ring_stream.cu -o /tmp/rs && /tmp/rs
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
#include "step/gemv_phase.cuh"
#include "step/grid_sync.cuh"
#include "step/norm_phase.cuh"
#include "step/ring_gemv.cuh"

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
// values stay near 1) * mul (a power of two: exact)
__device__ void StageIn(float4* xs, const bf16* in, int k, bool norm, float mul, float* red) {
  const float inv = norm ? InvRms(in, k, 1e-5f, red) : 1.0f;
  for (int i = threadIdx.x; i < k / 4; i += kThreads) {
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(in) + i);
    const float e[4] = {__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                        __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u)};
    float y[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) y[j] = (norm ? Rb(__fmul_rn(e[j], inv)) : e[j]) * mul;
    xs[XQuad(i >> 2, i & 3)] = make_float4(y[0], y[1], y[2], y[3]);
  }
  BlockSync();
}

struct Epis {
  const Chain& C;
  int l;
  float unscale;
  __device__ void operator()(int p, int n, float r0, float r1) const {
    const float* s = C.sc[4 * l + p];
    r0 = r0 * unscale, r1 = r1 * unscale;
    switch (p) {
      case 0: C.y0[n] = __float2bfloat16_rn(__fmul_rn(r0, s[n])); break;
      case 1: C.y1[n] = __float2bfloat16_rn(__fmul_rn(r0, s[n])); break;
      case 2: {
        const float g = Rb(__fmul_rn(r0, s[n])), u = Rb(__fmul_rn(r1, s[C.F + n]));
        C.act[n] = __float2bfloat16_rn(__fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u));
        break;
      }
      default: C.x[n] = __float2bfloat16_rn(__fmul_rn(r0, s[n]));
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

// The product's phase today: 2 blocks of 256 per SM, register double buffers.
__global__ void __launch_bounds__(kThreads, 2) RowsChain(const __grid_constant__ Chain C) {
  extern __shared__ float4 xs[];
  __shared__ float red[kWarps];
  uint4 A[kU], B[kU];
  const int first = blockIdx.x * kWarps + threadIdx.x / 32;
  const auto mats = [&](int l, int p) { return ChainMat(C, l, p); };
  Issue(A, ChainMat(C, 0, 0), first, 0);
  unsigned bars = 0;
  for (int l = 0; l < C.layers; ++l)
    for (int p = 0; p < 4; ++p) {
      int k;
      const bf16* in = ChainIn(C, p, &k);
      StageIn(xs, in, k, p % 2 == 0, 1.0f, red);
      const int nl = p < 3 ? l : l + 1, np = p < 3 ? p + 1 : (l + 1 < C.layers ? 0 : -1);
      const Epis epi{C, l, 1.0f};
      Gemv(mats, l, p, nl, np, xs, A, B, [&](int n, float r0, float r1) { epi(p, n, r0, r1); });
      GridSync(C.counter, ++bars * gridDim.x);
    }
}

// The ring: 1 block per SM, kThreads consumers + 1 producer warp. MODE 0: everything; 1: the
// consumers only wait for and release each stage (no math, no staging), with the barriers;
// 2: the same without the barriers (the bare stream).
template <int DECODE, int MODE>
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
    Produce(mats, C.layers, ring);
    return;
  }
  unsigned bars = 0;
  for (int l = 0; l < C.layers; ++l)
    for (int p = 0; p < 4; ++p) {
      const Mat m = ChainMat(C, l, p);
      if (MODE == 0) {
        int k;
        const bf16* in = ChainIn(C, p, &k);
        StageIn(xs, in, k, p % 2 == 0, DECODE == 1 ? 0x1p100f : 1.0f, red);
        const Epis epi{C, l, DECODE == 1 ? 0x1p20f : 1.0f};
        RingGemv<DECODE>(m, ring, xs, [&](int n, float r0, float r1) { epi(p, n, r0, r1); });
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
          std::string(name).find("stream") == std::string::npos) {
        int nonfinite = 0, zero = 0;
        for (uint16_t v : out) nonfinite += (v & 0x7f80) == 0x7f80, zero += (v & 0x7fff) == 0;
        if (ref.empty()) {
          ref = out;
          static char buf[96];
          snprintf(buf, sizeof buf, "reference (%d non-finite, %d zero of %d)", nonfinite, zero, sh.H);
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
    const size_t rows_smem = (size_t)max_k * 4;
    const size_t ring_smem = xs_bytes + (size_t)C.stages * (kStageBytes + 16);
    run("rows (product today)", (void*)RowsChain, 2, kThreads, rows_smem);
    run("ring, cvt decode", (void*)RingChain<0, 0>, 1, kThreads + 32, ring_smem);
    run("ring, integer decode", (void*)RingChain<1, 0>, 1, kThreads + 32, ring_smem);
    const int stages = C.stages;
    for (int st = 3; st < stages; ++st) {
      C.stages = st;
      char name[64];
      snprintf(name, sizeof name, "ring, integer, %d stages", st);
      run(name, (void*)RingChain<1, 0>, 1, kThreads + 32, xs_bytes + (size_t)st * (kStageBytes + 16));
    }
    C.stages = stages;
    run("ring nomath + barriers", (void*)RingChain<0, 1>, 1, kThreads + 32, ring_smem);
    run("ring stream only", (void*)RingChain<0, 2>, 1, kThreads + 32, ring_smem);
    for (void* a : allocs) CK(cudaFree(a));
    CK(cudaFree(C.x));
    CK(cudaFree(C.y0));
    CK(cudaFree(C.y1));
    CK(cudaFree(C.act));
    CK(cudaFree(C.counter));
  }
  return 0;
}
