// nanobind bindings for the multicast guard and set-up arithmetic.
#include <nanobind/nanobind.h>

#include "multicast.h"

namespace sifar {
void RegisterMulticastBindings(nanobind::module_& m) { (void)m; }
}  // namespace sifar
