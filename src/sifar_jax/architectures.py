"""Which GPUs this build of sifar_jax can run on.

The CUDA backend is compiled for a list of architectures (CMakeLists.txt,
SIFAR_CUDA_ARCHITECTURES, in CMake's CUDA_ARCHITECTURES syntax; wheels carry
"90-real;100-real;100-virtual"), reported by `build_info()`. A GPU runs the
kernels when the list holds

* SASS (`N-real`) of its family: sm_XY code runs on compute capability X.Z
  for Z >= Y (CUDA's binary compatibility within a major version), except the
  arch-specific `XYa`, which runs on X.Y only; or
* PTX (`N-virtual`) for an older or equal architecture: compute_XY is compiled
  by the driver for any compute capability >= X.Y (`XYa`: X.Y only, `XYf`:
  X.Z for Z >= Y).

Where no entry fits, the kernels cannot load: `init` falls back to lax.psum
for the axes on that GPU and says which GPUs the build supports.
"""

from __future__ import annotations

import dataclasses
import re

from . import _ext

# Every reason given by `unsupported_gpus` starts with this (comm.init warns
# at init for these, instead of leaving them to the first trace).
REASON_PREFIX = "sifar_jax's CUDA backend cannot run on"

_ENTRY = re.compile(r"^(\d+)([af]?)(?:-(real|virtual))?$")


def build_info() -> dict:
    """What the compiled extension holds: backends, CUDA runtime version and
    linkage, CUDA architectures, the jax (and XLA FFI API) it was built
    against, nanobind's version, whether it uses the stable Python ABI."""
    return dict(_ext.lib.build_info())


@dataclasses.dataclass(frozen=True)
class Target:
    """One entry of the architecture list, e.g. "100-real"."""

    number: int  # 90 for sm_90: compute capability number // 10 . number % 10
    variant: str  # "" (portable), "a" (arch-specific), "f" (family-specific)
    sass: bool
    ptx: bool

    @property
    def capability(self) -> tuple[int, int]:
        return divmod(self.number, 10)

    def runs_on(self, capability: tuple[int, int]) -> bool:
        major, minor = self.capability
        if self.variant == "a":  # arch-specific code: that GPU only
            return tuple(capability) == (major, minor)
        same_family = capability[0] == major and capability[1] >= minor
        if self.sass and same_family:
            return True
        if self.ptx:  # the driver compiles PTX for its own GPU
            return same_family if self.variant == "f" else tuple(capability) >= (major, minor)
        return False

    def describe(self) -> str:
        major, minor = self.capability
        name = f"{self.number}{self.variant}"
        parts = []
        if self.sass:
            where = f"{major}.{minor} only" if self.variant == "a" else f"{major}.{minor} to {major}.x"
            parts.append(f"sm_{name} (compute capability {where})")
        if self.ptx:
            where = {"a": f"{major}.{minor} only", "f": f"{major}.{minor} to {major}.x"}.get(
                self.variant, f"{major}.{minor} or newer")
            parts.append(f"compute_{name} PTX (compute capability {where}, compiled by the driver)")
        return ", ".join(parts)


def parse(entry: str) -> Target | None:
    """A CMake CUDA_ARCHITECTURES entry ("90", "90-real", "100-virtual",
    "90a-real"); None for the ones that name no architecture ("all",
    "all-major", "native": resolved by CMake when it built)."""
    m = _ENTRY.match(entry.strip())
    if m is None:
        return None
    number, variant, kind = m.groups()
    return Target(int(number), variant, sass=kind in (None, "real"), ptx=kind in (None, "virtual"))


def covers(capability: tuple[int, int], architectures) -> bool:
    """Whether code built for `architectures` runs on a GPU of `capability`.
    True where an entry cannot be judged ("native", "all"): that build was
    made for GPUs CMake saw or for every one it knew."""
    targets = [parse(a) for a in architectures]
    if any(t is None for t in targets):
        return True
    return any(t.runs_on(capability) for t in targets)


def describe(architectures) -> str:
    """The GPUs a list of architectures serves, for messages."""
    targets = [parse(a) for a in architectures]
    return "; ".join(t.describe() if t is not None else repr(a)
                     for a, t in zip(architectures, targets))


def _not_served(device, capability, architectures) -> str:
    major, minor = capability
    return (f"{REASON_PREFIX} GPU {device.id} ({device.device_kind}, compute capability "
            f"{major}.{minor}): it was built for {describe(architectures)}. Build it with "
            f"SIFAR_CUDA_ARCHITECTURES including {major}{minor}-real to use this GPU")


def unsupported_gpus(devices, capability_of=None, architectures=None) -> str | None:
    """Why the CUDA backend cannot run on some of these local GPUs, or None.

    capability_of(device) -> (major, minor) defaults to asking CUDA (a failure,
    e.g. a driver older than the runtime, is itself the reason);
    architectures defaults to this build's. (Both are arguments so that the
    decision is tested on machines without GPUs.)
    """
    if architectures is None:
        architectures = build_info()["cuda_architectures"]
    if capability_of is None:
        def capability_of(d):
            return tuple(_ext.lib.device_compute_capability(d.local_hardware_id))
    for d in devices:
        try:
            capability = tuple(capability_of(d))
        except RuntimeError as e:
            info = build_info()
            driver = _ext.lib.cuda_driver_version()
            return (f"{REASON_PREFIX} GPU {d.id} ({d.device_kind}): {e} (its CUDA runtime is "
                    f"{info['cuda_runtime_version']}, the driver supports CUDA "
                    f"{driver or 'none'})")
        if not covers(capability, architectures):
            return _not_served(d, capability, architectures)
    return None
