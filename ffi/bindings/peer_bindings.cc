// nanobind bindings for communicators spanning processes: the shared
// workspaces (export, map, unpublish, reset for reuse, free), the names this process still
// publishes, and the GPU identity (PCI bus id) the processes compare.
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <stdexcept>

#include "runtime/peer_memory.h"

namespace nb = nanobind;

namespace sifar {

#ifdef SIFAR_WITH_CUDA
std::string CudaPciBusId(int ordinal);              // cuda_ipc.cu
int CudaDeviceOfPciBusId(const std::string& bus_id);  // cuda_ipc.cu
#endif

void RegisterPeerBindings(nb::module_& m) {
  // Made in C++ (make_shared), not by a Python constructor: a communicator
  // that outlives the Python object then holds no Python reference.
  m.def(
      "open_peer_workspaces",
      [](const std::string& platform, std::vector<std::vector<int>> ordinals,
         std::vector<std::vector<int>> processes, std::vector<std::vector<int>> peer_devices,
         size_t bytes, const std::string& name_prefix) {
        if (platform != "cpu" && platform != "cuda")
          throw std::invalid_argument("sifar_jax: unsupported platform '" + platform + "'");
        return std::make_shared<PeerWorkspaces>(
            platform == "cuda" ? Platform::kCuda : Platform::kCpu, std::move(ordinals),
            std::move(processes), std::move(peer_devices), bytes, name_prefix);
      },
      nb::arg("platform"), nb::arg("ordinals"), nb::arg("processes"), nb::arg("peer_devices"),
      nb::arg("bytes"), nb::arg("name_prefix"));
  nb::class_<PeerWorkspaces>(m, "PeerWorkspaces")
      // [(group, rank, handle bytes)] of this process's ranks.
      .def("handles",
           [](const PeerWorkspaces& w) {
             nb::list out;
             for (auto& [g, r, h] : w.Handles()) out.append(nb::make_tuple(g, r, nb::bytes(h.data(), h.size())));
             return out;
           })
      .def("map_peer",
           [](PeerWorkspaces& w, int g, int r, nb::bytes handle) {
             w.MapPeer(g, r, std::string(handle.c_str(), handle.size()));
           })
      .def("unpublish", &PeerWorkspaces::Unpublish)
      // Pooling (src/sifar_jax/distributed.py): wait for this process's devices;
      // zero its ranks' memory for reuse; unmap the peers'; free everything.
      .def("synchronize", &PeerWorkspaces::Synchronize, nb::call_guard<nb::gil_scoped_release>())
      .def("reset", &PeerWorkspaces::Reset, nb::call_guard<nb::gil_scoped_release>())
      .def("unmap_peers", &PeerWorkspaces::UnmapPeers, nb::call_guard<nb::gil_scoped_release>())
      .def("free", &PeerWorkspaces::Free, nb::call_guard<nb::gil_scoped_release>());

  m.def("published_names", &PublishedNames);
  m.def("unpublish_all", &UnpublishAll);

  m.def("cuda_pci_bus_id", [](int ordinal) -> std::string {
#ifdef SIFAR_WITH_CUDA
    return CudaPciBusId(ordinal);
#else
    (void)ordinal;
    throw std::runtime_error("sifar_jax was built without CUDA support");
#endif
  });
  m.def("cuda_device_of_pci_bus_id", [](const std::string& bus_id) {
#ifdef SIFAR_WITH_CUDA
    return CudaDeviceOfPciBusId(bus_id);
#else
    (void)bus_id;
    return -1;
#endif
  });
}

}  // namespace sifar
