// The CUDA helpers every host-side CUDA file shares: one check macro (a failed
// runtime call becomes an exception naming the call, the file and the error)
// and one scoped device switch.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace sifar {

[[noreturn]] inline void ThrowCudaError(const char* expr, const char* file, int line,
                                        cudaError_t err) {
  cudaGetLastError();  // clear the sticky-free error state for the next call
  throw std::runtime_error(std::string("sifar_jax: CUDA call failed: ") + expr + " (" + file +
                           ":" + std::to_string(line) + "): " + cudaGetErrorName(err) + ": " +
                           cudaGetErrorString(err));
}

// Runs on `ordinal`, restoring the caller's device on exit (the Python
// thread's device matters to JAX and to the user).  `count`, if given, is
// called once per CUDA call it makes (the multicast code counts its calls).
class OnDevice {
 public:
  explicit OnDevice(int ordinal, void (*count)() = nullptr) : count_(count) {
    Count();
    cudaError_t e = cudaGetDevice(&prev_);
    if (e != cudaSuccess) ThrowCudaError("cudaGetDevice", __FILE__, __LINE__, e);
    Count();
    e = cudaSetDevice(ordinal);
    if (e != cudaSuccess) ThrowCudaError("cudaSetDevice", __FILE__, __LINE__, e);
  }
  ~OnDevice() {
    Count();
    cudaSetDevice(prev_);
  }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  void Count() const {
    if (count_ != nullptr) count_();
  }
  int prev_ = 0;
  void (*count_)();
};

}  // namespace sifar

#define SIFAR_CUDA_CHECK(expr)                                                     \
  do {                                                                             \
    cudaError_t sifar_err_ = (expr);                                               \
    if (sifar_err_ != cudaSuccess)                                                 \
      ::sifar::ThrowCudaError(#expr, __FILE__, __LINE__, sifar_err_);              \
  } while (0)
