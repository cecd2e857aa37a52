// nanobind bindings of the multicast variant: the guard (sifar_jax.multicast
// calls it), the call counters and a set-up probe in the module itself; the
// set-up arithmetic (pure functions, tested without a GPU) in `_testing`.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <map>

#include "multicast/multicast.h"

namespace nb = nanobind;

namespace sifar {

namespace {

// The kernel's line iteration (MulticastFirstLine / MulticastLineStride over
// MulticastBlocks(lines) blocks of kMulticastLinesPerBlock threads), replayed
// on the host: owner block of every line, -1 if no thread moves it, -2 if
// several do.
std::vector<int> LineOwners(size_t lines) {
  if (lines > (size_t{1} << 26)) throw std::invalid_argument("too many lines for a host replay");
  std::vector<int> owner(lines, -1);
  const int grid = MulticastBlocks(lines);
  for (int b = 0; b < grid; ++b)
    for (int t = 0; t < kMulticastLinesPerBlock; ++t)
      for (size_t l = MulticastFirstLine(b, t); l < lines; l += MulticastLineStride())
        owner[l] = owner[l] == -1 ? b : -2;
  return owner;
}

}  // namespace

void RegisterMulticastBindings(nb::module_& m) {
  // A refusal from C++ surfaces as sifar_jax.multicast.MulticastDisabledError.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const MulticastRefused& e) {
      try {
        nb::object cls = nb::module_::import_("sifar_jax.multicast").attr("MulticastDisabledError");
        PyErr_SetObject(cls.ptr(), nb::str(e.what()).ptr());
      } catch (...) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
      }
    }
  });

  nb::class_<MulticastLayout>(m, "MulticastLayout",
                              "Layout of each device's share of a multicast object")
      .def_ro("slot_bytes", &MulticastLayout::slot_bytes)
      .def_ro("slot0", &MulticastLayout::slot0)
      .def_ro("slot_stride", &MulticastLayout::slot_stride)
      .def_ro("payload", &MulticastLayout::payload)
      .def_ro("flags", &MulticastLayout::flags)
      .def_ro("need", &MulticastLayout::need)
      .def_ro("granularity", &MulticastLayout::granularity)
      .def_ro("alloc_bytes", &MulticastLayout::alloc_bytes)
      .def_ro("recommended", &MulticastLayout::recommended)
      .def("__repr__", [](const MulticastLayout& l) {
        return "MulticastLayout(slot_bytes=" + std::to_string(l.slot_bytes) +
               ", slot_stride=" + std::to_string(l.slot_stride) +
               ", flags=" + std::to_string(l.flags) + ", need=" + std::to_string(l.need) +
               ", granularity=" + std::to_string(l.granularity) +
               ", alloc_bytes=" + std::to_string(l.alloc_bytes) +
               ", recommended=" + (l.recommended ? "True" : "False") + ")";
      });

  // ---- guard ----
  m.def("multicast_guard_vars", [] {
    std::map<std::string, std::string> off;
    for (const DisablingVar& d : kMulticastDisabling) off[d.name] = d.off;
    return std::make_pair(std::string(kMulticastEnableVar), off);
  });
  m.def(
      "multicast_refusal",
      [](const std::map<std::string, std::string>& environ, std::optional<bool> device_supports) {
        EnvLookup env = [&environ](const char* name) -> std::optional<std::string> {
          auto it = environ.find(name);
          if (it == environ.end()) return std::nullopt;
          return it->second;
        };
        DeviceSupport d = !device_supports ? DeviceSupport::kUnknown
                          : *device_supports ? DeviceSupport::kYes
                                             : DeviceSupport::kNo;
        return MulticastRefusal(env, d);
      },
      nb::arg("environ"), nb::arg("device_supports") = nb::none(),
      "The C++ guard on an explicit environment (pure: no CUDA call)");
  m.def(
      "multicast_refusal_here",
      [](const std::vector<int>& ordinals) {
        nb::gil_scoped_release release;
        return MulticastRefusalHere(ordinals);
      },
      nb::arg("ordinals"),
      "The guard on this process's environment; only if that allows multicast, the devices' "
      "CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED (read-only queries)");
  m.def("multicast_counters", [] {
    MulticastCounters c = GetMulticastCounters();
    std::map<std::string, uint64_t> d;
    d["cuda_calls"] = c.cuda_calls;
    d["refusals"] = c.refusals;
    d["setups"] = c.setups;
    return d;
  });
  m.def(
      "multicast_probe_setup",
      [](const std::vector<int>& ordinals, size_t slot_bytes) {
        nb::gil_scoped_release release;
        // Guard first (inside); builds the group, then tears it down.
        std::unique_ptr<MulticastGroup> g = CreateMulticastGroup(ordinals, slot_bytes);
        return g->layout;
      },
      nb::arg("ordinals"), nb::arg("slot_bytes"),
      "Creates and destroys a multicast group for these devices (guarded); returns its layout");

}

void RegisterMulticastTestingBindings(nb::module_& t) {
  t.def("multicast_lines_per_block", [] { return kMulticastLinesPerBlock; });
  t.def("multicast_need_bytes", &MulticastNeedBytes, nb::arg("slot_bytes"));
  t.def("multicast_layout", &MakeMulticastLayout, nb::arg("slot_bytes"), nb::arg("mc_min"),
        nb::arg("mc_rec"), nb::arg("mem_gran"));
  t.def("multicast_round_up", &RoundUpTo, nb::arg("x"), nb::arg("granularity"));
  t.def("multicast_lcm", &Lcm, nb::arg("a"), nb::arg("b"));
  t.def("multicast_slot_offset", [](const MulticastLayout& l, uint32_t epoch) {
    return MulticastSlotOffset(l, epoch);
  });
  t.def("multicast_line_offset", [](const MulticastLayout& l, uint32_t epoch, size_t line) {
    return MulticastLineOffset(l, epoch, line);
  });
  t.def("multicast_flag_offset", [](const MulticastLayout& l, uint32_t epoch, int block) {
    if (block < 0 || block >= kMaxBlocks) throw std::out_of_range("block out of range");
    return MulticastFlagOffset(l, epoch, block);
  });
  t.def("multicast_flag_bytes", [] { return sizeof(MulticastFlag); });
  t.def("multicast_flags_valid", [](uint64_t flag_sum, int nranks, uint32_t epoch) {
    return MulticastFlagsValid(flag_sum, nranks, epoch);
  });
  t.def("multicast_blocks", [](size_t lines) { return MulticastBlocks(lines); });
  t.def("multicast_line_owners", &LineOwners, nb::arg("lines"));
  t.def("multicast_block_of_line",
        [](size_t line) { return BlockOfLine(line, kMulticastLinesPerBlock); });
}

}  // namespace sifar
