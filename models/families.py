"""The model families the decoder and the CLI know, and how to find one: by config, by preset
name, or by a Hugging Face checkpoint's config.json. A new family adds one entry to FAMILIES."""

from __future__ import annotations

from typing import Any, Optional

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


# models.<name>: the family found from the config or the checkpoint, then its own method.

def random_params(config: Any, mesh, seed: int = 0, *, axis_name: str = "tp",
                  quantize: Optional[str] = None) -> dict:
    """family_of(config).random_params (random weights, never zero; quantize="fp8": FP8)."""
    return family_of(config).random_params(config, mesh, seed, axis_name=axis_name,
                                           quantize=quantize)


def load_hf_checkpoint(path: str, mesh, *, axis_name: str = "tp", config: Any = None,
                       dtype: Optional[str] = None, max_seq_len: Optional[int] = None,
                       quantize: Optional[str] = None) -> tuple[Any, dict]:
    """The checkpoint's family's load_hf_checkpoint (by config.json's model_type)."""
    return family_for_checkpoint(path).load_hf_checkpoint(
        path, mesh, axis_name=axis_name, config=config, dtype=dtype, max_seq_len=max_seq_len,
        quantize=quantize)


def save_hf_checkpoint(params: dict, config: Any, path: str, *, num_shards: int = 1) -> None:
    """family_of(config).save_hf_checkpoint."""
    family_of(config).save_hf_checkpoint(params, config, path, num_shards=num_shards)
