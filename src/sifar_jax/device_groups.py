"""The devices a communicator spans: its groups of ranks along a mesh's axes, the sifar_jax
platform of a device, and why a set of groups cannot have a communicator (comm.init records it
as Unsupported; the all-reduce then falls back to lax.psum)."""

from __future__ import annotations

import math

import numpy as np

from . import _ext, architectures, distributed


def platform(device) -> str | None:
    if device.platform == "cpu":
        return "cpu"
    if device.platform == "gpu" and "cuda" in device.client.platform_version.lower():
        return "cuda"
    return None


def groups(mesh, axes) -> list[list]:
    """Device groups along `axes` (a name or a tuple), in rank order: row-major
    over the axes in the order given, like lax.axis_index(axes)."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    where = [mesh.axis_names.index(a) for a in axes]
    devs = np.moveaxis(np.asarray(mesh.devices), where, range(-len(axes), 0))
    size = math.prod(devs.shape[-len(axes):])
    return [list(row) for row in devs.reshape(-1, size)]


def why_unsupported(groups: list[list], platform: str | None) -> str | None:
    n = len(groups[0])
    if platform is None:
        return f"no sifar_jax handler for platform {groups[0][0].platform!r}"
    if platform not in _ext.PLATFORMS:
        return f"sifar_jax was built without its {platform} backend"
    if n > _ext.lib.max_ranks():
        return f"axis has {n} devices; sifar_jax supports up to {_ext.lib.max_ranks()}"
    if distributed.spans_processes(groups):
        return None  # decided with the other processes (sifar_jax.distributed)
    if platform == "cuda":
        why = architectures.unsupported_gpus([d for g in groups for d in g])
        if why is not None:
            return why
        for g in groups:
            for a in g:
                for b in g:
                    if a is not b and not _ext.lib.cuda_can_access_peer(
                        a.local_hardware_id, b.local_hardware_id
                    ):
                        return f"GPUs {a.id} and {b.id} cannot reach each other over P2P"
    return None
