"""The Llama family's Hugging Face loader: HF tensor names and shapes <-> our parameter layout
(the shared stack's readers and writers: weights/hf.py; the MLP's here). LLAMA names this module
as its loader.
"""

from __future__ import annotations

import functools

import numpy as np

from ..weights.checkpoint import Checkpoint
from ..weights.hf import hf_name, host, stack_builders, stack_to_hf
from .config import LlamaConfig


def hf_builders(config: LlamaConfig, ck: Checkpoint, kv_replicas: int = 1) -> dict:
    """For each parameter path, f(lo, hi) -> its local chunk along the TP dim (our layout),
    reading only HF rows/columns [lo, hi) scaled to that tensor (heads, ffn rows, vocab rows).
    `config` is the layout's (LLAMA.layout): with kv_replicas r > 1, layout KV head j is a
    copy of the checkpoint's head j // r."""
    c = config

    def t(a):  # HF [out, in] -> ours [in, out]
        return np.ascontiguousarray(a.T)

    def gate_up(i, lo, hi):  # ffn rows
        gate = t(ck.read(hf_name("mlp.gate_proj", i), 0, lo, hi))
        up = t(ck.read(hf_name("mlp.up_proj", i), 0, lo, hi))
        return np.stack([gate, up], axis=1)

    def down(i, lo, hi):
        return t(ck.read(hf_name("mlp.down_proj", i), 1, lo, hi))

    out = stack_builders(c, ck, kv_replicas)
    for i in range(c.num_layers):
        out["layers"][i]["mlp"] = {"gate_up": functools.partial(gate_up, i),
                                   "down": functools.partial(down, i)}
    return out


def to_hf_tensors(params: dict, config: LlamaConfig) -> dict[str, np.ndarray]:
    """Our (global) parameters -> HF-named numpy tensors. Gathers to the host: for tests and small
    models. Parameters laid out with replicated KV heads (LLAMA.layout) give each head once.
    Dense parameters: LLAMA.to_hf_tensors (or models.to_hf_tensors) takes RowWeight leaves too
    (models.to_rows), as the dense weights they hold."""
    out = stack_to_hf(params, config)
    for i in range(config.num_layers):
        mlp = params["layers"][i]["mlp"]
        gu = host(mlp["gate_up"])  # [H, 2, F]
        out[hf_name("mlp.gate_proj", i)] = gu[:, 0].T
        out[hf_name("mlp.up_proj", i)] = gu[:, 1].T
        out[hf_name("mlp.down_proj", i)] = host(mlp["down"]).T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}
