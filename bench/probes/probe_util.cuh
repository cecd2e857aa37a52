// What the standalone CUDA probes share: bf16 rounding, a checked CUDA call, a deterministic
// random fill and event timing.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

using bf16 = __nv_bfloat16;

// v rounded to bf16, where the decoder's bf16 activations round (a double goes through float,
// as the host references do).
__host__ __device__ inline float Bf(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Any failed CUDA call ends the probe with its name and place.
#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
      exit(1);                                                                                \
    }                                                                                         \
  } while (0)

// p[i] = offset + uniform(-scale, scale), a hash of (i, seed): the same data on every run.
__global__ void Fill(bf16* p, size_t n, uint32_t seed, float scale, float offset = 0.f) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed * 40503u ^ (uint32_t)(i >> 32) * 97u;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    p[i] = __float2bfloat16_rn(offset + ((h & 0xffffff) / 16777216.0f * 2.f - 1.f) * scale);
  }
}

// Milliseconds of each of `reps` timed runs of enqueue() on stream s (events around each run,
// after `warmup` untimed ones), sorted: front() the fastest, [size() / 2] the median.
template <class F>
std::vector<float> TimeRuns(F enqueue, cudaStream_t s, int reps, int warmup = 3) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) enqueue();
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a, s));
    enqueue();
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return t;
}
