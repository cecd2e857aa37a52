"""The model families the decoder and the CLI know, and how to find one: by config, by preset
name, or by a Hugging Face checkpoint's config.json. A new family adds one entry to FAMILIES."""

from __future__ import annotations

from typing import Any

from .checkpoint import read_hf_config
from .family import ModelFamily
from .llama import LLAMA
from .qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (LLAMA, QWEN3_MOE)}


def family_of(config: Any) -> ModelFamily:
    """The family whose config type `config` is."""
    for family in FAMILIES.values():
        if isinstance(config, family.config_type):
            return family
    raise TypeError(f"no model family has configs of type {type(config).__name__}; "
                    f"known: {sorted(FAMILIES)}")


def presets() -> dict[str, ModelFamily]:
    """Preset name -> its family, over every family (preset names are unique)."""
    out: dict[str, ModelFamily] = {}
    for family in FAMILIES.values():
        for name in family.presets:
            if name in out:
                raise ValueError(f"preset {name!r} is defined by {out[name].name} and {family.name}")
            out[name] = family
    return out


def preset(name: str, **overrides) -> Any:
    """The config of preset `name` (whatever its family)."""
    found = presets()
    if name not in found:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(found)}")
    return found[name].preset(name, **overrides)


def family_for_checkpoint(path: str) -> ModelFamily:
    """The family that reads the Hugging Face checkpoint at `path` (by config.json's
    model_type)."""
    model_type = read_hf_config(path).get("model_type")
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    raise ValueError(f"{path}: model_type {model_type!r} is not supported; known: "
                     f"{sorted(t for f in FAMILIES.values() for t in f.hf_model_types)}")
