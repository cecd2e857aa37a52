// The CUDA backend: device memory for communicator workspaces, host-mapped
// error records, peer access, eager kernel loading and the multicast variant
// of a group.  Off the hot path: every call here is synchronous and checked.
#include <cuda_runtime.h>

#include <cstring>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>

#include "core/cuda_check.h"
#include "multicast/multicast.h"
#include "runtime/comm.h"

namespace sifar {

// Every op's kernels on the current device (ffi/targets.h, defined in module.cc).
void PreloadCudaKernels();

namespace {

// Enables peer access to every device of the group and loads every kernel on
// `ordinal` now: a lazy module load while a peer spins can deadlock on the
// driver's process-wide lock.  `multicast`: also the multicast kernels (only
// where a multicast group exists, so hosts with multicast off never load them).
void PrepareDevice(int ordinal, const std::vector<int>& group, bool multicast) {
  OnDevice on(ordinal);
  for (int peer : group) {
    if (peer == ordinal) continue;
    // XLA normally enabled this already when it created its GPU client.
    cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
    else SIFAR_CUDA_CHECK(e);
  }
  PreloadCudaKernels();
  if (multicast) SIFAR_CUDA_CHECK(PreloadMulticastKernels());
}

class CudaBackendImpl : public Backend {
 public:
  char* Alloc(int ordinal, size_t bytes) override {
    OnDevice on(ordinal);
    void* p = nullptr;
    SIFAR_CUDA_CHECK(cudaMalloc(&p, bytes));
    SIFAR_CUDA_CHECK(cudaMemset(p, 0, bytes));
    SIFAR_CUDA_CHECK(cudaDeviceSynchronize());
    return static_cast<char*>(p);
  }
  void Free(int ordinal, char* ptr) override {  // the caller has synchronised
    OnDevice on(ordinal);
    cudaFree(ptr);
    cudaGetLastError();
  }
  void Zero(int ordinal, char* ptr, size_t bytes) override {
    OnDevice on(ordinal);
    SIFAR_CUDA_CHECK(cudaMemset(ptr, 0, bytes));
    SIFAR_CUDA_CHECK(cudaDeviceSynchronize());
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
  void FreeShared(int, char* host) override {
    cudaFreeHost(host);
    cudaGetLastError();
  }
  void Synchronize(int ordinal) override {
    try {
      OnDevice on(ordinal);
      cudaDeviceSynchronize();  // a kernel's own failure is reported elsewhere
      cudaGetLastError();
    } catch (const std::exception&) {
      // The device is gone or broken: nothing of ours runs on it any more.
    }
  }
  void PrepareGroup(Group& g, size_t slot_bytes) override {
    // Several ranks on one device (the test harness): no multicast object can
    // span them.  Otherwise the guard reads the environment first and makes
    // no CUDA call when it refuses (always, on hosts where multicast is off).
    std::optional<std::string> refusal;
    std::set<int> distinct(g.ordinals.begin(), g.ordinals.end());
    if (distinct.size() != g.ordinals.size()) refusal = "several ranks share a device";
    else refusal = MulticastRefusalHere(g.ordinals);
    if (refusal) g.multicast_refusal = *refusal;
    else g.multicast = CreateMulticastGroup(g.ordinals, slot_bytes);
    for (int ord : g.ordinals) PrepareDevice(ord, g.ordinals, g.multicast != nullptr);
  }
  void PrepareSpanningGroup(Group& g, const std::vector<int>& peer_access) override {
    g.multicast_refusal = "multicast needs every rank in one process";
    for (int ord : g.ordinals)
      if (ord >= 0) PrepareDevice(ord, peer_access, false);
  }
};

}  // namespace

Backend& CudaBackend() {
  static CudaBackendImpl* b = new CudaBackendImpl();  // never destroyed (see Registry)
  return *b;
}

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

}  // namespace sifar
