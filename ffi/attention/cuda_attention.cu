// The decode attention on CUDA (attention.h): a chunk kernel (RoPE, the cache
// write, each chunk's scores, softmax statistics and weighted values) and,
// with more than one split, a merge kernel.  Plain launches on the call's
// stream (CUDA-graph safe).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <utility>

#include "allreduce/launch.h"
#include "allreduce/plan.h"
#include "attention/attention.h"
#include "core/cuda_check.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sifar {
namespace cuda {
namespace {

using attention::kMaxChunk;
using attention::kThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;  // key rows per thread whose loads are in flight at once

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

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

// Element i of a head's row x after the rotary embedding (rotate_half),
// rounded to T.  Each product and the sum rounded on their own (no fma), as
// the CPU backend and the tests' reference compute it.
template <typename T>
__device__ __forceinline__ T Rope(const T* x, int d, int i, const float* cos, const float* sin) {
  const int half = d / 2;
  const float partner = i < half ? -ToFloat(x[i + half]) : ToFloat(x[i - half]);
  return FromFloat<T>(__fadd_rn(__fmul_rn(ToFloat(x[i]), cos[i]), __fmul_rn(partner, sin[i])));
}

// The slots of sequence b this call attends to: [lo, hi] (empty when lo > hi).
__device__ __forceinline__ void Visible(const AttentionCall& c, int64_t b, int64_t* lo,
                                        int64_t* hi) {
  const int64_t start = c.start[b];
  *lo = start < 0 ? 0 : start;
  const int64_t pos = *c.pos;
  *hi = pos < c.length - 1 ? pos : c.length - 1;
}

// One step of a block over its chunk: row `row` of the block holds keys
// base + u * kRows + row (u < kUnroll), one 16-byte vector per lane; slot
// `skip` (being written) is not read.
template <typename T, int kRows>
__device__ __forceinline__ void LoadRows(const AttentionCall& c, const T* cache, int64_t b,
                                         int64_t h, int64_t base, int64_t j1, int64_t skip,
                                         int row, int col, uint4 (&dst)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t j = base + u * kRows + row;
    dst[u] = j <= j1 && j != skip ? *reinterpret_cast<const uint4*>(cache + c.Row(b, h, j) + col)
                                  : make_uint4(0, 0, 0, 0);
  }
}

// Block (split, kv head, b).  D: head_dim; kG: the most query heads per KV
// head this instance holds accumulators for (c.group <= kG).
template <typename T, int D, int kG>
__global__ void __launch_bounds__(kThreads) ChunkKernel(AttentionCall c, float scale) {
  constexpr int V = attention::kVecBytes / sizeof(T);  // elements per 16-byte vector
  constexpr int kLanes = D / V;                         // threads per key row
  constexpr int kRows = kThreads / kLanes;              // key rows a block step reads
  constexpr int kStep = kRows * kUnroll;                // keys per block step
  static_assert(kLanes <= 32 && 32 % kLanes == 0, "a key row within one warp");
  constexpr int kScoreFloats = kG * kMaxChunk, kReduceFloats = kWarps * kG * D;
  __shared__ float q_s[kG][D];
  // The chunk's scores (then probabilities), later reused for the warps' value sums.
  __shared__ float work_s[kScoreFloats > kReduceFloats ? kScoreFloats : kReduceFloats];
  __shared__ float m_s[kG], l_s[kG];
  float(*score_s)[kMaxChunk] = reinterpret_cast<float(*)[kMaxChunk]>(work_s);
  float(*reduce_s)[kG][D] = reinterpret_cast<float(*)[kG][D]>(work_s);

  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int G = static_cast<int>(c.group);
  const int tid = threadIdx.x, lane = tid % kLanes, row = tid / kLanes;
  const int64_t chunk = attention::Chunk(c.length, c.splits);
  int64_t lo, hi;
  Visible(c, b, &lo, &hi);
  const int64_t j0 = max(split * chunk, lo), j1 = min(split * chunk + chunk - 1, hi);
  const int64_t pos = *c.pos;
  const int64_t slot = pos < 0 ? 0 : (pos >= c.s ? c.s - 1 : pos);  // as dynamic_update_slice
  // The one block per (b, h) that writes the new key and value: the one that
  // reads that slot, if any reads it.
  const bool writer = split == (slot < c.length ? slot / chunk : c.splits - 1);
  if (!writer && j0 > j1) return;  // no visible slot here: the merge skips this chunk

  T* k_cache = static_cast<T*>(c.k_cache);
  T* v_cache = static_cast<T*>(c.v_cache);
  // The first step's keys and values, in flight while the query is rotated
  // (the slot being written is loaded after the write).
  uint4 kv[kUnroll], vv[kUnroll];
  const int64_t skip = writer ? slot : -1;
  LoadRows<T, kRows>(c, k_cache, b, h, j0, j1, skip, row, lane * V, kv);
  LoadRows<T, kRows>(c, v_cache, b, h, j0, j1, skip, row, lane * V, vv);

  const T* group_rows = static_cast<const T*>(c.qkv) + (b * c.kv + h) * (G + 2) * D;
  const int64_t trig = (c.trig_rows == 1 ? 0 : b) * D;
  const float* cos = c.cos + trig;
  const float* sin = c.sin + trig;
  {  // every thread's query elements loaded at once, then rotated
    constexpr int kPer = (kG * D + kThreads - 1) / kThreads;
    float x[kPer], partner[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int i = tid + k * kThreads, col = i % D;
      if (i < G * D) {
        const T* r = group_rows + (i / D) * D;
        x[k] = ToFloat(r[col]);
        partner[k] = col < D / 2 ? -ToFloat(r[col + D / 2]) : ToFloat(r[col - D / 2]);
      }
    }
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int i = tid + k * kThreads, col = i % D;
      if (i < G * D)
        q_s[i / D][col] = ToFloat(FromFloat<T>(
            __fadd_rn(__fmul_rn(x[k], cos[col]), __fmul_rn(partner[k], sin[col]))));
    }
  }
  if (writer) {
    const int64_t at = c.Row(b, h, slot);
    for (int i = tid; i < D; i += kThreads) {
      k_cache[at + i] = Rope(group_rows + G * D, D, i, cos, sin);
      v_cache[at + i] = group_rows[(G + 1) * D + i];
    }
  }
  // The new key and value are read back below by this block's threads:
  // __syncthreads orders those writes before the reads (plain loads, not the
  // read-only path).
  __syncthreads();
  if (j0 > j1) {
    if (c.splits == 1) {  // nothing visible at all: zeros
      T* out = static_cast<T*>(c.out) + (b * c.kv + h) * G * D;
      for (int i = tid; i < G * D; i += kThreads) out[i] = FromFloat<T>(0.0f);
    }
    return;
  }
  if (writer) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // (a constant index: the arrays stay in registers)
      if (j0 + u * kRows + row == slot && slot <= j1) {
        const int64_t at = c.Row(b, h, slot) + lane * V;
        kv[u] = *reinterpret_cast<const uint4*>(k_cache + at);
        vv[u] = *reinterpret_cast<const uint4*>(v_cache + at);
      }
    }
  }

  // Scores: each row's lanes add their products across the row.  Every lane
  // runs every step (the shuffles need the whole warp).
  for (int64_t base = j0;;) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = base + u * kRows + row;
      const T* k = reinterpret_cast<const T*>(&kv[u]);
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        if (g >= G) break;
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < V; ++e) dot = fmaf(q_s[g][lane * V + e], ToFloat(k[e]), dot);
#pragma unroll
        for (int off = kLanes / 2; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
        if (lane == 0 && j <= j1) score_s[g][j - j0] = dot * scale;
      }
    }
    base += kStep;
    if (base > j1) break;
    LoadRows<T, kRows>(c, k_cache, b, h, base, j1, -1, row, lane * V, kv);
  }
  __syncthreads();

  // Softmax statistics per query head: warp w takes heads w, w + kWarps, ...
  const int n = static_cast<int>(j1 - j0 + 1);
  const int warp = tid / 32, wlane = tid % 32;
  for (int g = warp; g < G; g += kWarps) {
    float mx = -INFINITY;
    for (int i = wlane; i < n; i += 32) mx = fmaxf(mx, score_s[g][i]);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float sum = 0.0f;
    for (int i = wlane; i < n; i += 32) {
      const float p = expf(score_s[g][i] - mx);
      score_s[g][i] = p;
      sum += p;
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (wlane == 0) {
      m_s[g] = mx;
      l_s[g] = sum;
    }
  }
  __syncthreads();

  // Weighted values: each thread its vector's columns, over its row's keys.
  float acc[kG][V];
#pragma unroll
  for (int g = 0; g < kG; ++g)
#pragma unroll
    for (int e = 0; e < V; ++e) acc[g][e] = 0.0f;
  for (int64_t base = j0;;) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = base + u * kRows + row;
      if (j > j1) break;
      const T* v = reinterpret_cast<const T*>(&vv[u]);
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        if (g >= G) break;
        const float p = score_s[g][j - j0];
#pragma unroll
        for (int e = 0; e < V; ++e) acc[g][e] = fmaf(p, ToFloat(v[e]), acc[g][e]);
      }
    }
    base += kStep;
    if (base > j1) break;
    LoadRows<T, kRows>(c, v_cache, b, h, base, j1, -1, row, lane * V, vv);
  }
  // The rows of a warp, then the warps (through shared memory, in warp order).
#pragma unroll
  for (int off = kLanes; off < 32; off *= 2)
#pragma unroll
    for (int g = 0; g < kG; ++g)
#pragma unroll
      for (int e = 0; e < V; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], off);
  __syncthreads();  // every probability read before work_s holds the warps' sums
  if (wlane < kLanes) {
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      if (g >= G) break;
#pragma unroll
      for (int e = 0; e < V; ++e) reduce_s[warp][g][wlane * V + e] = acc[g][e];
    }
  }
  __syncthreads();
  const int64_t group_index = b * c.kv + h;
  const int64_t record = (group_index * c.splits + split) * G;  // this chunk's first record
  for (int i = tid; i < G * D; i += kThreads) {
    const int g = i / D, col = i % D;
    float sum = reduce_s[0][g][col];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) sum += reduce_s[w][g][col];
    if (c.splits == 1)
      static_cast<T*>(c.out)[group_index * G * D + i] = FromFloat<T>(sum / l_s[g]);
    else
      c.workspace[record * D + i] = sum;
  }
  if (c.splits > 1 && tid < G)
    reinterpret_cast<float2*>(c.workspace + c.Records() * D)[record + tid] =
        make_float2(m_s[tid], l_s[tid]);
}

// A block-wide reduction of one float per thread (op: max or +), the result
// in every thread.
template <bool kMax>
__device__ __forceinline__ float BlockReduce(float v, float* scratch) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    const float o = __shfl_xor_sync(0xffffffffu, v, off);
    v = kMax ? fmaxf(v, o) : v + o;
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) v = kMax ? fmaxf(v, scratch[w]) : v + scratch[w];
  __syncthreads();  // scratch reusable
  return v;
}

// Block (kv head, b, query head g): the chunks with visible slots merged.
// Every load is issued first (each thread's chunk statistics and its share of
// the chunks' value sums, float4 columns), then each chunk's weight
// exp(m - max) / total, then the weighted sums: one memory round trip.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) MergeKernel(AttentionCall c) {
  constexpr int kQuads = D / 4;                 // float4 columns of a record
  constexpr int kGroups = kThreads / kQuads;    // chunk groups: thread (group, quad)
  constexpr int kAhead = 8;                     // value loads per thread in flight
  constexpr int kStats = attention::kMaxSplits / kThreads;  // chunk statistics per thread
  static_assert(kGroups >= 1 && kThreads % kQuads == 0, "a record's columns within a block");
  __shared__ float weight_s[attention::kMaxSplits];
  __shared__ float4 part_s[kGroups][kQuads];
  __shared__ float scratch[kWarps];
  const int64_t h = blockIdx.x, b = blockIdx.y;
  const int g = blockIdx.z, G = static_cast<int>(c.group), tid = threadIdx.x;
  const int quad = tid % kQuads, group = tid / kQuads;
  const int64_t chunk = attention::Chunk(c.length, c.splits);
  int64_t lo, hi;
  Visible(c, b, &lo, &hi);
  const int64_t group_index = b * c.kv + h;
  T* out = static_cast<T*>(c.out) + (group_index * G + g) * D;
  if (lo > hi) {
    for (int col = tid; col < D; col += kThreads) out[col] = FromFloat<T>(0.0f);
    return;
  }
  const int64_t first = lo / chunk;
  const int n = static_cast<int>(hi / chunk - first + 1);  // chunks to merge, <= kMaxSplits
  const int64_t record0 = (group_index * c.splits + first) * G + g;  // chunk s: + s * G
  const float4* sums = reinterpret_cast<const float4*>(c.workspace) + quad;
  const float2* stats = reinterpret_cast<const float2*>(c.workspace + c.Records() * D);
  float4 a[kAhead];
#pragma unroll
  for (int k = 0; k < kAhead; ++k) {
    const int s = group + k * kGroups;
    if (s < n) a[k] = sums[(record0 + s * G) * kQuads];
  }
  float2 st[kStats];
  float mx = -INFINITY;
#pragma unroll
  for (int k = 0; k < kStats; ++k) {
    const int s = tid + k * kThreads;
    st[k] = s < n ? stats[record0 + s * G] : make_float2(-INFINITY, 0.0f);
    mx = fmaxf(mx, st[k].x);
  }
  mx = BlockReduce<true>(mx, scratch);
  float total = 0.0f;
#pragma unroll
  for (int k = 0; k < kStats; ++k) {
    st[k].x = tid + k * kThreads < n ? expf(st[k].x - mx) : 0.0f;
    total += st[k].y * st[k].x;
  }
  total = BlockReduce<false>(total, scratch);
#pragma unroll
  for (int k = 0; k < kStats; ++k)
    if (tid + k * kThreads < n) weight_s[tid + k * kThreads] = st[k].x / total;
  __syncthreads();
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int base = 0; base < n; base += kAhead * kGroups) {
    if (base > 0) {
#pragma unroll
      for (int k = 0; k < kAhead; ++k) {
        const int s = base + group + k * kGroups;
        if (s < n) a[k] = sums[(record0 + s * G) * kQuads];
      }
    }
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
      const int s = base + group + k * kGroups;
      if (s < n) {
        const float w = weight_s[s];
        acc.x = fmaf(a[k].x, w, acc.x);
        acc.y = fmaf(a[k].y, w, acc.y);
        acc.z = fmaf(a[k].z, w, acc.z);
        acc.w = fmaf(a[k].w, w, acc.w);
      }
    }
  }
  part_s[group][quad] = acc;
  __syncthreads();
  if (tid < kQuads) {
    float4 v = part_s[0][tid];
#pragma unroll
    for (int k = 1; k < kGroups; ++k) {
      v.x += part_s[k][tid].x;
      v.y += part_s[k][tid].y;
      v.z += part_s[k][tid].z;
      v.w += part_s[k][tid].w;
    }
    out[tid * 4 + 0] = FromFloat<T>(v.x);
    out[tid * 4 + 1] = FromFloat<T>(v.y);
    out[tid * 4 + 2] = FromFloat<T>(v.z);
    out[tid * 4 + 3] = FromFloat<T>(v.w);
  }
}

template <typename T, int D, int kG>
cudaError_t LaunchChunks(const AttentionCall& c, cudaStream_t stream) {
  const float scale = static_cast<float>(1.0 / sqrt(static_cast<double>(D)));
  const dim3 grid(static_cast<unsigned>(c.splits), static_cast<unsigned>(c.kv),
                  static_cast<unsigned>(c.b));
  ChunkKernel<T, D, kG><<<grid, kThreads, 0, stream>>>(c, scale);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t LaunchGroup(const AttentionCall& c, cudaStream_t stream) {
  cudaError_t e;
  if (c.group <= 1)
    e = LaunchChunks<T, D, 1>(c, stream);
  else if (c.group <= 2)
    e = LaunchChunks<T, D, 2>(c, stream);
  else if (c.group <= 4)
    e = LaunchChunks<T, D, 4>(c, stream);
  else
    e = LaunchChunks<T, D, 8>(c, stream);
  if (e != cudaSuccess || c.splits == 1) return e;
  MergeKernel<T, D><<<dim3(static_cast<unsigned>(c.kv), static_cast<unsigned>(c.b),
                           static_cast<unsigned>(c.group)),
                      kThreads, 0, stream>>>(c);
  return cudaGetLastError();
}

template <typename T>
cudaError_t Launch(const AttentionCall& c, cudaStream_t stream) {
  switch (c.d) {
    case 16: return LaunchGroup<T, 16>(c, stream);
    case 32: return LaunchGroup<T, 32>(c, stream);
    case 64: return LaunchGroup<T, 64>(c, stream);
    case 128: return LaunchGroup<T, 128>(c, stream);
    case 256:
      if constexpr (sizeof(T) == 2) return LaunchGroup<T, 256>(c, stream);
      [[fallthrough]];
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, int D>
void LoadGroupKernels() {
  cudaFuncAttributes attr;
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, ChunkKernel<T, D, 1>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, ChunkKernel<T, D, 2>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, ChunkKernel<T, D, 4>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, ChunkKernel<T, D, 8>));
  SIFAR_CUDA_CHECK(cudaFuncGetAttributes(&attr, MergeKernel<T, D>));
}

template <typename T>
void LoadKernels() {
  LoadGroupKernels<T, 16>();
  LoadGroupKernels<T, 32>();
  LoadGroupKernels<T, 64>();
  LoadGroupKernels<T, 128>();
  if constexpr (sizeof(T) == 2) LoadGroupKernels<T, 256>();
}

}  // namespace
}  // namespace cuda

namespace {

ffi::Error CudaAttentionImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer qkv,
                             ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer pos,
                             ffi::AnyBuffer cos, ffi::AnyBuffer sin, ffi::AnyBuffer start,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> k_out,
                             ffi::Result<ffi::AnyBuffer> v_out,
                             ffi::Result<ffi::AnyBuffer> workspace, int64_t length,
                             int64_t splits, int64_t layout) {
  AttentionCall call;
  ffi::Error err = PlanAttention(qkv, k_cache, v_cache, pos, cos, sin, start, *out, *k_out,
                                 *v_out, *workspace, length, splits, layout, &call);
  if (err.failure()) return err;
  err = UseDevice(ordinal);
  if (err.failure()) return err;
  // The results alias the caches (input_output_aliases), but XLA may still hand
  // a result its own buffer (measured: a cache sliced from a stacked array
  // whose results are stacked again): then the result starts as the input.
  for (auto [in, res] : {std::pair{&k_cache, &*k_out}, std::pair{&v_cache, &*v_out}})
    if (res->untyped_data() != in->untyped_data()) {
      err = Launched(cudaMemcpyAsync(res->untyped_data(), in->untyped_data(), in->size_bytes(),
                                     cudaMemcpyDeviceToDevice, stream));
      if (err.failure()) return err;
    }
  switch (call.elem) {
    case Elem::kF32: return Launched(cuda::Launch<float>(call, stream));
    case Elem::kBf16: return Launched(cuda::Launch<__nv_bfloat16>(call, stream));
    case Elem::kF16: return Launched(cuda::Launch<__half>(call, stream));
    default: return Invalid("decode_attention supports float32, bfloat16 and float16");
  }
}

}  // namespace

void PreloadAttentionKernels() {
  cuda::LoadKernels<float>();
  cuda::LoadKernels<__nv_bfloat16>();
  cuda::LoadKernels<__half>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaDecodeAttention, CudaAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // qkv [B, KV, G + 2, D]
                                  .Arg<ffi::AnyBuffer>()  // k cache (aliased to result 1)
                                  .Arg<ffi::AnyBuffer>()  // v cache (aliased to result 2)
                                  .Arg<ffi::AnyBuffer>()  // pos [] int32
                                  .Arg<ffi::AnyBuffer>()  // cos [1 or B, D] float32
                                  .Arg<ffi::AnyBuffer>()  // sin
                                  .Arg<ffi::AnyBuffer>()  // start [B] int32
                                  .Ret<ffi::AnyBuffer>()  // out [B, KV, G, D]
                                  .Ret<ffi::AnyBuffer>()  // k cache
                                  .Ret<ffi::AnyBuffer>()  // v cache
                                  .Ret<ffi::AnyBuffer>()  // workspace float32
                                  .Attr<int64_t>("length")
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("layout"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace sifar
