"""Loads the compiled extension and registers its FFI targets with XLA (at import)."""

from __future__ import annotations

import jax

try:
    from . import _sifar
except ImportError as e:  # pragma: no cover - only when the build is missing
    raise ImportError(
        "sifar_jax's compiled extension is missing: install the package with "
        "`pip install .` (or `pip install --no-build-isolation -e .`)"
    ) from e

TARGET = "sifar_allreduce"  # x -> y on the internal dual slots
TARGET_INTO = "sifar_allreduce_into"  # (x, buf, prev) -> (y, buf) on user buffers
# (x, residual, weight) -> (normed, new_residual): the all-reduce + residual add + RMSNorm
TARGET_FUSED = "sifar_psum_add_rmsnorm"


def _register() -> frozenset[str]:
    """Registers every handler the build has; returns their platforms ("cpu", "cuda")."""
    platforms = set()
    for target, by_platform in _sifar.handlers().items():
        for platform, capsule in by_platform.items():
            xla_platform = "CUDA" if platform == "cuda" else platform
            jax.ffi.register_ffi_target(target, capsule, platform=xla_platform)
            platforms.add(platform)
    return frozenset(platforms)


# Once, when sifar_jax is imported: any function traced afterwards may lower
# to these targets, whether or not a communicator was set up yet.
PLATFORMS: frozenset[str] = _register()
