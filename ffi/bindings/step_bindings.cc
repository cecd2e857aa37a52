// The step across devices' numbers Python asks for (src/sifar_jax/decode_step_tp.py): its
// workspace size (StepWorkspace of this rank's shard, Shape::devices) and the slot its tagged
// words need.
#include <nanobind/nanobind.h>

#include <stdexcept>
#include <string>

#include "step/llama_step.h"

namespace nb = nanobind;

namespace sifar {

void RegisterStepBindings(nb::module_& m) {
  m.def(
      "llama_step_tp_workspace_bytes",
      [](int hidden, int kv_heads, int group, int ffn, int layers, int devices) {
        if (hidden < 1 || kv_heads < 1 || group < 1 || ffn < 1 || layers < 1 || devices < 2 ||
            devices > step::kMaxRanks)
          throw std::invalid_argument("sifar_jax: llama_step_tp_workspace_bytes: positive sizes "
                                      "and 2.." + std::to_string(step::kMaxRanks) + " devices");
        step::Shape s;
        s.hidden = hidden;
        s.kv_heads = kv_heads;
        s.group = group;
        s.ffn = ffn;
        s.layers = layers;
        s.devices = devices;
        return step::StepWorkspace(s).total;
      },
      nb::arg("hidden"), nb::arg("kv_heads"), nb::arg("group"), nb::arg("ffn"),
      nb::arg("layers"), nb::arg("devices"),
      "The workspace of one rank of llama_step across devices (this rank's kv_heads and ffn)");
  m.def(
      "llama_step_tp_slot_bytes", [](int hidden) { return 4 * static_cast<size_t>(hidden); },
      nb::arg("hidden"),
      "The communicator slot llama_step across devices needs: one 8-byte tagged word per row, "
      "in a tagged region of two slots");
}

}  // namespace sifar
