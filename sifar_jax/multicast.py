"""The guard in front of the NVLink multicast algorithm (redundant pull).

Multicast can take a host's shared GPUs out of service, so it is opt-in and
refuses to start wherever the system says multicast is off. The guard runs
before any CUDA multicast call is made, here in Python and again in C++ as the
first step of the multicast set-up (defense in depth).

Status: algorithm="multicast" is implemented and compiled, but it has never
been executed on our hardware (multicast is forbidden on our GPU hosts).

On a host with NVLink SHARP (NVSwitch) where multicast is allowed:

    export SIFAR_ENABLE_MULTICAST=1        # and none of the disabling variables
    python -c "import sifar_jax.multicast as m; print(m.refusal_here([0, 1]))"   # None
    python -c "import sifar_jax.multicast as m; print(m.probe_setup([0, 1]))"    # builds, frees
"""

from __future__ import annotations

import os

ENABLE_VAR = "SIFAR_ENABLE_MULTICAST"
# Variables that mean "multicast is off on this host", with the value that says so.
DISABLING = {
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}


class MulticastDisabledError(RuntimeError):
    """algorithm="multicast" was requested where multicast is not allowed."""


def refusal(environ=None, device_supports: bool | None = None) -> str | None:
    """Why multicast may not run here, or None if it may."""
    env = os.environ if environ is None else environ
    if env.get(ENABLE_VAR, "") != "1":
        return f"NVLink multicast is opt-in: set {ENABLE_VAR}=1 on a host where it is safe"
    for var, off in DISABLING.items():
        if env.get(var, "").strip() == off:
            return f"{var}={off} is set: this host has NVLink multicast turned off"
    if device_supports is False:
        return "the GPUs do not report multicast support (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED)"
    return None


def enabled(environ=None) -> bool:
    return refusal(environ) is None


def require_enabled(environ=None, device_supports: bool | None = None) -> None:
    reason = refusal(environ, device_supports)
    if reason is not None:
        raise MulticastDisabledError(f"sifar_jax: algorithm 'multicast' refused: {reason}")


# --------------------------------------------------------------------------
# The C++ side (the compiled extension). Nothing below makes a CUDA call
# unless the environment allows multicast.


def _sifar():
    from . import _ext

    return _ext._sifar


def cpp_refusal(environ=None, device_supports: bool | None = None) -> str | None:
    """The C++ guard's answer for `environ` (a mapping; default os.environ). Pure."""
    env = os.environ if environ is None else environ
    return _sifar().multicast_refusal(dict(env), device_supports)


def refusal_here(ordinals) -> str | None:
    """Why multicast may not run on these local devices (ordinals), or None.

    The environment is checked first, in Python and then in C++; only when it
    allows multicast does the extension query each device's
    CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED (a read-only query). A build
    without CUDA always refuses.
    """
    reason = refusal()
    if reason is not None:
        return reason
    return _sifar().multicast_refusal_here([int(o) for o in ordinals])


def counters() -> dict[str, int]:
    """Process-wide counts: `cuda_calls` (every CUDA driver or runtime call the
    multicast code has made), `refusals` (C++ guard refusals), `setups`
    (set-ups that got past the guard)."""
    return dict(_sifar().multicast_counters())


def driver_calls() -> int:
    """CUDA calls the multicast code has made in this process (0 while refused)."""
    return counters()["cuda_calls"]


def probe_setup(ordinals, slot_bytes: int = 64 * 1024):
    """Builds a multicast group for these local devices and frees it again.

    The first thing to run on a host with NVLink SHARP: it exercises the whole
    set-up (granularity, cuMulticastCreate, binding, both mappings) without
    launching a kernel. Raises MulticastDisabledError where refused (the guard
    runs first, in Python and again in C++); returns the buffer layout.
    """
    require_enabled()
    slot_bytes = -(-int(slot_bytes) // 16) * 16
    return _sifar().multicast_probe_setup([int(o) for o in ordinals], slot_bytes)
