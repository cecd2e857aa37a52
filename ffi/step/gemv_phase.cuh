// A GEMV phase of the persistent step: the rows of one projection over the grid's warps, in
// fp8_matvec's lanes-32 row order (a warp per output row; `rows` weight rows per item, as gate
// and up for SwiGLU), the next projection's first loads issued before the phase ends.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "step/device_math.cuh"

namespace sifar {
namespace cuda {
namespace phase {

__device__ __forceinline__ void Issue(uint4 (&v)[kU], const Mat& m, int item, int b) {
  const int lane = threadIdx.x % 32, nl = (m.k + 511) / 512, nb = (nl + kU - 1) / kU;
  const int row = min(item, m.items - 1) + (b / nb) * m.pair, bb = b % nb;
  const uint8_t* p = m.w + static_cast<size_t>(row) * m.k + lane * 16 + bb * kU * 512;
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int ci = bb * kU + u;
    if (ci < nl && (lane + 32 * ci) * 16 < m.k) v[u] = LoadW(p + u * 512);
  }
}

// The phase's items over the grid's warps (item = warp + i * all warps); A holds this warp's
// first batch on entry and the next phase's (nx) on return. epi(item, its rows' sums).
// mat_at(l, p): projection p of layer l's descriptor (read when needed, not held).
template <class MatAt, class Epi>
__device__ __forceinline__ void Gemv(MatAt mat_at, int l, int p, int next_l, int next_p,
                                     const float4* xs, uint4 (&A)[kU], uint4 (&B)[kU], Epi epi) {
  const Mat m = mat_at(l, p);
  const bool has_next = next_p >= 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sw = (lane >> 1) & 3;
  const int first = blockIdx.x * kWarps + warp, stride = gridDim.x * kWarps;
  const int nl = (m.k + 511) / 512, nb = (nl + kU - 1) / kU, tb = m.rows * nb;
  int item = first, b = 0;
  float acc = 0.0f, r0 = 0.0f, r1 = 0.0f;
  auto step = [&](const uint4 (&cur)[kU], uint4 (&nxt)[kU]) {
    int in = item, bn = b + 1;
    if (bn >= tb) bn = 0, in = item + stride;
    if (in < m.items)
      Issue(nxt, m, in, bn);
    else if (has_next)
      Issue(nxt, mat_at(next_l, next_p), first, 0);
    const int bb = b % nb;
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int ci = bb * kU + u, c = lane + 32 * ci;
      if (ci >= nl) break;
      if (c * 16 >= m.k) continue;
      float4 q[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) q[j] = xs[4 * c + (j ^ sw)];
      acc = __fadd_rn(acc, Chunk(cur[u], q));
    }
    if ((b + 1) % nb == 0) {
      const float sum = WarpSum(acc);
      if (b < nb) r0 = sum; else r1 = sum;
      acc = 0.0f;
    }
    if (bn == 0 && lane == 0) epi(item, r0, r1);
    item = in, b = bn;
    return item < m.items;
  };
  bool in_a = true;
  if (item >= m.items) {
    if (has_next) Issue(A, mat_at(next_l, next_p), first, 0);
  } else {
    while (true) {
      if (!step(A, B)) { in_a = false; break; }
      if (!step(B, A)) { in_a = true; break; }
    }
  }
  if (!in_a) {
#pragma unroll
    for (int u = 0; u < kU; ++u) A[u] = B[u];
  }
}


}  // namespace phase
}  // namespace cuda
}  // namespace sifar
