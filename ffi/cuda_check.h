// Every CUDA runtime call off the hot path goes through SIFAR_CUDA_CHECK: a
// failure becomes an exception naming the call, the file and the error.
// OnDevice: one scoped device switch for every host-side CUDA file.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#define SIFAR_CUDA_CHECK(expr)                                                           \
  do {                                                                                   \
    cudaError_t sifar_err_ = (expr);                                                     \
    if (sifar_err_ != cudaSuccess) {                                                     \
      cudaGetLastError();                                                                \
      throw std::runtime_error(std::string("sifar_jax: CUDA call failed: ") + #expr +   \
                               " (" __FILE__ ":" + std::to_string(__LINE__) + "): " +    \
                               cudaGetErrorString(sifar_err_));                          \
    }                                                                                    \
  } while (0)

namespace sifar {

// Runs on `ordinal`, restoring the caller's device (the Python thread's
// device matters to JAX and to the user).
class OnDevice {
 public:
  explicit OnDevice(int ordinal) {
    SIFAR_CUDA_CHECK(cudaGetDevice(&prev_));
    SIFAR_CUDA_CHECK(cudaSetDevice(ordinal));
  }
  ~OnDevice() { cudaSetDevice(prev_); }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  int prev_ = 0;
};

}  // namespace sifar
