"""What every family's config shares: the Llama 3 rotary scaling (RopeScaling) and its reading
from a Hugging Face config.json (rope_from_hf), and the GQA geometry checks (AttentionConfig, a
mixin of each family's frozen config dataclass)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 ("llama3" rope_type) frequency scaling."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_from_hf(d: dict[str, Any], default_theta: float = 10000.0
                 ) -> tuple[float, Optional[RopeScaling]]:
    """(rope_theta, Llama 3 scaling or None) from a Hugging Face config.json: transformers 4.x
    `rope_theta` + `rope_scaling`, or 5.x `rope_parameters`. Other rope types are refused."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = d.get("rope_theta", rope.get("rope_theta", default_theta))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    elif rope_type in ("default", None):
        scaling = None
    else:
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported (only llama3/default)")
    return float(theta), scaling


class AttentionConfig:
    """What every family's config shares (a mixin of its frozen dataclass): the GQA geometry
    checks, group_size and replace."""

    def check_attention(self) -> None:
        """Normalise rope_scaling and check the heads; call from __post_init__."""
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not divisible by num_kv_heads "
                             f"{self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)
