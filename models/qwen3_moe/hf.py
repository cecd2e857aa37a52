"""The Qwen3-MoE family's Hugging Face loader: HF tensor names and shapes <-> our parameter layout
(model.py), on the generic machinery of weights/checkpoint.py and the stack's readers and writers
of weights/hf.py. QWEN3_MOE names this module as its loader.

Experts are read in either layout a checkpoint may have:
  per expert (what Qwen's checkpoints and transformers' save_pretrained write):
    model.layers.{i}.mlp.experts.{j}.{gate,up}_proj.weight  [I, hidden]
    model.layers.{i}.mlp.experts.{j}.down_proj.weight       [hidden, I]
  fused (transformers 5's in-memory Qwen3MoeExperts, e.g. a state_dict saved as is):
    model.layers.{i}.mlp.experts.gate_up_proj  [E, 2 I, hidden]  (gate rows, then up rows)
    model.layers.{i}.mlp.experts.down_proj     [E, hidden, I]
The router is model.layers.{i}.mlp.gate.weight [E, hidden]. Each device reads only its slice of
every expert's intermediate dimension.
"""

from __future__ import annotations

import functools

import numpy as np

from ..weights.checkpoint import Checkpoint
from ..weights.hf import hf_name, host, stack_builders, stack_to_hf
from .config import Qwen3MoeConfig


def expert_name(i: int, j: int, proj: str) -> str:
    """HF name of expert j's `proj` (gate_proj, up_proj, down_proj) in layer i."""
    return hf_name(f"mlp.experts.{j}.{proj}", i)


def fused_name(i: int, proj: str) -> str:
    """HF name of layer i's fused expert tensor `proj` (gate_up_proj, down_proj)."""
    return f"model.layers.{i}.mlp.experts.{proj}"


def hf_builders(config: Qwen3MoeConfig, ck: Checkpoint, kv_replicas: int = 1) -> dict:
    """For each parameter path, f(lo, hi) -> its local chunk along its TP dim (our layout; see
    llama/hf.py's hf_builders). Expert tensors: lo, hi index the expert intermediate dimension."""
    c = config
    E, width = c.num_experts, c.moe_intermediate_size

    def t(a):  # HF [out, in] -> ours [in, out]
        return np.ascontiguousarray(a.T)

    def gate_up(i, lo, hi):  # -> [E, hidden, 2, hi - lo]
        if fused_name(i, "gate_up_proj") in ck:
            name = fused_name(i, "gate_up_proj")
            gate, up = ck.read(name, 1, lo, hi), ck.read(name, 1, width + lo, width + hi)
            return np.stack([gate, up], axis=1).transpose(0, 3, 1, 2)  # [E, 2, n, H] -> ours
        return np.stack([np.stack([t(ck.read(expert_name(i, j, "gate_proj"), 0, lo, hi)),
                                   t(ck.read(expert_name(i, j, "up_proj"), 0, lo, hi))], axis=1)
                         for j in range(E)])

    def down(i, lo, hi):  # -> [E, hi - lo, hidden]
        if fused_name(i, "down_proj") in ck:
            return np.ascontiguousarray(ck.read(fused_name(i, "down_proj"), 2, lo, hi)
                                        .transpose(0, 2, 1))
        return np.stack([t(ck.read(expert_name(i, j, "down_proj"), 1, lo, hi)) for j in range(E)])

    def router(i, lo, hi):  # replicated
        return t(ck.read(hf_name("mlp.gate", i)))

    out = stack_builders(c, ck, kv_replicas, qk_norm=True)
    for i in range(c.num_layers):
        out["layers"][i]["moe"] = {"router": functools.partial(router, i),
                                   "gate_up": functools.partial(gate_up, i),
                                   "down": functools.partial(down, i)}
    return out


def to_hf_tensors(params: dict, config: Qwen3MoeConfig, *, fused_experts: bool = False
                  ) -> dict[str, np.ndarray]:
    """Our (global) parameters -> HF-named numpy tensors, experts one tensor each (or, with
    fused_experts, transformers 5's fused layout). Gathers to the host: for tests and small
    models."""
    c = config
    out = stack_to_hf(params, c)
    for i in range(c.num_layers):
        p = params["layers"][i]
        out[hf_name("mlp.gate", i)] = host(p["moe"]["router"]).T
        gu = host(p["moe"]["gate_up"])  # [E, H, 2, I]
        dn = host(p["moe"]["down"])  # [E, I, H]
        if fused_experts:
            out[fused_name(i, "gate_up_proj")] = np.concatenate(
                [gu[:, :, 0].transpose(0, 2, 1), gu[:, :, 1].transpose(0, 2, 1)], axis=1)
            out[fused_name(i, "down_proj")] = dn.transpose(0, 2, 1)
            continue
        for j in range(c.num_experts):
            out[expert_name(i, j, "gate_proj")] = gu[j, :, 0].T
            out[expert_name(i, j, "up_proj")] = gu[j, :, 1].T
            out[expert_name(i, j, "down_proj")] = dn[j].T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}
