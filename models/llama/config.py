"""Llama 3.x hyper-parameters: presets and Hugging Face `config.json` parsing."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ..core.config import AttentionConfig, RopeScaling, rope_from_hf


@dataclasses.dataclass(frozen=True)
class LlamaConfig(AttentionConfig):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: Optional[int] = None  # None: hidden_size // num_heads
    rope_theta: float = 500000.0
    rope_scaling: Optional[RopeScaling] = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # Length of the KV cache the decoder allocates (not the model's trained context, which for
    # Llama 3.1 is 131072: a cache that long would cost 17 GB at 8B shapes).
    max_seq_len: int = 8192
    dtype: str = "bfloat16"  # parameters and activations
    # The FP8 layout the projections were loaded in (fp8_checkpoint.Fp8Scheme.spec, e.g.
    # "compressed-tensors:channel"; None: not FP8), which save_hf_checkpoint writes back.
    quantization: Optional[str] = None

    def __post_init__(self):
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        self.check_attention()

    # ---- presets -------------------------------------------------------------------------------

    @classmethod
    def llama3_8b(cls, **kw) -> "LlamaConfig":
        """Llama-3.1-8B shapes (untied, Llama 3.1 rope scaling)."""
        base = dict(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
            num_heads=32, num_kv_heads=8, rope_theta=500000.0,
            rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), rms_norm_eps=1e-5,
            tie_word_embeddings=False, max_seq_len=8192, dtype="bfloat16")
        base.update(kw)
        return cls(**base)

    @classmethod
    def tiny(cls, **kw) -> "LlamaConfig":
        """Test model: 4 KV heads so TP=1, 2 and 4 all split it (GQA group 2, head_dim 16).
        original_max_position_embeddings is small so that all three regimes of the Llama 3 rope
        scaling (unchanged, smoothed, divided by factor) occur."""
        base = dict(
            vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
            num_heads=8, num_kv_heads=4, rope_theta=10000.0,
            rope_scaling=RopeScaling(4.0, 1.0, 4.0, 64), rms_norm_eps=1e-5,
            tie_word_embeddings=False, max_seq_len=128, dtype="float32")
        base.update(kw)
        return cls(**base)

    @classmethod
    def llama_step_tiny(cls, **kw) -> "LlamaConfig":
        """A small model the persistent step serves (bf16, head_dim 128, GQA group 2, FFN and
        vocabulary split by 4), so that its CPU reference runs it in tests and on host devices
        (models.generate --step persistent) at TP = 1, 2 and 4."""
        base = dict(
            vocab_size=1024, hidden_size=512, intermediate_size=1024, num_layers=2,
            num_heads=8, num_kv_heads=4, head_dim=128, rope_theta=10000.0,
            rope_scaling=RopeScaling(4.0, 1.0, 4.0, 64), rms_norm_eps=1e-5,
            tie_word_embeddings=False, max_seq_len=512, dtype="bfloat16")
        base.update(kw)
        return cls(**base)

    # ---- Hugging Face --------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, d: dict[str, Any], *, max_seq_len: Optional[int] = None,
                       dtype: Optional[str] = None) -> "LlamaConfig":
        """A Hugging Face config.json read (llama_from_hf)."""
        return llama_from_hf(cls, d, max_seq_len=max_seq_len, dtype=dtype)

    def to_hf_config(self) -> dict[str, Any]:
        """The inverse of from_hf_config (llama_to_hf)."""
        return llama_to_hf(self)


def llama_from_hf(cls, d: dict[str, Any], *, max_seq_len: Optional[int] = None,
                  dtype: Optional[str] = None) -> "LlamaConfig":
    """Read a Hugging Face Llama `config.json` (transformers 4.x `rope_scaling` or 5.x
    `rope_parameters`). max_seq_len defaults to min(max_position_embeddings, 8192)."""
    theta, scaling = rope_from_hf(d)
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise NotImplementedError("attention/MLP biases are not supported")
    n_heads = d["num_attention_heads"]
    max_pos = d.get("max_position_embeddings", 8192)
    hf_dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
    return cls(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
        num_heads=n_heads, num_kv_heads=d.get("num_key_value_heads", n_heads),
        head_dim=d.get("head_dim"), rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_seq_len=max_seq_len or min(max_pos, 8192),
        dtype=dtype or str(hf_dtype))


def llama_to_hf(config) -> dict[str, Any]:
    """The inverse of from_hf_config (transformers 4.x key names)."""
    d: dict[str, Any] = dict(
        architectures=["LlamaForCausalLM"], model_type="llama",
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=config.max_seq_len, torch_dtype=config.dtype,
        hidden_act="silu", attention_bias=False, mlp_bias=False)
    if config.rope_scaling is not None:
        d["rope_scaling"] = dict(rope_type="llama3", **dataclasses.asdict(config.rope_scaling))
    return d
