"""The model families the decoder and the CLI know, and how to find one: by config, by preset
name, or by a Hugging Face checkpoint's config.json; and the models.<name> functions that find
the family themselves (from a config, or a checkpoint) before running the family's own. A new
family adds one entry to FAMILIES."""

from __future__ import annotations

from typing import Any, Optional

from .family import ModelFamily
from .llama import LLAMA
from .qwen3_moe import QWEN3_MOE
from .weights import transforms
from .weights.checkpoint import read_hf_config

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


def _family(family_or_config: Any) -> ModelFamily:
    """A ModelFamily as it is, else the family of a config (family_of)."""
    return family_or_config if isinstance(family_or_config, ModelFamily) else family_of(
        family_or_config)


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


def to_hf_tensors(params: dict, config: Any) -> dict:
    """family_of(config).to_hf_tensors: our (global) parameters -> HF-named numpy tensors
    (RowWeight leaves as the dense weights they hold)."""
    return family_of(config).to_hf_tensors(params, config)


# The transforms of weights/transforms.py, given a family or a config (its family_of).

def quantize_params(params: dict, family_or_config: Any, *, lm_head: bool = True,
                    axis_name: str = "tp", donate: bool = False) -> dict:
    """weights.transforms.quantize_params: the family's projections as Fp8Weight per output
    channel."""
    return transforms.quantize_params(params, _family(family_or_config), lm_head=lm_head,
                                      axis_name=axis_name, donate=donate)


def dequantize_params(params: dict, family_or_config: Any, dtype: Any = None,
                      axis_name: str = "tp") -> dict:
    """weights.transforms.dequantize_params: every Fp8Weight back to its einsum-layout weight as
    dtype (default: the config's dtype when a config is given, else bfloat16)."""
    dtype = dtype or getattr(family_or_config, "dtype", None)
    return transforms.dequantize_params(params, _family(family_or_config), dtype, axis_name)


def to_rows(params: dict, family_or_config: Any, *, axis_name: str = "tp",
            donate: bool = False) -> dict:
    """weights.transforms.to_rows: a family's projections (an MoE's expert stacks too), the LM
    head included, as RowWeight (the [N, K] rows the persistent step streams; the XLA step
    reads them too)."""
    return transforms.to_rows(params, _family(family_or_config), axis_name=axis_name,
                              donate=donate)


def from_rows(params: dict, family_or_config: Any, axis_name: str = "tp") -> dict:
    """weights.transforms.from_rows: every RowWeight back to its einsum-layout weight."""
    return transforms.from_rows(params, _family(family_or_config), axis_name)
