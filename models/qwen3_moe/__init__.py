"""The Qwen3-MoE family:

    config.py  Qwen3MoeConfig, its presets and its Hugging Face config.json; MOE_IMPLS
    model.py   the router and experts, the MoE block, the tensor-parallel split, QWEN3_MOE
    hf.py      the Hugging Face loader: tensor names and shapes (per-expert or fused) <-> ours
    step.py    the persistent decode step, QWEN3_MOE's fast_step (PERSISTENT)
"""

from .config import MOE_IMPLS, Qwen3MoeConfig
from .model import QWEN3_MOE

__all__ = ["MOE_IMPLS", "QWEN3_MOE", "Qwen3MoeConfig"]
