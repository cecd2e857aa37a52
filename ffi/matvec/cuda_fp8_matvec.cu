// The FP8-weight product on CUDA (fp8_matvec.h): one launch, no workspace.  A persistent grid
// (as many blocks as stay resident, each looping over groups of rows); each weight row (K
// contiguous bytes) is read by `lanes` threads in 16-byte loads, the next batch of loads in
// flight while the current one is added up; `ksplit` warps of a block share a row's K and add
// their sums through shared memory.  Two kernels: Fp8RowKernel for one x row per block (batch
// 1, and every expert-stack call), which stages the row once per block in shared memory as
// float, so a chunk costs 4 shared loads, its decode and 16 fmas, with no branch between the
// chunks of a batch; Fp8MatVecKernel for 2-8 x rows sharing a weight row (and a K too large
// to stage), which reads x through L1.  With pdl the launch is a programmatic dependent launch:
// the block lets the next kernel launch, optionally (prefetch) asks L2 for its first rows
// (weights never depend on the previous kernel; an L2 prefetch binds no value), then waits for
// the previous kernel before reading x and ids.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <tuple>
#include <type_traits>
#include <vector>

#include "allreduce/launch.h"
#include "allreduce/plan.h"
#include "core/cuda_check.h"
#include "matvec/fp8_matvec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sifar {
namespace cuda {
namespace {

using fp8mv::kChunk;
using fp8mv::kThreads;
using fp8mv::kWarps;

struct Fp8Args {
  const void* x;
  const uint8_t* w;
  const float* scale;
  const int32_t* ids;
  void* y;
  int64_t m, k, n, e, sn, sk, block_n, block_k;
  int lanes, ksplit, prefetch;
};

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) { return __float2half_rn(v); }

// A weight vector, read once: past L1, with L2 asked for the whole 256-byte sector group.
__device__ __forceinline__ uint4 LoadWeights(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 16 e4m3 weights as float (exact).
__device__ __forceinline__ void DecodeE4m3(const uint4& v, float* f) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(words[i] >> (16 * h));
      const __half2 hv = __half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3));
      const float2 fv = __half22float2(hv);
      f[4 * i + 2 * h] = fv.x;
      f[4 * i + 2 * h + 1] = fv.y;
    }
  }
}

// 16 activations x[k0 .. k0 + 15] as float.
__device__ __forceinline__ void LoadX16(const float* p, float* f) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(p) + i);
    f[4 * i] = v.x, f[4 * i + 1] = v.y, f[4 * i + 2] = v.z, f[4 * i + 3] = v.w;
  }
}
// bf16: the word's halves shifted into a float's top bits (exact).
__device__ __forceinline__ void LoadX16(const __nv_bfloat16* p, float* f) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      f[8 * i + 2 * j] = __uint_as_float(words[j] << 16);
      f[8 * i + 2 * j + 1] = __uint_as_float(words[j] & 0xffff0000u);
    }
  }
}
__device__ __forceinline__ void LoadX16(const __half* p, float* f) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 fv = __half22float2(h[j]);
      f[8 * i + 2 * j] = fv.x;
      f[8 * i + 2 * j + 1] = fv.y;
    }
  }
}

__device__ __forceinline__ void AllowNextLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}
__device__ __forceinline__ void WaitForPreviousGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void PrefetchL2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// A persistent grid: block b takes row groups (RowsPerBlock rows) b, b + gridDim.x, ... of w;
// x rows blockIdx.y * MB .. + MB (E == 1: one weight row serves MB rows of x) or x row
// blockIdx.y (a stack: MB == 1).  Each lane streams its chunks of its rows as one sequence of
// batches of U loads, the next batch in flight while the current one is added up.
template <typename T, int MB>
__global__ void __launch_bounds__(kThreads, 2) Fp8MatVecKernel(Fp8Args a) {
  constexpr int U = MB <= 2 ? 8 : 4;
  __shared__ float split_sums[2][kWarps][8][MB];  // [row group parity][warp][row of warp][x row]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kw = warp % a.ksplit, rg = warp / a.ksplit;
  const int rows_per_warp = 32 / a.lanes, rw = lane / a.lanes, l = lane % a.lanes;
  const int64_t rows_per_block = (kWarps / a.ksplit) * rows_per_warp;
  const int64_t groups = (a.n + rows_per_block - 1) / rows_per_block;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * MB;
  int64_t g = blockIdx.x;
  AllowNextLaunch();
  if (a.prefetch && a.e == 1 && threadIdx.x == 0) {
    const int64_t row0 = g * rows_per_block, rows = min(rows_per_block, a.n - row0);
    PrefetchL2(a.w + row0 * a.k, static_cast<uint32_t>(rows * a.k));
  }
  WaitForPreviousGrid();

  int64_t e = 0;
  if (a.e > 1) {
    e = a.ids[m0];
    e = e < 0 ? 0 : (e >= a.e ? a.e - 1 : e);
  }
  const int64_t chunks = a.k / kChunk;
  const int64_t per_split = (chunks + a.ksplit - 1) / a.ksplit;
  const int64_t c_begin = min(chunks, kw * per_split) + l;
  const int64_t c_end = min(chunks, kw * per_split + per_split);
  // Batches per row: the same for every lane of the warp (their shuffles pair up).
  const int nb = static_cast<int>(((c_end - (c_begin - l) + a.lanes - 1) / a.lanes + U - 1) / U);
  const bool kblocked = a.block_k < a.k;
  const T* x = static_cast<const T*>(a.x) + m0 * a.k;
  bool live[MB];
#pragma unroll
  for (int r = 0; r < MB; ++r) live[r] = m0 + r < a.m;
  auto row_of = [&](int64_t grp) {  // a row past N computes, is never stored
    const int64_t n = grp * rows_per_block + rg * rows_per_warp + rw;
    return n < a.n ? n : a.n - 1;
  };
  auto load = [&](uint4* v, int64_t grp, int b) {
    const uint8_t* wr = a.w + (e * a.n + row_of(grp)) * a.k;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c_begin + static_cast<int64_t>(b * U + u) * a.lanes;
      if (c < c_end) v[u] = LoadWeights(wr + c * kChunk);
    }
  };

  float acc[MB];
#pragma unroll
  for (int r = 0; r < MB; ++r) acc[r] = 0.0f;
  uint4 cur[U], nxt[U];
  if (nb > 0) load(cur, g, 0);
  int b = 0, parity = 0;
  while (g < groups) {
    int64_t gn = g;
    int bn = b + 1;
    if (bn >= nb) bn = 0, gn = g + gridDim.x;
    if (gn < groups && nb > 0) load(nxt, gn, bn);
    if (nb > 0) {
      const float* srow = a.scale + (e * a.sn + row_of(g) / a.block_n) * a.sk;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t c = c_begin + static_cast<int64_t>(b * U + u) * a.lanes;
        if (c >= c_end) break;
        float wf[kChunk];
        DecodeE4m3(cur[u], wf);
        const float s = kblocked ? __ldg(srow + c * kChunk / a.block_k) : 1.0f;
#pragma unroll
        for (int r = 0; r < MB; ++r) {
          if (!live[r]) continue;
          float xf[kChunk];
          LoadX16(x + r * a.k + c * kChunk, xf);
          float p = 0.0f;
#pragma unroll
          for (int j = 0; j < kChunk; ++j) p = __fmaf_rn(xf[j], wf[j], p);
          acc[r] = kblocked ? __fmaf_rn(p, s, acc[r]) : __fadd_rn(acc[r], p);
        }
      }
    }
    if (bn == 0) {  // the row is done: lanes, then splits, then the scale; rounded once
      for (int off = a.lanes / 2; off >= 1; off /= 2) {
#pragma unroll
        for (int r = 0; r < MB; ++r)
          acc[r] = __fadd_rn(acc[r], __shfl_xor_sync(0xffffffffu, acc[r], off));
      }
      if (a.ksplit > 1) {
        if (l == 0) {
#pragma unroll
          for (int r = 0; r < MB; ++r) split_sums[parity][warp][rw][r] = acc[r];
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < MB; ++r) {
          float total = split_sums[parity][warp - kw][rw][r];
          for (int sp = 1; sp < a.ksplit; ++sp)
            total = __fadd_rn(total, split_sums[parity][warp - kw + sp][rw][r]);
          acc[r] = total;
        }
        parity ^= 1;
      }
      const int64_t n = g * rows_per_block + rg * rows_per_warp + rw;
      if (kw == 0 && l == 0 && n < a.n) {
        const float s = kblocked ? 1.0f : __ldg(a.scale + (e * a.sn + n / a.block_n) * a.sk);
#pragma unroll
        for (int r = 0; r < MB; ++r) {
          if (!live[r]) continue;
          const float out = kblocked ? acc[r] : __fmul_rn(acc[r], s);
          static_cast<T*>(a.y)[(m0 + r) * a.n + n] = FromFloat<T>(out);
        }
      }
#pragma unroll
      for (int r = 0; r < MB; ++r) acc[r] = 0.0f;
    }
    g = gn;
    b = bn;
#pragma unroll
    for (int u = 0; u < U; ++u) cur[u] = nxt[u];
  }
}

// Fp8RowKernel's x: chunk c's 16 floats as 4 quads, quad q at 4c + (q ^ ((c >> 1) & 3)), so
// the 8 lanes of a quarter warp reading consecutive chunks' quad q hit 32 distinct banks.
__device__ __forceinline__ int XQuad(int64_t c, int q) {
  return static_cast<int>(4 * c + (q ^ ((c >> 1) & 3)));
}
__device__ __forceinline__ float4 LoadQuad(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 LoadQuad(const __nv_bfloat16* p) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                     __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
}
__device__ __forceinline__ float4 LoadQuad(const __half* p) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&v.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&v.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

// p = fma over a chunk's 16 weights in order, from 0 (fp8_matvec.h); x's quads q0..q3.
__device__ __forceinline__ float ChunkDot(const uint4& v, const float4& q0, const float4& q1,
                                          const float4& q2, const float4& q3) {
  float w[kChunk];
  DecodeE4m3(v, w);
  const float x[kChunk] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w,
                           q2.x, q2.y, q2.z, q2.w, q3.x, q3.y, q3.z, q3.w};
  float p = 0.0f;
#pragma unroll
  for (int j = 0; j < kChunk; ++j) p = __fmaf_rn(x[j], w[j], p);
  return p;
}

// One x row per block: row blockIdx.y of x (E == 1: M == 1; a stack: its expert ids[row]).
// Lane l of split s reads its chunks c0, c0 + LANES, ... of R rows (nl of them per row) as
// batches of U loads per row; two buffers alternate (the next batch is issued into one before
// the other is added up), unrolled so that no register copy waits for a load in flight.  R
// rows per thread share each x quad read from shared memory; which rows a thread holds does
// not enter a row's sum (fp8_matvec.h), so R is the host's choice (RowsPerThread).  LANES is
// a template parameter so that a batch's loads and x quads are immediate offsets.
template <typename T, int LANES, int R>
__global__ void __launch_bounds__(kThreads, 2) Fp8RowKernel(Fp8Args a) {
  constexpr int U = 8 / R;                     // loads in flight per row: 8 per thread in all
  static_assert(U % 2 == 0, "the swizzle's parity is u's");
  constexpr int64_t kStride = LANES * kChunk;  // bytes between a lane's chunks of a row
  static_assert(R * 32 / LANES <= 8, "split_sums holds 8 rows per warp");
  extern __shared__ float4 xs[];  // x as float, XQuad's layout: K / 4 quads
  __shared__ float split_sums[2][kWarps][8];  // [row group parity][warp][row of warp]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kw = warp % a.ksplit, rg = warp / a.ksplit;
  constexpr int rows_per_warp = R * 32 / LANES;
  const int rw = lane / LANES, l = lane % LANES;
  const int64_t rows_per_block = (kWarps / a.ksplit) * rows_per_warp;
  const int64_t groups = (a.n + rows_per_block - 1) / rows_per_block;
  const int64_t chunks = a.k / kChunk, per_split = (chunks + a.ksplit - 1) / a.ksplit;
  const int64_t c_first = min(chunks, kw * per_split), c_end = min(chunks, c_first + per_split);
  const int64_t c0 = c_first + l;
  const int nl = c0 < c_end ? static_cast<int>((c_end - c0 + LANES - 1) / LANES) : 0;
  // Batches per row: the same for every lane of the warp (their shuffles pair up), >= 1.
  const int nb = max(1, static_cast<int>(((c_end - c_first + LANES - 1) / LANES + U - 1) / U));
  const bool kblocked = a.block_k < a.k;
  const uint32_t block_chunks = static_cast<uint32_t>(a.block_k / kChunk);
  const int64_t m0 = blockIdx.y;
  int64_t g = blockIdx.x;
  AllowNextLaunch();
  if (a.prefetch && a.e == 1 && threadIdx.x == 0 && g < groups) {
    const int64_t row0 = g * rows_per_block, rows = min(rows_per_block, a.n - row0);
    PrefetchL2(a.w + row0 * a.k, static_cast<uint32_t>(rows * a.k));
  }
  WaitForPreviousGrid();
  int64_t e = 0;
  if (a.e > 1) {
    e = a.ids[m0];
    e = e < 0 ? 0 : (e >= a.e ? a.e - 1 : e);
  }
  // Chunk c0 + i * LANES's quad q is at xq[q ^ ((i * LANES / 2) & 3)] + 4 * LANES * i: the
  // swizzle of a lane's chunks repeats every 2 chunks (LANES 4) or never changes (LANES >= 8).
  const int sw = static_cast<int>((c0 >> 1) & 3);
  const float4* xq[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) xq[q] = xs + 4 * c0 + (q ^ sw);

  // Row r of this thread in group grp; a row past N computes, is never stored.
  auto row_at = [&](int64_t grp, int r) {
    return grp * rows_per_block + rg * rows_per_warp + rw * R + r;
  };
  auto row_of = [&](int64_t grp, int r) { return min(row_at(grp, r), a.n - 1); };
  auto load = [&](uint4 (&v)[R][U], int64_t grp, int b) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = a.w + (e * a.n + row_of(grp, r)) * a.k + c0 * kChunk + b * U * kStride;
      if ((b + 1) * U <= nl) {
#pragma unroll
        for (int u = 0; u < U; ++u) v[r][u] = LoadWeights(p + u * kStride);
      } else {
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (b * U + u < nl) v[r][u] = LoadWeights(p + u * kStride);
      }
    }
  };
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  // Chunks u < valid of batch b; `full` and `blocked` are compile-time, so a full batch's
  // chunks are one branch-free block the compiler interleaves.
  auto sum = [&](const uint4 (&v)[R][U], int b, const float* const (&srow)[R], int valid,
                 auto full, auto blocked) {
    const int off = b * U * 4 * LANES;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!decltype(full)::value && u >= valid) break;
      constexpr int kFlip[2] = {0, (LANES / 2) & 3};  // (i * LANES / 2) & 3 for even, odd i
      const int at = off + u * 4 * LANES, f = kFlip[u & 1];  // U is even: b * U + u has u's parity
      const float4 q0 = xq[0 ^ f][at], q1 = xq[1 ^ f][at], q2 = xq[2 ^ f][at], q3 = xq[3 ^ f][at];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float p = ChunkDot(v[r][u], q0, q1, q2, q3);
        if constexpr (decltype(blocked)::value) {
          const uint32_t c = static_cast<uint32_t>(c0 + (b * U + u) * LANES);
          acc[r] = __fmaf_rn(p, __ldg(srow[r] + c / block_chunks), acc[r]);
        } else {
          acc[r] = __fadd_rn(acc[r], p);
        }
      }
    }
  };
  auto add = [&](const uint4 (&v)[R][U], int64_t grp, int b) {
    using Yes = std::true_type;
    using No = std::false_type;
    const int valid = min(U, nl - b * U);
    const float* srow[R];
#pragma unroll
    for (int r = 0; r < R; ++r) srow[r] = nullptr;
    if (!kblocked) {
      if (valid == U) sum(v, b, srow, U, Yes{}, No{});
      else sum(v, b, srow, valid, No{}, No{});
      return;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) srow[r] = a.scale + (e * a.sn + row_of(grp, r) / a.block_n) * a.sk;
    if (valid == U) sum(v, b, srow, U, Yes{}, Yes{});
    else sum(v, b, srow, valid, No{}, Yes{});
  };
  int parity = 0;
  // lanes, then splits, then the scale (loaded before the rows' last batch was added up)
  auto finish_rows = [&](int64_t grp, const float (&row_scale)[R]) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int off = LANES / 2; off >= 1; off /= 2)
        acc[r] = __fadd_rn(acc[r], __shfl_xor_sync(0xffffffffu, acc[r], off));
    }
    if (a.ksplit > 1) {
      if (l == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) split_sums[parity][warp][rw * R + r] = acc[r];
      }
      __syncthreads();
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float total = split_sums[parity][warp - kw][rw * R + r];
        for (int sp = 1; sp < a.ksplit; ++sp)
          total = __fadd_rn(total, split_sums[parity][warp - kw + sp][rw * R + r]);
        acc[r] = total;
      }
      parity ^= 1;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t n = row_at(grp, r);
      if (kw == 0 && l == 0 && n < a.n) {
        const float out = kblocked ? acc[r] : __fmul_rn(acc[r], row_scale[r]);
        static_cast<T*>(a.y)[m0 * a.n + n] = FromFloat<T>(out);
      }
      acc[r] = 0.0f;
    }
  };
  int b = 0;
  // cur holds batch b of group g: issue the next batch into nxt, add cur up, end the rows.
  auto step = [&](const uint4 (&cur)[R][U], uint4 (&nxt)[R][U]) {
    int64_t gn = g;
    int bn = b + 1;
    if (bn >= nb) bn = 0, gn = g + gridDim.x;
    if (gn < groups) load(nxt, gn, bn);
    float row_scale[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      row_scale[r] = 1.0f;
      if (bn == 0 && !kblocked) row_scale[r] = __ldg(a.scale + (e * a.sn + row_of(g, r) / a.block_n) * a.sk);
    }
    add(cur, g, b);
    if (bn == 0) finish_rows(g, row_scale);
    g = gn, b = bn;
    return g < groups;
  };
  uint4 A[R][U], B[R][U];
  if (g >= groups) return;
  load(A, g, 0);  // the first weights in flight while x is staged
  const T* xrow = static_cast<const T*>(a.x) + m0 * a.k;
  for (int64_t i = threadIdx.x; i < chunks * 4; i += kThreads)
    xs[XQuad(i >> 2, static_cast<int>(i & 3))] = LoadQuad(xrow + 4 * i);
  __syncthreads();
  while (step(A, B) && step(B, A)) {
  }
}

// Fp8RowKernel's shared memory for K: x as float.  Past RowSmemLimit, Fp8MatVecKernel serves.
constexpr int64_t kRowSmemMax = 100 * 1024;  // 2 blocks per SM on Hopper and Blackwell
inline int64_t RowSmem(int64_t k) { return k * static_cast<int64_t>(sizeof(float)); }

// kRowSmemMax, or less on a GPU whose blocks opt in to less (e.g. 99 KiB on sm_86 / sm_120),
// less the kernel's own 1 KiB.  Read once per device ordinal.
int64_t RowSmemLimit() {
  static int optin_of[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) {
    cudaGetLastError();
    return 0;
  }
  if (optin_of[device] == 0) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
      cudaGetLastError();
      v = -1;
    }
    optin_of[device] = v;
  }
  return std::min<int64_t>(kRowSmemMax, static_cast<int64_t>(optin_of[device]) - 1024);
}

// Blocks of `kernel` one SM holds with `smem` dynamic bytes (read once per thread).
int BlocksPerSm(const void* kernel, size_t smem) {
  thread_local std::vector<std::tuple<const void*, size_t, int>> seen;
  for (const auto& [k, s, n] : seen)
    if (k == kernel && s == smem) return n;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, smem) != cudaSuccess) {
    cudaGetLastError();
    n = 1;
  }
  seen.emplace_back(kernel, smem, std::max(n, 1));
  return std::max(n, 1);
}

int SmCount() {
  static int sms_of[64] = {};  // per device ordinal, read once
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= 64) return 1;
  if (sms_of[device] == 0)
    cudaDeviceGetAttribute(&sms_of[device], cudaDevAttrMultiProcessorCount, device);
  return std::max(sms_of[device], 1);
}

// Blocks one launch of `kernel` runs: as many as stay resident per x row group (each loops
// over row groups), at most one per group.
int64_t GridBlocks(const void* kernel, size_t smem, int64_t groups, unsigned grid_y) {
  const int64_t resident = static_cast<int64_t>(BlocksPerSm(kernel, smem)) * SmCount();
  return std::min(groups, std::max<int64_t>(1, resident / grid_y));
}

// A persistent grid of `kernel` over row groups of `rows` rows.
template <typename Kernel>
cudaError_t LaunchGrid(Kernel kernel, const Fp8MatVecCall& c, const Fp8Args& a, unsigned grid_y,
                       size_t smem, cudaStream_t stream, int64_t rows) {
  const void* fn = reinterpret_cast<const void*>(kernel);
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(RowSmemLimit()));
    if (err != cudaSuccess) return err;
  }
  const int64_t groups = (c.n + rows - 1) / rows;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(GridBlocks(fn, smem, groups, grid_y)), grid_y, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = c.pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, a);
}
template <typename Kernel>
cudaError_t LaunchGrid(Kernel kernel, const Fp8MatVecCall& c, const Fp8Args& a, unsigned grid_y,
                       size_t smem, cudaStream_t stream) {
  return LaunchGrid(kernel, c, a, grid_y, smem, stream, fp8mv::RowsPerBlock(c.lanes, c.ksplit));
}

// The row kernel with R rows per thread (R = 2: half the x reads per weight byte, same sums).
// R = 2 when the busiest block's rows are not more than with R = 1: twice the rows per group
// halves the groups, so a grid that ends in a partly filled round can end later.
template <typename T, int LANES>
cudaError_t LaunchRows(const Fp8MatVecCall& c, const Fp8Args& a, unsigned grid_y, size_t smem,
                       cudaStream_t stream) {
  const int64_t rows1 = fp8mv::RowsPerBlock(c.lanes, c.ksplit);
  if constexpr (LANES >= 8) {
    const void* k1 = reinterpret_cast<const void*>(Fp8RowKernel<T, LANES, 1>);
    const void* k2 = reinterpret_cast<const void*>(Fp8RowKernel<T, LANES, 2>);
    const int64_t g1 = (c.n + rows1 - 1) / rows1, g2 = (c.n + 2 * rows1 - 1) / (2 * rows1);
    const int64_t b1 = GridBlocks(k1, smem, g1, grid_y), b2 = GridBlocks(k2, smem, g2, grid_y);
    const int64_t busiest1 = (g1 + b1 - 1) / b1, busiest2 = 2 * ((g2 + b2 - 1) / b2);
    if (busiest2 <= busiest1)
      return LaunchGrid(Fp8RowKernel<T, LANES, 2>, c, a, grid_y, smem, stream, 2 * rows1);
  }
  return LaunchGrid(Fp8RowKernel<T, LANES, 1>, c, a, grid_y, smem, stream, rows1);
}

template <typename T>
cudaError_t Launch(const Fp8MatVecCall& c, cudaStream_t stream) {
  const Fp8Args a{c.x, c.w, c.scale, c.ids, c.y, c.m, c.k, c.n, c.e, c.sn, c.sk, c.block_n,
                  c.block_k, static_cast<int>(c.lanes), static_cast<int>(c.ksplit),
                  c.prefetch ? 1 : 0};
  // One x row per block (batch 1, or a stack's rows): x staged in shared memory.
  const bool one_row = c.e > 1 || c.m == 1;
  if (one_row && RowSmem(c.k) <= RowSmemLimit()) {
    const unsigned grid_y = static_cast<unsigned>(c.e > 1 ? c.m : 1);
    const size_t smem = static_cast<size_t>(RowSmem(c.k));
    switch (c.lanes) {
      case 32: return LaunchRows<T, 32>(c, a, grid_y, smem, stream);
      case 16: return LaunchRows<T, 16>(c, a, grid_y, smem, stream);
      case 8: return LaunchRows<T, 8>(c, a, grid_y, smem, stream);
      default: return LaunchRows<T, 4>(c, a, grid_y, smem, stream);
    }
  }
  if (c.e > 1) return LaunchGrid(Fp8MatVecKernel<T, 1>, c, a, static_cast<unsigned>(c.m), 0, stream);
  // One weight: every x row a warp multiplies by each weight row it reads.
  const unsigned groups8 = static_cast<unsigned>((c.m + 7) / 8);
  if (c.m == 1) return LaunchGrid(Fp8MatVecKernel<T, 1>, c, a, 1, 0, stream);
  if (c.m == 2) return LaunchGrid(Fp8MatVecKernel<T, 2>, c, a, 1, 0, stream);
  if (c.m <= 4) return LaunchGrid(Fp8MatVecKernel<T, 4>, c, a, 1, 0, stream);
  return LaunchGrid(Fp8MatVecKernel<T, 8>, c, a, groups8, 0, stream);
}

template <typename T>
void LoadKernels() {
  cudaFuncAttributes attr;
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, Fp8MatVecKernel<T, 1>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, Fp8MatVecKernel<T, 2>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, Fp8MatVecKernel<T, 4>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, Fp8MatVecKernel<T, 8>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, Fp8RowKernel<T, 32, 1>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, Fp8RowKernel<T, 16, 1>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, Fp8RowKernel<T, 8, 1>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, Fp8RowKernel<T, 4, 1>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, Fp8RowKernel<T, 32, 2>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, Fp8RowKernel<T, 16, 2>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, Fp8RowKernel<T, 8, 2>));
}

}  // namespace
}  // namespace cuda

namespace {

ffi::Error CudaFp8MatVecImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                             ffi::AnyBuffer w, ffi::AnyBuffer scale, ffi::AnyBuffer ids,
                             ffi::Result<ffi::AnyBuffer> y, int64_t block_n, int64_t block_k,
                             int64_t lanes, int64_t ksplit, int64_t pdl, int64_t prefetch) {
  Fp8MatVecCall call;
  ffi::Error err = PlanFp8MatVec(x, w, scale, ids, *y, block_n, block_k, lanes, ksplit, pdl,
                                 prefetch, &call);
  if (err.failure()) return err;
  err = UseDevice(ordinal);
  if (err.failure()) return err;
  switch (call.elem) {
    case Elem::kF32: return Launched(cuda::Launch<float>(call, stream));
    case Elem::kBf16: return Launched(cuda::Launch<__nv_bfloat16>(call, stream));
    case Elem::kF16: return Launched(cuda::Launch<__half>(call, stream));
    default: return Invalid("fp8_matvec: x must be float32, bfloat16 or float16");
  }
}

}  // namespace

void PreloadFp8MatVecKernels() {
  cuda::LoadKernels<float>();
  cuda::LoadKernels<__nv_bfloat16>();
  cuda::LoadKernels<__half>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaFp8MatVec, CudaFp8MatVecImpl,
                              WithFp8MatVecOperands(ffi::Ffi::Bind()
                                                        .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                        .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace sifar
