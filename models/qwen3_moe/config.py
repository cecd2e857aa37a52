"""Qwen3-MoE hyper-parameters: presets and Hugging Face `config.json` parsing (what this decoder
does not implement is refused there)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ..core.config import AttentionConfig, RopeScaling, rope_from_hf

MOE_IMPLS = ("gather", "matvec")


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(AttentionConfig):
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int  # top-k
    moe_intermediate_size: int  # each expert's FFN width
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to 1
    rope_theta: float = 1000000.0
    rope_scaling: Optional[RopeScaling] = None  # Llama 3 scaling, only if a checkpoint asks
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_seq_len: int = 8192  # the longest KV cache the decoder may allocate
    dtype: str = "bfloat16"
    # The FP8 layout the projections were loaded in (fp8_checkpoint.Fp8Scheme.spec, e.g.
    # "compressed-tensors:channel"; None: not FP8), which save_hf_checkpoint writes back.
    quantization: Optional[str] = None
    moe_impl: str = "matvec"  # MOE_IMPLS: how the chosen experts are computed

    def __post_init__(self):
        self.check_attention()
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"[1, num_experts={self.num_experts}]")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {self.moe_impl!r}")

    # ---- presets -------------------------------------------------------------------------------

    @classmethod
    def qwen3_30b_a3b(cls, **kw) -> "Qwen3MoeConfig":
        """Qwen3-30B-A3B shapes: 30.5B parameters, 3.3B active per token (61 GB in bf16)."""
        base = dict(
            vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
            head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
            norm_topk_prob=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=False, max_seq_len=8192, dtype="bfloat16")
        base.update(kw)
        return cls(**base)

    @classmethod
    def tiny(cls, **kw) -> "Qwen3MoeConfig":
        """Test model: 2 KV heads (TP=4 replicates each on 2 ranks), 8 experts, top-2, expert
        width 32 (split 4 ways at TP=4), float32."""
        base = dict(
            vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, rope_theta=10000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=False, max_seq_len=128, dtype="float32")
        base.update(kw)
        return cls(**base)

    @classmethod
    def qwen3_moe_step_tiny(cls, **kw) -> "Qwen3MoeConfig":
        """A small model the persistent step serves (bf16, head_dim 128, GQA group 2, 8 experts,
        top-2), so that its CPU reference runs it in tests and on host devices
        (models.generate --quantize fp8 --step persistent) at TP = 1."""
        base = dict(
            vocab_size=512, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
            norm_topk_prob=True, rope_theta=10000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=False, max_seq_len=256, dtype="bfloat16")
        base.update(kw)
        return cls(**base)

    # ---- Hugging Face --------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, d: dict[str, Any], *, max_seq_len: Optional[int] = None,
                       dtype: Optional[str] = None) -> "Qwen3MoeConfig":
        """A Hugging Face config.json read (qwen3_moe_from_hf)."""
        return qwen3_moe_from_hf(cls, d, max_seq_len=max_seq_len, dtype=dtype)

    def to_hf_config(self) -> dict[str, Any]:
        """The inverse of from_hf_config (qwen3_moe_to_hf)."""
        return qwen3_moe_to_hf(self)


def qwen3_moe_from_hf(cls, d: dict[str, Any], *, max_seq_len: Optional[int] = None,
                      dtype: Optional[str] = None) -> "Qwen3MoeConfig":
    """Read a Hugging Face Qwen3-MoE `config.json` (transformers 4.x or 5.x names). Refuses
    what this decoder does not implement: dense layers among the sparse ones, a shared
    expert, sliding-window attention, biases, activations other than SiLU."""
    model_type = d.get("model_type")
    if model_type != "qwen3_moe":
        raise NotImplementedError(f"model_type {model_type!r} is not qwen3_moe")
    experts = d.get("num_experts", d.get("num_local_experts"))
    if not experts:
        raise NotImplementedError("num_experts is 0 or missing: a dense model, not an MoE")
    step = d.get("decoder_sparse_step", 1)
    if step != 1:
        raise NotImplementedError(f"decoder_sparse_step={step}: only all-sparse models "
                                  f"(decoder_sparse_step=1) are supported")
    if d.get("mlp_only_layers"):
        raise NotImplementedError(f"mlp_only_layers={d['mlp_only_layers']}: dense layers "
                                  f"are not supported (every layer must be sparse)")
    if d.get("shared_expert_intermediate_size"):
        raise NotImplementedError("a shared expert (shared_expert_intermediate_size) is not "
                                  "supported")
    if d.get("use_sliding_window"):
        raise NotImplementedError("sliding-window attention (use_sliding_window) is not "
                                  "supported")
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise NotImplementedError("attention/MLP biases are not supported")
    if d.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act={d['hidden_act']!r}: only silu is supported")
    theta, scaling = rope_from_hf(d)
    n_heads = d["num_attention_heads"]
    max_pos = d.get("max_position_embeddings", 8192)
    hf_dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
    return cls(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        num_layers=d["num_hidden_layers"], num_heads=n_heads,
        num_kv_heads=d.get("num_key_value_heads", n_heads),
        head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
        num_experts=int(experts), num_experts_per_tok=d["num_experts_per_tok"],
        moe_intermediate_size=d["moe_intermediate_size"],
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_seq_len=max_seq_len or min(max_pos, 8192), dtype=dtype or str(hf_dtype))


def qwen3_moe_to_hf(config) -> dict[str, Any]:
    """The inverse of from_hf_config (transformers 4.x key names, which 5.x also reads)."""
    d: dict[str, Any] = dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
        num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
        decoder_sparse_step=1, mlp_only_layers=[], rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=config.max_seq_len, torch_dtype=config.dtype, hidden_act="silu",
        attention_bias=False, use_sliding_window=False)
    if config.rope_scaling is not None:
        d["rope_scaling"] = dict(rope_type="llama3", **dataclasses.asdict(config.rope_scaling))
    return d
