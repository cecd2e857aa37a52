// Device memory for communicator workspaces, peer access, and eager kernel
// loading.  Off the hot path: every call here is synchronous and checked.
#include <cuda_runtime.h>

#include <cstring>

#include <stdexcept>
#include <string>

#include "comm.h"
#include "multicast.h"
#include "cuda_check.h"

namespace sifar {

namespace {

class CudaMemory : public Memory {
 public:
  char* Alloc(int ordinal, size_t bytes) override {
    OnDevice on(ordinal);
    void* p = nullptr;
    SIFAR_CUDA_CHECK(cudaMalloc(&p, bytes));
    SIFAR_CUDA_CHECK(cudaMemset(p, 0, bytes));
    SIFAR_CUDA_CHECK(cudaDeviceSynchronize());
    return static_cast<char*>(p);
  }
  void Free(int ordinal, char* ptr) override {
    OnDevice on(ordinal);
    cudaDeviceSynchronize();  // a kernel may still read it; never throw here
    cudaFree(ptr);
  }
  void Write(int ordinal, char* dst, const void* src, size_t bytes) override {
    OnDevice on(ordinal);
    SIFAR_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  }
  void Read(int ordinal, void* dst, const char* src, size_t bytes) override {
    OnDevice on(ordinal);
    SIFAR_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  }
  // Error records: pinned, mapped host memory.  Kernels write it only when a
  // wait times out; the handler reads it on every call for free.
  char* AllocShared(int ordinal, size_t bytes, char** device) override {
    OnDevice on(ordinal);
    void* h = nullptr;
    SIFAR_CUDA_CHECK(cudaHostAlloc(&h, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(h, 0, bytes);
    void* d = nullptr;
    SIFAR_CUDA_CHECK(cudaHostGetDevicePointer(&d, h, 0));
    *device = static_cast<char*>(d);
    return static_cast<char*>(h);
  }
  void FreeShared(int, char* host) override { cudaFreeHost(host); }
};

}  // namespace

std::unique_ptr<Memory> MakeCudaMemory() { return std::make_unique<CudaMemory>(); }

bool CudaCanAccessPeer(int a, int b) {
  int ok = 0;
  if (cudaDeviceCanAccessPeer(&ok, a, b) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return ok != 0;
}

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

void PreloadCudaKernelsOnCurrentDevice();  // cuda_allreduce.cu

void PrepareCudaDevice(int ordinal, const std::vector<int>& group, bool multicast) {
  OnDevice on(ordinal);
  for (int peer : group) {
    if (peer == ordinal) continue;
    // XLA normally enabled this already when it created its GPU client.
    cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
    else SIFAR_CUDA_CHECK(e);
  }
  PreloadCudaKernelsOnCurrentDevice();
  if (multicast) SIFAR_CUDA_CHECK(PreloadMulticastKernels());
}

}  // namespace sifar
