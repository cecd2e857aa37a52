"""Loads the compiled extension and registers its FFI targets with XLA (at import).

The targets come from the extension's one table (ffi/targets.h): `TARGETS`
names them by op (`TARGETS.allreduce`, `TARGETS.allreduce_into`,
`TARGETS.psum_add_rmsnorm`), so no target name is written twice. `lib` is the
extension module itself.
"""

from __future__ import annotations

import types

import jax

try:
    from . import _sifar as lib
except ImportError as e:  # pragma: no cover - only when the build is missing
    raise ImportError(
        "sifar_jax's compiled extension is missing: install the package with "
        "`pip install .` (or `pip install --no-build-isolation -e .`)"
    ) from e

# The same module under the name this one gave it before `lib` (kept for
# benchmark scripts written against it).
_sifar = lib

# op -> FFI target name, e.g. TARGETS.allreduce == "sifar_allreduce".
TARGETS = types.SimpleNamespace(**lib.targets())


def _register() -> frozenset[str]:
    """Registers every handler the build has; returns their platforms ("cpu", "cuda")."""
    platforms = set()
    for target, by_platform in lib.handlers().items():
        for platform, capsule in by_platform.items():
            xla_platform = "CUDA" if platform == "cuda" else platform
            jax.ffi.register_ffi_target(target, capsule, platform=xla_platform)
            platforms.add(platform)
    return frozenset(platforms)


# Once, when sifar_jax is imported: any function traced afterwards may lower
# to these targets, whether or not a communicator was set up yet.
PLATFORMS: frozenset[str] = _register()
