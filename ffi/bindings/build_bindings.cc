// What this build is and which GPUs it can serve: `build_info()` (what was
// compiled in: backends, CUDA runtime, architectures, the jax and nanobind
// it was built with) and the device queries `init` and `sifar_jax.info`
// make (compute capability, driver version).  SIFAR_CUDA_ARCHITECTURES and
// SIFAR_JAX_VERSION come from CMakeLists.txt, on this file only.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <stdexcept>
#include <string>
#include <tuple>

#include "xla/ffi/api/c_api.h"

#ifdef SIFAR_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#ifndef SIFAR_CUDA_ARCHITECTURES
#define SIFAR_CUDA_ARCHITECTURES ""
#endif
#ifndef SIFAR_JAX_VERSION
#define SIFAR_JAX_VERSION "unknown"
#endif

namespace nb = nanobind;

namespace sifar {
namespace {

// "90-real,100-real,100-virtual" -> ["90-real", "100-real", "100-virtual"].
nb::list SplitCsv(const std::string& csv) {
  nb::list out;
  size_t start = 0;
  while (start < csv.size()) {
    size_t end = csv.find(',', start);
    if (end == std::string::npos) end = csv.size();
    if (end > start) out.append(csv.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

// 13000 -> "13.0" (CUDA encodes versions as 1000 * major + 10 * minor).
std::string CudaVersionString(int v) {
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

}  // namespace

void RegisterBuildBindings(nb::module_& m) {
  m.def("build_info", [] {
    nb::dict d;
    nb::list backends;
    backends.append("cpu");
#ifdef SIFAR_WITH_CUDA
    backends.append("cuda");
    d["cuda_runtime_version"] = CudaVersionString(CUDART_VERSION);
    d["cuda_runtime_linkage"] = "static";
#else
    d["cuda_runtime_version"] = nb::none();
    d["cuda_runtime_linkage"] = nb::none();
#endif
    d["backends"] = backends;
    d["cuda_architectures"] = SplitCsv(SIFAR_CUDA_ARCHITECTURES);
    d["jax_version_built_with"] = SIFAR_JAX_VERSION;
    d["xla_ffi_api_version"] =
        std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
    d["nanobind_version"] = std::to_string(NB_VERSION_MAJOR) + "." +
                            std::to_string(NB_VERSION_MINOR) + "." +
                            std::to_string(NB_VERSION_PATCH);
#ifdef Py_LIMITED_API
    d["stable_abi"] = true;
#else
    d["stable_abi"] = false;
#endif
    return d;
  });

  // (major, minor) of a local GPU ordinal; raises RuntimeError with CUDA's
  // reason (no device, a driver older than the runtime, ...).
  m.def(
      "device_compute_capability",
      [](int ordinal) -> std::tuple<int, int> {
#ifdef SIFAR_WITH_CUDA
        int major = 0, minor = 0;
        cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal);
        if (e == cudaSuccess)
          e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal);
        if (e != cudaSuccess) {
          cudaGetLastError();
          throw std::runtime_error("sifar_jax: compute capability of GPU " +
                                   std::to_string(ordinal) + ": " + cudaGetErrorString(e));
        }
        return {major, minor};
#else
        (void)ordinal;
        throw std::runtime_error("sifar_jax was built without CUDA support");
#endif
      },
      nb::arg("ordinal"));

  // The installed driver's CUDA version ("12.8"), or None without a driver
  // (or in a build without CUDA): a runtime newer than the driver cannot run.
  m.def("cuda_driver_version", []() -> nb::object {
#ifdef SIFAR_WITH_CUDA
    int v = 0;
    if (cudaDriverGetVersion(&v) != cudaSuccess || v == 0) {
      cudaGetLastError();
      return nb::none();
    }
    return nb::str(CudaVersionString(v).c_str());
#else
    return nb::none();
#endif
  });
}

}  // namespace sifar
