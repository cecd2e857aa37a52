// The nanobind module `sifar_jax._sifar`: the FFI targets (from the one table,
// targets.h), the communicator registry, and the limits and workspace sizes
// the Python layer checks before calling an op, as plain functions the Python
// layer composes.  The bindings of communicators spanning processes, of
// multicast and of the test-only hooks live beside their code (bindings/,
// multicast/).
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "allreduce/plan.h"
#include "core/protocol.h"
#include "fused/fused.h"
#include "runtime/comm.h"
#include "runtime/peer_memory.h"
#include "step/llama_step.h"
#include "step/llama_step_tp.h"
#include "targets.h"

namespace nb = nanobind;
using namespace sifar;

namespace {

template <typename F>
void WithComm(int id, F&& f) {
  if (!Registry::Get().With(id, std::forward<F>(f)))
    throw std::invalid_argument("sifar_jax: no communicator " + std::to_string(id));
}

template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

namespace sifar {
void RegisterMulticastBindings(nb::module_& m);
void RegisterMulticastTestingBindings(nb::module_& t);
void RegisterTestingBindings(nb::module_& t);
void RegisterPeerBindings(nb::module_& m);
void RegisterBuildBindings(nb::module_& m);  // bindings/build_bindings.cc
void RegisterStepBindings(nb::module_& m);   // bindings/step_bindings.cc
}  // namespace sifar

#ifdef SIFAR_WITH_CUDA
namespace sifar {
bool CudaCanAccessPeer(int a, int b);
int CudaDeviceCount();
void RegisterGpuTestingBindings(nb::module_& t);  // bindings/testing_gpu.cc

void PreloadCudaKernels() {
#define SIFAR_PRELOAD(op, name, cpu, cuda, preload) preload();
  SIFAR_FFI_TARGETS(SIFAR_PRELOAD)
#undef SIFAR_PRELOAD
}
}  // namespace sifar
#endif

NB_MODULE(_sifar, m) {
  m.doc() = "SiFAR all-reduce: XLA FFI handlers and communicator registry";

  // The table of FFI targets (targets.h), as {target name: {platform: capsule}}.
  m.def("handlers", [] {
    nb::dict d;
#ifdef SIFAR_WITH_CUDA
#define SIFAR_CUDA_CAPSULE(p, cuda) p["cuda"] = Capsule(cuda);
#else
#define SIFAR_CUDA_CAPSULE(p, cuda)
#endif
#define SIFAR_HANDLERS(op, name, cpu, cuda, preload) \
  {                                                  \
    nb::dict p;                                      \
    p["cpu"] = Capsule(cpu);                         \
    SIFAR_CUDA_CAPSULE(p, cuda)                      \
    d[name] = p;                                     \
  }
    SIFAR_FFI_TARGETS(SIFAR_HANDLERS)
#undef SIFAR_HANDLERS
#undef SIFAR_CUDA_CAPSULE
    return d;
  });
  // ... and as {op: target name}: the names sifar_jax calls (src/sifar_jax/_ext.py, TARGETS).
  m.def("targets", [] {
    nb::dict d;
#define SIFAR_TARGET_NAME(op, name, cpu, cuda, preload) d[#op] = name;
    SIFAR_FFI_TARGETS(SIFAR_TARGET_NAME)
#undef SIFAR_TARGET_NAME
    return d;
  });
  m.def("built_with_cuda", [] {
#ifdef SIFAR_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
  m.def("max_ranks", [] { return kMaxRanks; });
  // psum_add_rmsnorm: blocks one row spans, 0 where the fused kernel cannot run.
  m.def("fused_row_blocks", [](size_t row_bytes) { return FusedRowBlocks(row_bytes); },
        nb::arg("row_bytes"));
  // psum_add_rmsnorm: a row's share of the payload (padded to a power of two of lines).
  m.def("fused_padded_row_bytes",
        [](size_t row_bytes) { return FusedPaddedRowBytes(row_bytes); }, nb::arg("row_bytes"));
  // psum_add_rmsnorm: the longest row the fused kernel holds, once padded.
  m.def("fused_max_row_bytes", [] { return kMaxFusedRowBytes; });
  m.def(
      "workspace_bytes",
      [](size_t slot_bytes, int nranks, int lanes) {
        if (slot_bytes == 0 || slot_bytes % 16 != 0)
          throw std::invalid_argument("sifar_jax: slot_bytes must be a positive multiple of 16");
        if (nranks < 1 || nranks > kMaxRanks)
          throw std::invalid_argument("sifar_jax: nranks must be 1.." + std::to_string(kMaxRanks));
        if (lanes < 1 || lanes > 64) throw std::invalid_argument("sifar_jax: lanes must be 1..64");
        return MakeWorkspaceLayout(slot_bytes, nranks, lanes).total;
      },
      nb::arg("slot_bytes"), nb::arg("nranks"), nb::arg("lanes"),
      "Device memory one rank of one communicator reserves");
  // llama_step: the op's limits (step/llama_step.h), which sifar_jax.decode_step checks before
  // calling it, so that no limit is written twice.
  // The one list of algorithms (protocol.h): Python reads names and ids here.
  m.def("algorithms", [] {
    nb::list out;
    for (const AlgorithmInfo& a : kAlgorithms) {
      nb::dict d;
      d["id"] = a.id;
      d["name"] = a.name;
      d["line_bytes"] = a.line_bytes;
      d["tagged"] = a.tagged;
      d["exact"] = a.exact;
      d["portable"] = a.portable;
      d["description"] = a.description;
      out.append(d);
    }
    return out;
  });
  m.def("dtypes", [] {
    nb::list out;
    for (const char* const* n = SupportedDtypeNames(); *n != nullptr; ++n) out.append(*n);
    return out;
  });

  m.def(
      "create_comm",
      [](const std::string& platform, int axis_key, const std::string& axis_name,
         const std::vector<std::vector<int>>& groups, size_t slot_bytes, double timeout_s,
         int lanes, std::shared_ptr<PeerWorkspaces> peers) {
        Platform p;
        if (platform == "cpu") p = Platform::kCpu;
        else if (platform == "cuda") p = Platform::kCuda;
        else throw std::invalid_argument("sifar_jax: unsupported platform '" + platform + "'");
        nb::gil_scoped_release release;
        return Registry::Get().Create(p, axis_key, axis_name, groups, slot_bytes, timeout_s,
                                      lanes, std::move(peers));
      },
      nb::arg("platform"), nb::arg("axis_key"), nb::arg("axis_name"), nb::arg("groups"),
      nb::arg("slot_bytes"), nb::arg("timeout_s"), nb::arg("lanes"),
      // A communicator spanning processes: its shared workspaces (groups are
      // then local ordinals, -1 for other processes' ranks).
      nb::arg("peers") = nb::none());
  // Both wait for the communicators' handler calls and devices (no GIL held).
  m.def("destroy_comm", [](int id) {
    nb::gil_scoped_release release;
    Registry::Get().Destroy(id);
  });
  m.def("destroy_all", [] {
    nb::gil_scoped_release release;
    Registry::Get().DestroyAll();
  });
  m.def("release_pooled_memory", [] {
    nb::gil_scoped_release release;
    ReleasePooledMemory();
  });

  m.def("comm_stats", [](int id) {
    // [rank-in-comm (groups concatenated)][algorithm][calls, retries, timeouts]
    std::vector<std::vector<std::vector<uint64_t>>> out;
    WithComm(id, [&](Comm& c) {
      for (auto& rank : c.Stats()) {
        std::vector<std::vector<uint64_t>> per_alg;
        for (auto& f : rank) per_alg.emplace_back(f.begin(), f.end());
        out.push_back(per_alg);
      }
    });
    return out;
  });
  m.def("comm_failure", [](int id) {
    std::string msg;
    // A failure of llama_step's all-reduce across devices names its phase first.
    WithComm(id, [&](Comm& c) { msg = step::DescribeStepFailure(c); });
    return msg;
  });
  m.def("comm_multicast_refusal", [](int id) {
    // "" when every group of the communicator has a live multicast group.
    std::string why;
    WithComm(id, [&](Comm& c) {
      for (auto& g : c.groups())
        if (!g.multicast) why = g.multicast_refusal.empty() ? "no multicast group" : g.multicast_refusal;
    });
    return why;
  });
  m.def("slot_total_bytes", [](int id) {
    size_t n = 0;
    WithComm(id, [&](Comm& c) { n = c.slot_total_bytes(); });
    return n;
  });
  m.def("register_buffer",
        [](int id, int group, const std::vector<uintptr_t>& per_rank, size_t bytes) {
          uint64_t reg = 0;
          WithComm(id, [&](Comm& c) { reg = c.RegisterBuffer(group, per_rank, bytes); });
          return reg;
        });
  m.def("unregister_buffer", [](int id, uint64_t reg) {
    bool found = false;
    WithComm(id, [&](Comm& c) { found = c.UnregisterBuffer(reg); });
    return found;
  });
  m.def("buffer_ids", [](int id, int group) {
    std::vector<uint64_t> ids;
    WithComm(id, [&](Comm& c) {
      for (auto& b : c.Buffers(group)) ids.push_back(b.id);
    });
    return ids;
  });
  m.def("set_timeout", [](int id, double s) { WithComm(id, [&](Comm& c) { c.SetTimeout(s); }); });
  // The call trace (sifar_jax.stats.trace): on/off, then the records.
  m.def("set_trace", [](int id, bool on) { WithComm(id, [&](Comm& c) { c.SetTrace(on); }); });
  // [(group, rank, epoch, chain, algorithm, start_ns, end_ns, retried)], oldest first per rank.
  m.def("comm_trace", [](int id) {
    std::vector<std::tuple<int, int, uint32_t, uint32_t, int, uint64_t, uint64_t, bool>> out;
    WithComm(id, [&](Comm& c) {
      for (auto& [g, r, t] : c.Trace())
        out.emplace_back(g, r, t.epoch, t.chain, t.algorithm, t.start_ns, t.end_ns, t.retried != 0);
    });
    return out;
  });

  RegisterMulticastBindings(m);
  RegisterPeerBindings(m);
  RegisterBuildBindings(m);
  RegisterStepBindings(m);
  nb::module_ testing = m.def_submodule("testing", "Test-only hooks (sifar_jax._testing)");
  RegisterTestingBindings(testing);
  RegisterMulticastTestingBindings(testing);
#ifdef SIFAR_WITH_CUDA
  RegisterGpuTestingBindings(testing);
#endif

  m.def("cuda_can_access_peer", [](int a, int b) {
#ifdef SIFAR_WITH_CUDA
    return CudaCanAccessPeer(a, b);
#else
    (void)a, (void)b;
    return false;
#endif
  });
}
