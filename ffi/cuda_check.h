// Every CUDA runtime call off the hot path goes through SIFAR_CUDA_CHECK: a
// failure becomes an exception naming the call, the file and the error.
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
