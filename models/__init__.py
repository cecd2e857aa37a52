"""Flax NNX decoders with tensor parallelism over a shard_map axis, one package per model family
(Llama 3.x: llama/; Qwen3-MoE: qwen3_moe/; registry.py lists them) on the shared decoder core
(core/: attention, sharding, tensor-parallel helpers) and weights (weights/: types, transforms,
checkpoints), run by the decoder (decoder/) and the command line (generate/:
`python -m models.generate`). family.py: what a family is (ModelFamily); registry.py: the
families there are, and the models.<name> functions that find a config's family.

Submodules import jax; this package file does not, so `python -m models.generate` can still set
XLA_FLAGS before jax starts. Public names are loaded on first access.
"""

_EXPORTS = {  # public name -> the module (under models) that defines it
    # the families
    "LlamaConfig": "llama", "Llama": "llama", "LLAMA": "llama", "check_tp": "llama",
    "Qwen3MoeConfig": "qwen3_moe", "QWEN3_MOE": "qwen3_moe",
    "ModelFamily": "family", "Layout": "family", "FastStep": "family",
    "CheckpointError": "weights.checkpoint",
    # finding a family (by config, preset or checkpoint) and running its own method
    "FAMILIES": "registry", "family_of": "registry", "presets": "registry", "preset": "registry",
    "family_for_checkpoint": "registry",
    "random_params": "registry", "load_hf_checkpoint": "registry",
    "save_hf_checkpoint": "registry", "to_hf_tensors": "registry",
    "to_rows": "registry", "from_rows": "registry", "quantize_params": "registry",
    "dequantize_params": "registry",
    # the shared core
    "RopeScaling": "core.config", "make_allreduce": "core.tp",
    # the decoder
    "Decoder": "decoder.decoder", "make_mesh": "decoder.decoder", "LOOPS": "decoder.loops",
    "Sampling": "decoder.sampling", "DecodeOptions": "decoder.options",
    "SIFAR_KINDS": "decoder.options", "StepChoice": "decoder.step_choice",
}

__all__ = sorted(_EXPORTS)


def __dir__():  # the lazily loaded names too (tab completion, dir(models))
    return sorted(set(globals()) | set(__all__))


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
