// `sifar_jax._sifar.testing`: the test controls (sifar_jax.testing's fault
// injection: skew, dropped ranks, epochs, epoch bits) and hooks for the test
// suite only (sifar_jax._testing): raw access to a communicator's Control
// words.  The production module's bindings (module.cc) hold none of these.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstddef>
#include <stdexcept>

#include "core/protocol.h"
#include "runtime/comm.h"

namespace nb = nanobind;

namespace sifar {

namespace {

template <typename F>
void WithComm(int id, F&& f) {
  if (!Registry::Get().With(id, std::forward<F>(f)))
    throw std::invalid_argument("sifar_jax: no communicator " + std::to_string(id));
}

}  // namespace

void RegisterTestingBindings(nb::module_& t) {
  // sifar_jax.testing.inject_skew (kept by sifar_jax.comm for communicators made later).
  t.def("set_skew", [](int id, uint32_t max_ns, uint32_t seed) {
    WithComm(id, [&](Comm& c) { c.SetSkew(max_ns, seed); });
  });
  // sifar_jax.testing.drop_rank: blocks from `from_block` on of `rank` skip their calls.
  t.def(
      "set_drop",
      [](int id, int rank, bool drop, int from_block) {
        WithComm(id, [&](Comm& c) { c.SetDrop(rank, drop, from_block); });
      },
      nb::arg("id"), nb::arg("rank"), nb::arg("drop"), nb::arg("from_block") = 0);
  // sifar_jax.testing.set_epochs and epoch_bits.
  t.def("set_epochs", [](int id, uint32_t epoch) {
    WithComm(id, [&](Comm& c) { c.SetEpochs(epoch); });
  });
  t.def("set_epoch_mask", [](int id, uint32_t mask) {
    WithComm(id, [&](Comm& c) { c.SetEpochMask(mask); });
  });
  // The host address of Control::failed of (group, rank): CPU communicators only.
  t.def("control_failed_address", [](int id, int group, int rank) {
    uintptr_t addr = 0;
    WithComm(id, [&](Comm& c) {
      if (c.platform() != Platform::kCpu)
        throw std::invalid_argument("control_failed_address: CPU communicators only");
      char* ws = c.group(group).workspaces.at(rank);
      addr = reinterpret_cast<uintptr_t>(ws + c.layout().control + offsetof(Control, failed));
    });
    return addr;
  });
  // [group][rank] workspace addresses of a live communicator.
  t.def("comm_workspaces", [](int id) {
    std::vector<std::vector<uintptr_t>> out;
    WithComm(id, [&](Comm& c) {
      for (auto& g : c.groups()) {
        out.emplace_back();
        for (char* ws : g.workspaces) out.back().push_back(reinterpret_cast<uintptr_t>(ws));
      }
    });
    return out;
  });
  t.def("comm_workspace_bytes", [](int id) {
    size_t n = 0;
    WithComm(id, [&](Comm& c) { n = c.layout().total; });
    return n;
  });
  // Workspace addresses the pool holds (no communicator uses them).
  t.def("pooled_workspace_list", [] {
    std::vector<uintptr_t> out;
    for (auto& e : PooledMemory())
      for (char* ws : e.workspaces) out.push_back(reinterpret_cast<uintptr_t>(ws));
    return out;
  });
  t.def("comm_ids", [] { return Registry::Get().Ids(); });
  t.def("calls_in_flight", [](int id) { return Registry::Get().CallsInFlight(id); });
  // What a kernel does when it fails: one atomic store, no lock.
  t.def("store_u32", [](uintptr_t addr, uint32_t v) {
    __atomic_store_n(reinterpret_cast<uint32_t*>(addr), v, __ATOMIC_SEQ_CST);
  });
  t.def("load_u32", [](uintptr_t addr) {
    return __atomic_load_n(reinterpret_cast<const uint32_t*>(addr), __ATOMIC_SEQ_CST);
  });
  // The host's knobs, changed `iterations` times in a tight loop (GIL released),
  // alternating between two settings so every write changes something.
  t.def("hammer_control", [](int id, int iterations) {
    nb::gil_scoped_release release;
    WithComm(id, [&](Comm& c) {
      for (int i = 0; i < iterations; ++i) {
        c.SetTimeout((i & 1) ? 30.0 : 60.0);
        c.SetSkew(0, static_cast<uint32_t>(i));
      }
    });
  });
}

}  // namespace sifar
