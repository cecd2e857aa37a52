"""The Llama 3.x family:

    config.py  LlamaConfig, its presets and its Hugging Face config.json
    model.py   the MLP and block, the tensor-parallel split, LLAMA (the ModelFamily)
    hf.py      the Hugging Face loader: tensor names and shapes <-> our parameters
    step.py    the persistent decode step, LLAMA's fast_step (PERSISTENT)
"""

from .config import LlamaConfig
from .model import LLAMA, Llama, check_tp

__all__ = ["LLAMA", "Llama", "LlamaConfig", "check_tp"]
