// Run: nvcc -O3 -std=c++17 -arch=sm_90a -o fp8probe bench/probes/fp8_row_variants.cu && ./fp8probe 1 && ./fp8probe 2 chain
// (the two calls of 2026-12-04 ran this file's first variant list, then this one; docs/performance.md)
// Probe (not product): where does the FP8 row kernel's time go?  32 layers x 4 projections of
// Llama-8B (TP=1 or TP=2 per-rank shapes), e4m3 weights, bf16 x, per-channel scale, batch 1,
// as one CUDA graph of 128 PDL launches.  Variants of the row kernel (lanes 32, ksplit 1):
//   MODE 0 cvt: the product's math (cvt e4m3x2 -> f16x2 -> f32, 16 fma per chunk)
//   MODE 1 load: the same loads, words xor-ed (the access pattern's ceiling)
//   MODE 2 bits: e4m3 byte -> f32 bits (w * 2^-120, exact incl. denormals), fma, p * 2^120
//   EARLY: the first batch of weights loaded before griddepcontrol.wait
//   R rows per thread sharing each x quad load; U loads per row per batch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define CK(x)                                                                       \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                      \
    }                                                                               \
  } while (0)

struct P {
  const uint8_t* w;
  const float* s;
  const __nv_bfloat16* x;
  __nv_bfloat16* y;
  int n, k;
};

__device__ __forceinline__ uint4 LoadW(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ void DecodeCvt(const uint4& v, float* f) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(words[i] >> (16 * h));
      const float2 fv = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
      f[4 * i + 2 * h] = fv.x;
      f[4 * i + 2 * h + 1] = fv.y;
    }
}
// byte b (sEEEEMMM) -> float bits s<<31 | EEEEMMM<<20: the value b * 2^-120, exact.
__device__ __forceinline__ void DecodeBits(const uint4& v, float* f) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t top = words[i] << (24 - 8 * j);  // byte j in bits 24..31
      f[4 * i + j] = __uint_as_float((top & 0x80000000u) | ((top >> 4) & 0x07f00000u));
    }
}
__device__ __forceinline__ int XQuad(int c, int q) { return 4 * c + (q ^ ((c >> 1) & 3)); }

template <int MODE>
__device__ __forceinline__ float Chunk(const uint4& v, const float4* xq) {
  if constexpr (MODE == 1) {
    return __uint_as_float((v.x ^ v.y ^ v.z ^ v.w) & 0x3f7fffffu);
  } else if constexpr (MODE == 3) {  // timing only: f16x2 math on x's bits, no f16 -> f32
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
    const __half2* xh = reinterpret_cast<const __half2*>(xq);
    __half2 p = __float2half2_rn(0.0f);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(words[i] >> (16 * h));
        p = __hfma2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)), xh[2 * i + h], p);
      }
    return __low2float(p) + __high2float(p);
  } else {
    float w[16];
    if constexpr (MODE == 0) DecodeCvt(v, w);
    else DecodeBits(v, w);
    const float4 a = xq[0], b = xq[1], c = xq[2], d = xq[3];
    const float x[16] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w,
                         c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
    float p = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) p = __fmaf_rn(x[j], w[j], p);
    return p;
  }
}

template <int MODE, int U, int R, bool EARLY, int MINB>
__global__ void __launch_bounds__(256, MINB) Kern(P a) {
  extern __shared__ float4 xs[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int nl = a.k / 512;                 // chunks per lane per row
  const int nb = (nl + U - 1) / U;          // batches per row
  const int rows_per_block = 8 * R;
  const int groups = (a.n + rows_per_block - 1) / rows_per_block;
  asm volatile("griddepcontrol.launch_dependents;");
  int g = blockIdx.x;
  auto row = [&](int grp, int r) { return min(a.n - 1, grp * rows_per_block + warp * R + r); };
  auto load = [&](uint4 (&v)[R][U], int grp, int b) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = a.w + static_cast<int64_t>(row(grp, r)) * a.k + lane * 16 + b * U * 512;
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (b * U + u < nl) v[r][u] = LoadW(p + u * 512);
    }
  };
  uint4 A[R][U], B[R][U];
  if (g >= groups) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    return;
  }
  if (EARLY) load(A, g, 0);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (!EARLY) load(A, g, 0);
  for (int i = threadIdx.x; i < a.k / 4; i += 256) {
    const uint2 v = *reinterpret_cast<const uint2*>(a.x + 4 * i);
    xs[XQuad(i >> 2, i & 3)] = make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                                           __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
  }
  __syncthreads();
  const int sw = (lane >> 1) & 3;  // chunk lane + 32 i: (c >> 1) & 3 == (lane >> 1) & 3
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  int b = 0;
  auto step = [&](const uint4 (&cur)[R][U], uint4 (&nxt)[R][U]) {
    int gn = g, bn = b + 1;
    if (bn >= nb) bn = 0, gn = g + gridDim.x;
    if (gn < groups) load(nxt, gn, bn);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (b * U + u >= nl) break;
      const int c = lane + 32 * (b * U + u);
      float4 q[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) q[j] = xs[4 * c + (j ^ sw)];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float p = Chunk<MODE>(cur[r][u], q);
        acc[r] = MODE == 2 ? __fmaf_rn(p, 1.329228e36f /* 2^120 */, acc[r]) : __fadd_rn(acc[r], p);
      }
    }
    if (bn == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int off = 16; off >= 1; off /= 2)
          acc[r] = __fadd_rn(acc[r], __shfl_xor_sync(0xffffffffu, acc[r], off));
        const int n = g * rows_per_block + warp * R + r;
        if (lane == 0 && n < a.n) a.y[n] = __float2bfloat16_rn(__fmul_rn(acc[r], __ldg(a.s + n)));
        acc[r] = 0.0f;
      }
    }
    g = gn, b = bn;
    return g < groups;
  };
  while (step(A, B) && step(B, A)) {
  }
}

struct Shape {
  const char* name;
  int k, n;
};

int main(int argc, char** argv) {
  const int tp = argc > 1 ? atoi(argv[1]) : 1;
  const int layers = 32;
  const Shape shapes[4] = {{"qkv", 4096, 6144 / tp}, {"o", 4096 / tp, 4096},
                           {"gate_up", 4096, 28672 / tp}, {"down", 14336 / tp, 4096}};
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  size_t total = 0;
  for (auto& s : shapes) total += static_cast<size_t>(s.k) * s.n;
  total *= layers;
  uint8_t* w;
  CK(cudaMalloc(&w, total));
  {  // random e4m3 bytes, no NaN (0x7f / 0xff)
    std::vector<uint8_t> h(1 << 26);
    std::mt19937 rng(1);
    for (auto& b : h) {
      uint8_t v = static_cast<uint8_t>(rng() & 0xff);
      if ((v & 0x7f) == 0x7f) v ^= 0x01;
      if ((v & 0x78) == 0x78) v &= 0xbf;  // keep |w| <= 2^8 so sums stay tame
      b = v;
    }
    for (size_t off = 0; off < total; off += h.size())
      CK(cudaMemcpy(w + off, h.data(), std::min(h.size(), total - off), cudaMemcpyHostToDevice));
  }
  float* s;
  CK(cudaMalloc(&s, 28672 * sizeof(float)));
  {
    std::vector<float> h(28672, 1.0f / 4096);
    CK(cudaMemcpy(s, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
  }
  __nv_bfloat16 *x, *y;
  CK(cudaMalloc(&x, 2 * 28672 * 2));
  CK(cudaMalloc(&y, 2 * 28672 * 2));
  {
    std::vector<__nv_bfloat16> h(2 * 28672);
    std::mt19937 rng(2);
    std::normal_distribution<float> nd;
    for (auto& v : h) v = __float2bfloat16(nd(rng));
    CK(cudaMemcpy(x, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(y, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  }
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));

  // Time one kernel variant: `which` = -1 the whole chain, else only projection `which`.
  auto run = [&](auto kernel, int R, const char* label, int which, bool pdl, int force_per_sm = 0) {
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024));
    cudaGraph_t graph;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
    size_t off = 0, bytes = 0;
    int flip = 0;
    for (int l = 0; l < layers; ++l)
      for (int j = 0; j < 4; ++j) {
        const Shape& sh = shapes[j];
        const size_t sz = static_cast<size_t>(sh.k) * sh.n;
        if (which < 0 || which == j) {
          P p{w + off, s, flip ? y : x, flip ? x : y, sh.n, sh.k};
          flip ^= 1;
          const size_t smem = sh.k * 4;
          int per_sm = 0;
          CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, smem));
          if (force_per_sm) per_sm = std::min(per_sm, force_per_sm);
          const int groups = (sh.n + 8 * R - 1) / (8 * R);
          cudaLaunchConfig_t cfg = {};
          cfg.gridDim = dim3(std::min(groups, per_sm * sms));
          cfg.blockDim = dim3(256);
          cfg.dynamicSmemBytes = smem;
          cfg.stream = st;
          cudaLaunchAttribute at[1];
          at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
          at[0].val.programmaticStreamSerializationAllowed = 1;
          cfg.attrs = at;
          cfg.numAttrs = pdl ? 1 : 0;
          CK(cudaLaunchKernelEx(&cfg, kernel, p));
          bytes += sz;
        }
        off += sz;
      }
    CK(cudaStreamEndCapture(st, &graph));
    cudaGraphExec_t exec;
    CK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(exec, st));
    std::vector<float> ts;
    for (int i = 0; i < 15; ++i) {
      CK(cudaEventRecord(e0, st));
      CK(cudaGraphLaunch(exec, st));
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      ts.push_back(ms);
    }
    std::sort(ts.begin(), ts.end());
    const float ms = ts[ts.size() / 2];
    printf("tp%d %-8s %-34s %8.4f ms %6.3f TB/s\n", tp, which < 0 ? "chain" : shapes[which].name,
           label, ms, bytes / (ms * 1e-3) / 1e12);
    fflush(stdout);
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
  };

  // Correctness of the probe: cvt vs bits vs a float64 host sum for qkv's first layer.
  {
    const Shape& sh = shapes[0];
    P p{w, s, x, y, sh.n, sh.k};
    std::vector<uint8_t> hw(static_cast<size_t>(sh.n) * sh.k);
    CK(cudaMemcpy(hw.data(), w, hw.size(), cudaMemcpyDeviceToHost));
    std::vector<__nv_bfloat16> hx(sh.k);
    CK(cudaMemcpy(hx.data(), x, sh.k * 2, cudaMemcpyDeviceToHost));
    auto e4m3 = [](uint8_t b) {
      const int sgn = b >> 7, e = (b >> 3) & 15, m = b & 7;
      const double v = e ? std::ldexp(1.0 + m / 8.0, e - 7) : std::ldexp(m / 8.0, -6);
      return sgn ? -v : v;
    };
    auto check = [&](auto kernel, const char* label) {
      CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024));
      CK(cudaMemset(y, 0xff, sh.n * 2));  // poison (NaN)
      kernel<<<264, 256, sh.k * 4, st>>>(p);
      CK(cudaGetLastError());
      CK(cudaStreamSynchronize(st));
      std::vector<__nv_bfloat16> hy(sh.n);
      CK(cudaMemcpy(hy.data(), y, sh.n * 2, cudaMemcpyDeviceToHost));
      double worst = 0, maxref = 0;
      for (int n = 0; n < sh.n; ++n) {
        double ref = 0;
        for (int k = 0; k < sh.k; ++k)
          ref += static_cast<double>(__bfloat162float(hx[k])) * e4m3(hw[static_cast<size_t>(n) * sh.k + k]);
        ref /= 4096;
        const double got = __bfloat162float(hy[n]);
        worst = std::max(worst, std::isfinite(got) ? std::fabs(got - ref) / (std::fabs(ref) + 1e-3) : 1e30);
        maxref = std::max(maxref, std::fabs(ref));
      }
      printf("check %-12s worst rel err %.3g (bf16 half-ulp 2^-9 = %.3g), max |y| %.3g\n", label, worst,
             std::ldexp(1.0, -9), maxref);
    };
    check(Kern<0, 8, 1, false, 2>, "cvt");
    check(Kern<2, 8, 1, false, 2>, "bits");
    check(Kern<2, 4, 2, true, 2>, "bits R2 early");
  }

  for (int which = -1; which < 4; ++which) {
    if (which >= 0 && argc > 2 && strcmp(argv[2], "chain") == 0) break;
    run(Kern<0, 8, 1, false, 2>, 1, "cvt U8 (product)", which, true);
    run(Kern<1, 8, 1, false, 2>, 1, "load U8", which, true);
    run(Kern<3, 8, 1, false, 2>, 1, "f16 math U8 (timing only)", which, true);
    run(Kern<0, 4, 2, true, 2>, 2, "cvt U4 R2 early", which, true);
    run(Kern<0, 2, 4, true, 2>, 4, "cvt U2 R4 early", which, true);
    run(Kern<0, 8, 1, true, 2>, 1, "cvt U8 early grid1/SM", which, true, 1);
    run(Kern<0, 8, 1, false, 2>, 1, "cvt U8 grid1/SM", which, true, 1);
    run(Kern<0, 4, 2, true, 2>, 2, "cvt U4 R2 early grid1/SM", which, true, 1);
    run(Kern<0, 2, 4, true, 2>, 4, "cvt U2 R4 early grid1/SM", which, true, 1);
    run(Kern<1, 4, 2, true, 2>, 2, "load U4 R2 early grid1/SM", which, true, 1);
    run(Kern<1, 8, 1, true, 2>, 1, "load U8 early grid1/SM", which, true, 1);
    run(Kern<3, 4, 2, true, 2>, 2, "f16 math U4 R2 early (timing)", which, true);
  }
  printf("done\n");
  return 0;
}
