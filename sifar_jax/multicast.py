"""The guard in front of the NVLink multicast algorithm (redundant pull).

Multicast can take a host's shared GPUs out of service, so it is opt-in and
refuses to start wherever the system says multicast is off. The guard runs
before any CUDA multicast call is made.
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
