// Build: nvcc -O3 -std=c++17 -arch=sm_90a -shared -Xcompiler -fPIC -I <jaxlib>/include -o bench/probes/libcoop.so bench/probes/fp8_coop_chain.cu
// Run (repository root, sifar_jax built into src/): PYTHONPATH=src:. python bench/probes/fp8_coop_chain.py
// Probe: the 32-layer FP8 GEMV chain (Llama-8B's four projections per layer) as ONE
// cooperative launch through an XLA FFI custom call, a grid barrier between dependent
// projections, each warp's first weights of the next projection loaded before the barrier.
// Same per-row sums as sifar_jax.fp8_matvec's plan (32, 1): bits comparable.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace cg = cooperative_groups;

constexpr int kU = 8;
struct Shape { int k, n; };
struct ChainArgs {
  const uint8_t* w;
  const float* s;
  const __nv_bfloat16* x0;
  __nv_bfloat16* buf;  // 2 x nmax
  __nv_bfloat16* y;
  int layers, nmax;
  Shape sh[4];
};

__device__ __forceinline__ uint4 LoadW(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ float Chunk(const uint4& v, const float4* q) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
  float w[16];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(words[i] >> (16 * h));
      const float2 fv = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
      w[4 * i + 2 * h] = fv.x;
      w[4 * i + 2 * h + 1] = fv.y;
    }
  const float4 a = q[0], b = q[1], c = q[2], d = q[3];
  const float x[16] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w, c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
  float p = 0.0f;
#pragma unroll
  for (int j = 0; j < 16; ++j) p = __fmaf_rn(x[j], w[j], p);
  return p;
}
__device__ __forceinline__ int XQuad(int c, int q) { return 4 * c + (q ^ ((c >> 1) & 3)); }

__global__ void __launch_bounds__(256, 2) Chain(ChainArgs a) {
  extern __shared__ float4 xs[];
  cg::grid_group grid = cg::this_grid();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sw = (lane >> 1) & 3;
  size_t woff = 0, soff = 0;
  const __nv_bfloat16* in = a.x0;
  int parity = 0;
  uint4 A[kU], B[kU];
  auto issue = [&](uint4 (&v)[kU], const uint8_t* w, int n, int k, int row, int b) {
    const int nl = k / 512;
    const uint8_t* p = w + static_cast<size_t>(min(row, n - 1)) * k + lane * 16 + b * kU * 512;
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (b * kU + u < nl) v[u] = LoadW(p + u * 512);
  };
  const int first_row = blockIdx.x * 8 + warp, stride = gridDim.x * 8;
  issue(A, a.w, a.sh[0].n, a.sh[0].k, first_row, 0);
  const int total = a.layers * 4;
  for (int t = 0; t < total; ++t) {
    const Shape sh = a.sh[t % 4];
    const int k = sh.k, n = sh.n, nl = k / 512, nb = (nl + kU - 1) / kU;
    const uint8_t* w = a.w + woff;
    const float* s = a.s + soff;
    __nv_bfloat16* out = t == total - 1 ? a.y : a.buf + parity * a.nmax;
    for (int i = threadIdx.x; i < k / 4; i += 256) {
      const uint2 v = *reinterpret_cast<const uint2*>(in + 4 * i);
      xs[XQuad(i >> 2, i & 3)] = make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                                             __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
    }
    __syncthreads();
    // next projection's first batch (the weights never depend on x), issued after this one's last
    const bool has_next = t + 1 < total;
    const Shape nsh = a.sh[(t + 1) % 4];
    const uint8_t* nw = w + static_cast<size_t>(k) * n;
    int row = first_row, b = 0;
    float acc = 0.0f;
    auto step = [&](const uint4 (&cur)[kU], uint4 (&nxt)[kU]) {
      int rn = row, bn = b + 1;
      if (bn >= nb) bn = 0, rn = row + stride;
      if (rn < n) issue(nxt, w, n, k, rn, bn);
      else if (has_next) issue(nxt, nw, nsh.n, nsh.k, first_row, 0);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (b * kU + u >= nl) break;
        const int c = lane + 32 * (b * kU + u);
        float4 q[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) q[j] = xs[4 * c + (j ^ sw)];
        acc = __fadd_rn(acc, Chunk(cur[u], q));
      }
      if (bn == 0) {
#pragma unroll
        for (int off = 16; off >= 1; off /= 2) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, off));
        if (lane == 0 && row < n) out[row] = __float2bfloat16_rn(__fmul_rn(acc, __ldg(s + row)));
        acc = 0.0f;
      }
      row = rn, b = bn;
      return row < n;
    };
    bool in_a = true;  // which buffer holds the current batch
    if (row >= n && has_next) issue(A, nw, nsh.n, nsh.k, first_row, 0);  // no row here
    if (row < n) {
      while (true) {
        if (!step(A, B)) { in_a = false; break; }
        if (!step(B, A)) { in_a = true; break; }
      }
    }
    // the next projection's first batch now sits in (in_a ? A : B); keep it in A
    if (!in_a) {
#pragma unroll
      for (int u = 0; u < kU; ++u) A[u] = B[u];
    }
    woff += static_cast<size_t>(k) * n;
    soff += n;
    in = out;
    parity ^= 1;
    grid.sync();
  }
}

static ffi::Error CoopImpl(cudaStream_t stream, ffi::AnyBuffer w, ffi::AnyBuffer s, ffi::AnyBuffer x,
                           ffi::Result<ffi::AnyBuffer> buf, ffi::Result<ffi::AnyBuffer> y, int64_t tp,
                           int64_t layers) {
  ChainArgs a;
  a.w = static_cast<const uint8_t*>(w.untyped_data());
  a.s = static_cast<const float*>(s.untyped_data());
  a.x0 = static_cast<const __nv_bfloat16*>(x.untyped_data());
  a.buf = static_cast<__nv_bfloat16*>(buf->untyped_data());
  a.y = static_cast<__nv_bfloat16*>(y->untyped_data());
  a.layers = static_cast<int>(layers);
  const int t = static_cast<int>(tp);
  a.sh[0] = {4096, 6144 / t};
  a.sh[1] = {4096 / t, 4096};
  a.sh[2] = {4096, 28672 / t};
  a.sh[3] = {14336 / t, 4096};
  a.nmax = 28672 / t;
  const int smem = 14336 / t * 4;
  cudaError_t e = cudaFuncSetAttribute(Chain, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  int per_sm = 0, sms = 0, dev = 0;
  if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Chain, 256, smem);
  if (e == cudaSuccess) e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  void* args[] = {&a};
  if (e == cudaSuccess)
    e = cudaLaunchCooperativeKernel(reinterpret_cast<void*>(Chain), dim3(per_sm * sms), dim3(256), args, smem, stream);
  if (e != cudaSuccess) return ffi::Error(ffi::ErrorCode::kInternal, cudaGetErrorString(e));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CoopChain, CoopImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("tp")
                                  .Attr<int64_t>("layers"),
                              {ffi::Traits::kCmdBufferCompatible});
