"""Flax NNX Llama 3.x decoder with tensor parallelism over a shard_map axis.

Submodules import jax; this package file does not, so `python -m models.generate` can still set
XLA_FLAGS before jax starts. Public names are loaded on first access.
"""

_EXPORTS = {
    "LlamaConfig": "config", "RopeScaling": "config",
    "Llama": "llama", "make_allreduce": "tp", "make_forward": "llama", "check_tp": "llama",
    "param_specs": "llama", "param_shardings": "llama", "init_cache": "llama",
    "load_hf_checkpoint": "weights", "save_hf_checkpoint": "weights", "random_params": "weights",
    "to_hf_tensors": "weights",
    "Decoder": "decode", "make_mesh": "decode", "LOOPS": "decode", "Sampling": "sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
