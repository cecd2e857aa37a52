// Probe: can a hand-written batch-1 GEMV (y[M,N] = x[M,K] @ W[K,N], bf16, W row-major [K, N] as
// the decoder stores it) stream Llama-8B's TP=1 projection weights faster than XLA's Triton
// GEMMs? A standalone CUDA program (no XLA, no extension), timed as CUDA graphs of 32 launches
// with distinct weights, each configuration checked first against a float64 reference on random
// data with its output poisoned; bench/probes/gemv_cluster_xla.py times XLA's side the same way.
//
// The kernel: a tile of TN = LANES x 8 columns per block (16-byte loads, U rows in flight per
// thread), K split over a thread-block cluster of C blocks and reduced in order through
// distributed shared memory: deterministic, one launch, no second pass.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a bench/probes/gemv_cluster.cu -o /tmp/gemv_cluster
//   /tmp/gemv_cluster            # one GPU (~20 s, 14 GB); then python -m bench.probes.gemv_cluster_xla
//
// Measured on one H200 (docs/performance.md): slower than XLA for o and down, equal for gate_up.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "probe_util.cuh"

namespace cg = cooperative_groups;

template <int HINT>
__device__ __forceinline__ uint4 LoadW(const void* p) {
  uint4 v;
  if constexpr (HINT == 1)
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// LANES threads cover one row segment of TN = LANES * 8 columns; G = THREADS / LANES row groups.
template <int M, int LANES, int WARPS, int U, int HINT>
__global__ void __launch_bounds__(WARPS * 32) Gemv(const bf16* __restrict__ x,
                                                   const bf16* __restrict__ w,
                                                   bf16* __restrict__ y, int K, int N) {
  constexpr int THREADS = WARPS * 32, TN = LANES * 8, G = THREADS / LANES;
  __shared__ float red[G][M][TN];
  __shared__ float part[M][TN];
  cg::cluster_group cl = cg::this_cluster();
  const int C = cl.num_blocks(), r = cl.block_rank();
  const int tile = blockIdx.x / C;
  const int lane = threadIdx.x % LANES, g = threadIdx.x / LANES;
  const int n0 = tile * TN + lane * 8;
  const int Kc = K / C, kb = r * Kc;
  const bf16* wp = w + (size_t)kb * N + n0;
  const bf16* xp = x + kb;
  float acc[M][8];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[m][e] = 0.f;
  for (int j = g; j < Kc; j += G * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kk = j + u * G;
      if (kk < Kc) v[u] = LoadW<HINT>(wp + (size_t)kk * N);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kk = j + u * G;
      if (kk < Kc) {
        const __nv_bfloat162* t = reinterpret_cast<const __nv_bfloat162*>(&v[u]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const float xv = __bfloat162float(xp[(size_t)m * K + kk]);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = __bfloat1622float2(t[e]);
            acc[m][2 * e] = fmaf(xv, f.x, acc[m][2 * e]);
            acc[m][2 * e + 1] = fmaf(xv, f.y, acc[m][2 * e + 1]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int e = 0; e < 8; ++e) red[g][m][lane * 8 + e] = acc[m][e];
  __syncthreads();
  for (int i = threadIdx.x; i < M * TN; i += THREADS) {
    const int m = i / TN, c = i % TN;
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < G; ++q) s += red[q][m][c];
    part[m][c] = s;
  }
  cl.sync();
  const int per = TN / C;
  for (int i = threadIdx.x; i < M * per; i += THREADS) {
    const int m = i / per, c = r * per + i % per;
    float s = 0.f;
    for (int q = 0; q < C; ++q) s += *cl.map_shared_rank(&part[m][c], q);
    y[(size_t)m * N + tile * TN + c] = __float2bfloat16_rn(s);
  }
  cl.sync();
}

__global__ void Reference(const bf16* x, const bf16* w, float* y, int M, int K, int N) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  for (int m = 0; m < M; ++m) {
    double s = 0;
    for (int k = 0; k < K; ++k)
      s += (double)__bfloat162float(x[(size_t)m * K + k]) * __bfloat162float(w[(size_t)k * N + n]);
    y[(size_t)m * N + n] = (float)s;
  }
}

struct Config {
  std::string name;
  int M, lanes, warps, unroll, hint, cluster;
  std::function<void(const bf16*, const bf16*, bf16*, int, int, cudaStream_t)> launch;
};

template <int M, int LANES, int WARPS, int U, int HINT>
void AddConfigs(std::vector<Config>& out) {
  auto kern = Gemv<M, LANES, WARPS, U, HINT>;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  for (int C : {2, 4, 8, 16}) {
    char buf[96];
    snprintf(buf, sizeof buf, "M%d lanes%d warps%d U%d hint%d C%d", M, LANES, WARPS, U, HINT, C);
    out.push_back({buf, M, LANES, WARPS, U, HINT, C,
                   [kern, C](const bf16* x, const bf16* w, bf16* y, int K, int N, cudaStream_t s) {
                     constexpr int TN = LANES * 8;
                     cudaLaunchConfig_t cfg = {};
                     cfg.gridDim = dim3((N / TN) * C);
                     cfg.blockDim = dim3(WARPS * 32);
                     cfg.stream = s;
                     cudaLaunchAttribute at[1];
                     at[0].id = cudaLaunchAttributeClusterDimension;
                     at[0].val.clusterDim.x = C;
                     at[0].val.clusterDim.y = 1;
                     at[0].val.clusterDim.z = 1;
                     cfg.attrs = at;
                     cfg.numAttrs = 1;
                     CK(cudaLaunchKernelEx(&cfg, kern, x, w, y, K, N));
                   }});
  }
}

struct Shape {
  const char* name;
  int K, N;
};

static float TimeGraph(cudaGraphExec_t ge, cudaStream_t s, int reps) {
  const std::vector<float> t = TimeRuns([&] { CK(cudaGraphLaunch(ge, s)); }, s, reps);
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  const int kChain = 32;
  std::vector<Config> cfgs;
  AddConfigs<1, 32, 4, 8, 0>(cfgs);
  AddConfigs<1, 32, 8, 8, 0>(cfgs);
  AddConfigs<1, 32, 8, 16, 0>(cfgs);
  AddConfigs<1, 32, 8, 8, 1>(cfgs);
  AddConfigs<1, 64, 8, 8, 0>(cfgs);
  AddConfigs<1, 64, 8, 16, 0>(cfgs);
  AddConfigs<1, 64, 8, 16, 1>(cfgs);
  AddConfigs<1, 128, 8, 8, 0>(cfgs);
  AddConfigs<1, 32, 16, 8, 0>(cfgs);
  AddConfigs<2, 32, 8, 8, 0>(cfgs);
  AddConfigs<2, 64, 8, 16, 0>(cfgs);
  const Shape shapes[] = {{"qkv", 4096, 6144}, {"o", 4096, 4096}, {"gate_up", 4096, 28672},
                          {"down", 14336, 4096}};
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  bf16 *x, *y;
  float* ref;
  CK(cudaMalloc(&x, 2 * 14336 * sizeof(bf16)));
  CK(cudaMalloc(&y, 2 * 28672 * sizeof(bf16)));
  CK(cudaMalloc(&ref, 2 * 28672 * sizeof(float)));
  Fill<<<64, 256>>>(x, 2 * 14336, 7, 1.0f);
  std::vector<const Config*> layer_cfg[3];
  for (const Shape& sh : shapes) {
    const size_t elems = (size_t)sh.K * sh.N;
    std::vector<bf16*> ws(kChain);
    for (int i = 0; i < kChain; ++i) {
      CK(cudaMalloc(&ws[i], elems * sizeof(bf16)));
      Fill<<<1024, 256>>>(ws[i], elems, 100 + i, 0.02f);
    }
    CK(cudaDeviceSynchronize());
    float best_us[3] = {1e9f, 1e9f, 1e9f};
    const Config* best_cfg[3] = {nullptr, nullptr, nullptr};
    for (const Config& c : cfgs) {
      const int TN = c.lanes * 8;
      if (sh.N % TN || sh.K % c.cluster || (TN / c.cluster) < 1 || TN % c.cluster) continue;
      // correctness against a float64 reference, output poisoned first
      CK(cudaMemsetAsync(y, 0xff, 2 * 28672 * sizeof(bf16), s));  // ordered before the kernel
      c.launch(x, ws[0], y, sh.K, sh.N, s);
      Reference<<<(sh.N + 255) / 256, 256, 0, s>>>(x, ws[0], ref, c.M, sh.K, sh.N);
      CK(cudaStreamSynchronize(s));
      std::vector<bf16> hy(c.M * sh.N);
      std::vector<float> hr(c.M * sh.N);
      CK(cudaMemcpy(hy.data(), y, hy.size() * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hr.data(), ref, hr.size() * 4, cudaMemcpyDeviceToHost));
      double err = 0, scale = 0;
      for (size_t i = 0; i < hy.size(); ++i) {
        const float v = __bfloat162float(hy[i]);
        err = std::max(err, std::isfinite(v) ? std::fabs((double)v - hr[i]) : 1e30);
        scale = std::max(scale, (double)std::fabs(hr[i]));
      }
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < kChain; ++i) c.launch(x, ws[i], y, sh.K, sh.N, s);
      CK(cudaStreamEndCapture(s, &g));
      cudaGraphExec_t ge;
      CK(cudaGraphInstantiate(&ge, g, 0));
      const float ms = TimeGraph(ge, s, 15);
      const float us = ms * 1e3f / kChain;
      // bf16 output rounding is ~2e-3 of the scale; one dropped K term ~1e-2
      printf("%-8s %-36s %7.2f us  %5.2f TB/s  err %.2e of %.2e%s\n", sh.name, c.name.c_str(), us,
             elems * 2.0 / (us * 1e-6) / 1e12, err, scale, err > 4e-3 * scale ? "  WRONG" : "");
      fflush(stdout);
      if (err <= 4e-3 * scale && us < best_us[c.M]) best_us[c.M] = us, best_cfg[c.M] = &c;
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
    }
    for (int m = 1; m <= 2; ++m) layer_cfg[m].push_back(best_cfg[m]);
    for (int m = 1; m <= 2; ++m)
      if (best_cfg[m])
        printf("BEST %-8s M%d: %.2f us (%.2f TB/s) %s\n", sh.name, m, best_us[m],
               elems * 2.0 / (best_us[m] * 1e-6) / 1e12, best_cfg[m]->name.c_str());
    for (int i = 0; i < kChain; ++i) CK(cudaFree(ws[i]));
  }
  // A 32-layer chain of the four projections (qkv, o, gate_up, down), each shape with its best
  // configuration: the same weight bytes as XLA's chain in gemv_cluster_xla.py.
  const int L = 32;
  std::vector<bf16*> lw;
  size_t total = 0;
  for (int l = 0; l < L; ++l)
    for (const Shape& sh : shapes) {
      bf16* p;
      const size_t elems = (size_t)sh.K * sh.N;
      CK(cudaMalloc(&p, elems * sizeof(bf16)));
      Fill<<<1024, 256>>>(p, elems, 1000 + (uint32_t)lw.size(), 0.02f);
      lw.push_back(p);
      total += elems * 2;
    }
  bf16 *a, *b;
  CK(cudaMalloc(&a, 2 * 28672 * sizeof(bf16)));
  CK(cudaMalloc(&b, 2 * 28672 * sizeof(bf16)));
  Fill<<<64, 256>>>(a, 2 * 28672, 9, 1.0f);
  CK(cudaDeviceSynchronize());
  for (int m = 1; m <= 2; ++m) {
    bool ok = true;
    for (auto* c : layer_cfg[m]) ok = ok && c;
    if (!ok) continue;
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int l = 0; l < L; ++l)
      for (int p = 0; p < 4; ++p) {
        // in: the first K of the previous output (rows spaced by K: a [M, K] view of row 0..)
        layer_cfg[m][p]->launch(p % 2 ? b : a, lw[l * 4 + p], p % 2 ? a : b, shapes[p].K,
                                shapes[p].N, s);
      }
    CK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t ge;
    CK(cudaGraphInstantiate(&ge, g, 0));
    const float ms = TimeGraph(ge, s, 15);
    printf("LAYER CHAIN M%d: %d layers %.3f ms, %.2f us per layer, %.2f TB/s (%.2f GB)\n", m, L,
           ms, ms * 1e3 / L, total / (ms * 1e-3) / 1e12, total / 1e9);
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
  }
  return 0;
}
