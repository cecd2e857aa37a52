"""The guard in front of the NVLink multicast algorithm (redundant pull).

Multicast can take a host's shared GPUs out of service, so it is opt-in and
refuses to start wherever the system says multicast is off. The guard is
written once, in C++ (ffi/multicast/multicast_setup.cc): this module asks it, and the
multicast set-up runs it again as its first step, before any CUDA call.

Status: algorithm="multicast" is implemented and compiled, but it has never
been executed on our hardware (multicast is forbidden on our GPU hosts).

On a host with NVLink SHARP (NVSwitch) where multicast is allowed:

    export SIFAR_ENABLE_MULTICAST=1        # and none of the disabling variables
    python -c "import sifar_jax.multicast as m; print(m.refusal_here([0, 1]))"   # None
    python -c "import sifar_jax.multicast as m; print(m.probe_setup([0, 1]))"    # builds, frees
"""

from __future__ import annotations

import os

from . import _ext

# The opt-in variable, and the variables that mean "multicast is off on this
# host" with the value that says so (the C++ guard's own lists).
ENABLE_VAR, DISABLING = _ext.lib.multicast_guard_vars()
ENABLE_VAR = str(ENABLE_VAR)
DISABLING = dict(DISABLING)


class MulticastDisabledError(RuntimeError):
    """algorithm="multicast" was requested where multicast is not allowed."""


def refusal(environ=None, device_supports: bool | None = None) -> str | None:
    """Why multicast may not run here, or None if it may (the C++ guard, pure:
    it reads only `environ`, default os.environ, and makes no CUDA call)."""
    env = os.environ if environ is None else environ
    guard_vars = {v: str(env[v]) for v in (ENABLE_VAR, *DISABLING) if v in env}
    return _ext.lib.multicast_refusal(guard_vars, device_supports)


def enabled(environ=None) -> bool:
    return refusal(environ) is None


def require_enabled(environ=None, device_supports: bool | None = None) -> None:
    reason = refusal(environ, device_supports)
    if reason is not None:
        raise MulticastDisabledError(f"sifar_jax: algorithm 'multicast' refused: {reason}")


def refusal_here(ordinals) -> str | None:
    """Why multicast may not run on these local devices (ordinals), or None.

    The environment is checked first; only when it allows multicast does the
    extension query each device's CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED (a
    read-only query). A build without CUDA always refuses.
    """
    return _ext.lib.multicast_refusal_here([int(o) for o in ordinals])


def counters() -> dict[str, int]:
    """Process-wide counts: `cuda_calls` (every CUDA driver or runtime call the
    multicast code has made), `refusals` (C++ guard refusals), `setups`
    (set-ups that got past the guard)."""
    return dict(_ext.lib.multicast_counters())


def driver_calls() -> int:
    """CUDA calls the multicast code has made in this process (0 while refused)."""
    return counters()["cuda_calls"]


def probe_setup(ordinals, slot_bytes: int = 64 * 1024):
    """Builds a multicast group for these local devices and frees it again.

    The first thing to run on a host with NVLink SHARP: it exercises the whole
    set-up (granularity, cuMulticastCreate, binding, both mappings) without
    launching a kernel. Raises MulticastDisabledError where refused (the guard
    runs first, here and again inside the set-up); returns the buffer layout.
    """
    require_enabled()
    slot_bytes = -(-int(slot_bytes) // 16) * 16
    return _ext.lib.multicast_probe_setup([int(o) for o in ordinals], slot_bytes)
