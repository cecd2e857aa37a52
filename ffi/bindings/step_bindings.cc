// The step's numbers Python asks for (src/sifar_jax/decode_step.py, decode_step_tp.py): its limits
// (llama_step.h), its workspace size on one device and across devices (StepWorkspace of the
// shape, the op checks the size it is given against it), and the slot its tagged words need.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>

#include "step/llama_step.h"
#include "step/qwen3_moe_step.h"

namespace nb = nanobind;

namespace sifar {

namespace {

// The shape whose StepWorkspace the bindings size (ranks or devices set by the caller).
step::Shape WorkspaceShape(int hidden, int kv_heads, int group, int ffn, int layers) {
  step::Shape s;
  s.hidden = hidden;
  s.kv_heads = kv_heads;
  s.group = group;
  s.ffn = ffn;
  s.layers = layers;
  return s;
}

}  // namespace

void RegisterStepBindings(nb::module_& m) {
  m.def("llama_step_limits", [] {
    nb::dict d;
    d["head_dim"] = step::kHeadDim;
    d["max_group"] = step::kMaxGroup;
    d["max_splits"] = step::kMaxSplits;
    d["max_layers"] = step::kMaxLayers;
    d["max_ranks"] = step::kMaxRanks;
    d["status_words"] = static_cast<int>(step::kStatusWords);
    d["chunk"] = step::kChunk;
    d["max_timeout_ns"] = step::kMaxTimeoutNs;
    d["default_timeout_ns"] = step::kDefaultTimeoutNs;
    return d;
  });
  // llama_step: the bytes of the workspace result (StepWorkspace's layout, which the op checks
  // the size it is given against).
  m.def(
      "llama_step_workspace_bytes",
      [](int hidden, int kv_heads, int group, int ffn, int layers, int ranks) {
        if (hidden < 1 || kv_heads < 1 || ffn < 1 || group < 1 || group > step::kMaxGroup ||
            layers < 1 || layers > step::kMaxLayers || ranks < 1 || ranks > step::kMaxRanks)
          throw std::invalid_argument(
              "sifar_jax: llama_step_workspace_bytes: hidden, kv_heads, ffn >= 1, group in [1, " +
              std::to_string(step::kMaxGroup) + "], layers in [1, " +
              std::to_string(step::kMaxLayers) + "], ranks in [1, " +
              std::to_string(step::kMaxRanks) + "] needed");
        step::Shape s = WorkspaceShape(hidden, kv_heads, group, ffn, layers);
        s.ranks = ranks;
        return step::StepWorkspace(s).total;
      },
      nb::arg("hidden"), nb::arg("kv_heads"), nb::arg("group"), nb::arg("ffn"),
      nb::arg("layers"), nb::arg("ranks") = 1);
  m.def(
      "llama_step_tp_workspace_bytes",
      [](int hidden, int kv_heads, int group, int ffn, int layers, int devices) {
        if (hidden < 1 || kv_heads < 1 || group < 1 || ffn < 1 || layers < 1 || devices < 2 ||
            devices > step::kMaxRanks)
          throw std::invalid_argument("sifar_jax: llama_step_tp_workspace_bytes: positive sizes "
                                      "and 2.." + std::to_string(step::kMaxRanks) + " devices");
        step::Shape s = WorkspaceShape(hidden, kv_heads, group, ffn, layers);
        s.devices = devices;
        return step::StepWorkspace(s).total;
      },
      nb::arg("hidden"), nb::arg("kv_heads"), nb::arg("group"), nb::arg("ffn"),
      nb::arg("layers"), nb::arg("devices"),
      "The workspace of one rank of llama_step across devices (this rank's kv_heads and ffn)");
  m.def("qwen3_moe_step_limits", [] {
    nb::dict d;
    d["max_experts"] = step::kMaxExperts;
    d["max_top_k"] = step::kMaxTopK;
    return d;
  });
  // qwen3_moe_step: the bytes of its workspace (Qwen3MoeWorkspace) and where in it the
  // selection record lies (sel: [layers][top_k] int32 ids, then as many float32 weights).
  m.def(
      "qwen3_moe_step_workspace",
      [](int hidden, int kv_heads, int group, int inter, int layers, int experts, int top_k,
         int ranks) {
        if (hidden < 1 || kv_heads < 1 || inter < 1 || group < 1 || group > step::kMaxGroup ||
            layers < 1 || layers > step::kMaxLayers || top_k < 1 || top_k > step::kMaxTopK ||
            experts < top_k || experts > step::kMaxExperts || ranks < 1 ||
            ranks > step::kMaxRanks)
          throw std::invalid_argument(
              "sifar_jax: qwen3_moe_step_workspace: hidden, kv_heads, inter >= 1, group in [1, " +
              std::to_string(step::kMaxGroup) + "], layers in [1, " +
              std::to_string(step::kMaxLayers) + "], top_k in [1, " +
              std::to_string(step::kMaxTopK) + "], experts in [top_k, " +
              std::to_string(step::kMaxExperts) + "], ranks in [1, " +
              std::to_string(step::kMaxRanks) + "] needed");
        step::MoeShape m;
        m.s = WorkspaceShape(hidden, kv_heads, group, inter, layers);
        m.s.ranks = ranks;
        m.experts = experts;
        m.top_k = top_k;
        const step::MoeWorkspace w = step::Qwen3MoeWorkspace(m);
        nb::dict d;
        d["total"] = w.total;
        d["sel"] = w.sel;
        return d;
      },
      nb::arg("hidden"), nb::arg("kv_heads"), nb::arg("group"), nb::arg("inter"),
      nb::arg("layers"), nb::arg("experts"), nb::arg("top_k"), nb::arg("ranks") = 1);
  m.def(
      "llama_step_tp_slot_bytes", [](int hidden) { return 4 * static_cast<size_t>(hidden); },
      nb::arg("hidden"),
      "The communicator slot llama_step across devices needs: one 8-byte tagged word per row, "
      "in a tagged region of two slots");
}

}  // namespace sifar
