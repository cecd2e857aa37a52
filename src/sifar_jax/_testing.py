"""Test-only hooks of the compiled extension (its `_testing` submodule).

Nothing in sifar_jax uses these; the test suite and the GPU harness do.
"""

from . import _ext

_mod = _ext.lib.testing
globals().update({k: getattr(_mod, k) for k in dir(_mod) if not k.startswith("__")})


def pooled_workspaces() -> set[int]:
    """Workspace addresses in the pool (memory no communicator uses now)."""
    return set(_mod.pooled_workspace_list())
