// Workspaces shared between processes on GPUs: the owner allocates device
// memory and exports a cudaIpcMemHandle; a peer process opens it (the driver
// maps the owner's memory into the peer's address space and enables peer
// access for the device that opened it).  The error records stay in this
// process's pinned host memory (comm.cc): peers never touch them.  The driver
// releases every mapping when a process ends, so nothing outlives a crash.
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "core/cuda_check.h"
#include "runtime/peer_memory.h"

namespace sifar {

namespace {

// Runs f on `ordinal` where nothing may throw (release paths), restoring the
// caller's device and clearing any error it left.
template <typename F>
void QuietlyOn(int ordinal, F&& f) {
  int prev = ordinal;
  if (cudaGetDevice(&prev) != cudaSuccess) prev = ordinal;
  cudaSetDevice(ordinal);
  f();
  cudaSetDevice(prev);
  cudaGetLastError();
}

class CudaPeer : public PeerMemory {
 public:
  char* Export(int ordinal, size_t bytes, const std::string&, std::string* handle) override {
    OnDevice on(ordinal);
    void* p = nullptr;
    SIFAR_CUDA_CHECK(cudaMalloc(&p, bytes));
    try {
      SIFAR_CUDA_CHECK(cudaMemset(p, 0, bytes));
      SIFAR_CUDA_CHECK(cudaDeviceSynchronize());
      cudaIpcMemHandle_t h;
      SIFAR_CUDA_CHECK(cudaIpcGetMemHandle(&h, p));
      handle->assign(reinterpret_cast<const char*>(&h), sizeof(h));
    } catch (...) {
      cudaFree(p);
      throw;
    }
    return static_cast<char*>(p);
  }

  void Unpublish(const std::string&) override {}  // a handle has no name to remove

  void FreeExported(int ordinal, char* base, size_t, const std::string&) override {
    QuietlyOn(ordinal, [&] {
      cudaDeviceSynchronize();  // a kernel may still read it
      cudaFree(base);
    });
  }

  char* Map(int ordinal, const std::string& handle, size_t) override {
    if (handle.size() != sizeof(cudaIpcMemHandle_t))
      throw std::invalid_argument("sifar_jax: a CUDA IPC handle has " +
                                  std::to_string(sizeof(cudaIpcMemHandle_t)) + " bytes, got " +
                                  std::to_string(handle.size()));
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    OnDevice on(ordinal);
    void* p = nullptr;
    SIFAR_CUDA_CHECK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    return static_cast<char*>(p);
  }

  void Unmap(int ordinal, char* base, size_t) override {
    QuietlyOn(ordinal, [&] {
      cudaDeviceSynchronize();
      cudaIpcCloseMemHandle(base);
    });
  }

  void Synchronize(int ordinal) override { QuietlyOn(ordinal, [] { cudaDeviceSynchronize(); }); }
};

}  // namespace

PeerMemory& CudaPeerMemory() {
  static CudaPeer* m = new CudaPeer();
  return *m;
}

// PCI bus ids name a GPU the same way in every process, whatever its ordinal.
std::string CudaPciBusId(int ordinal) {
  char id[64] = {};
  SIFAR_CUDA_CHECK(cudaDeviceGetPCIBusId(id, sizeof(id), ordinal));
  return id;
}

int CudaDeviceOfPciBusId(const std::string& bus_id) {
  int ordinal = -1;
  if (cudaDeviceGetByPCIBusId(&ordinal, bus_id.c_str()) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return ordinal;
}

}  // namespace sifar
