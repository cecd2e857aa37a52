"""A model family: what the decoder, the loader and the CLI need to know about one architecture.

A family is its config type and presets, its model (a transformer.CausalLM subclass built from
the shared attention and its own blocks), its tensor-parallel split (tp_dims, check_tp), its
random-init fan-ins, its Hugging Face loader module, and optionally a fast one-token step
(fast_step: a FastStep; decoder/step_choice.py decides where it runs). Everything else is
generic and comes from ModelFamily's methods: the tp layout, the abstract model, parameter
shardings, the KV cache, the shard_map'd forward, random parameters, checkpoint loading and
saving. Adding a family: its package (config.py: its config and presets; model.py: its blocks
and the ModelFamily; hf.py: its loader), tests, and a line in registry.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, Optional, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from .core import forward, sharding
from .weights import checkpoint, fp8_load, random as random_weights
from .weights.transforms import check_quantize, from_rows, quantize_one
from .weights.types import Fp8Weight, RowWeight, is_projection


class ModelConfig(Protocol):
    """What the generic code reads from a family's config (a frozen dataclass)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int  # the longest KV cache the decoder may allocate
    dtype: str

    def replace(self, **kw) -> "ModelConfig": ...

    @classmethod
    def from_hf_config(cls, d: dict, *, max_seq_len: Optional[int] = None,
                       dtype: Optional[str] = None) -> "ModelConfig": ...

    def to_hf_config(self) -> dict: ...


class HFLoader(Protocol):
    """A family's loader module: its parameters <-> Hugging Face tensors."""

    def hf_builders(self, layout: Any, ck: checkpoint.Checkpoint, kv_replicas: int) -> dict:
        """Per parameter path of the tp layout `layout`, f(lo, hi) -> its chunk along its tp
        dimension, read from `ck` (see checkpoint.load_sharded)."""

    def to_hf_tensors(self, params: dict, config: Any) -> dict:
        """Global parameters -> HF-named numpy tensors (each replicated KV head once)."""


class FastStep(Protocol):
    """A family's fast one-token step (ModelFamily.fast_step; Llama's: llama/step.py's
    PERSISTENT): a batch's step of one token run some faster way than the model's forward, where
    it can serve the decoder. Which step runs is decided once per decoder, in
    decoder/step_choice.py."""

    name: str  # the DecodeOptions.step value that asks for it ("persistent")

    def reason(self, family: "ModelFamily", layout: "Layout", mesh: Mesh, options: Any,
               params: Any, *, reference: bool = False) -> Optional[str]:
        """None when this step can run a decoder of `layout` on `mesh` with `options` (resolved)
        and `params`, else why not (one sentence). reference: a slow reference of the step (a
        CPU handler) counts as serving it (step="persistent" asks for it by name; "auto"
        never runs it)."""

    def make_forward(self, family: "ModelFamily", layout: "Layout", options: Any, *,
                     mesh: Optional[Mesh] = None, **kw) -> Callable:
        """forward(params, cache, tokens [1, 1], positions [1], ar, start=None) -> (logits,
        cache, ar): the contract of ModelFamily.make_forward's forward, for one token, on
        `mesh` (check `reason` first)."""

    def describe(self, layout: "Layout", mesh: Mesh, options: Any) -> str:
        """How the step runs here, in a few words (the CLI's device line)."""

    def prepare_params(self, family: "ModelFamily", config: Any, mesh: Mesh, options: Any,
                       params: Any) -> Any:
        """params as this step wants them, for callers that own them (e.g. moved to another
        layout in place), or params as they are."""


@functools.lru_cache(maxsize=None)
def _abstract_model(model: Callable[..., nnx.Module], config: Any) -> tuple[nnx.GraphDef, dict]:
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model(config, rngs=nnx.Rngs(0))))
    return graphdef, nnx.to_pure_dict(state)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A model split tp ways, computed once (ModelFamily.layout) and handed to everything that
    lays out its parameters, cache or forward. config: the model's own; shapes: the config whose
    shapes the split uses (sharding.tp_layout: with tp > num_kv_heads each KV head copied
    kv_replicas times)."""

    config: Any
    tp: int
    shapes: Any
    kv_replicas: int

    def check_mesh(self, mesh: Mesh, axis_name: str) -> None:
        if mesh.shape[axis_name] != self.tp:
            raise ValueError(f"a tp={self.tp} layout on a mesh whose {axis_name!r} axis has "
                             f"{mesh.shape[axis_name]} devices")


class _Parameters:
    """ModelFamily's parameters and KV cache (a mixin: the family's tables are its fields)."""

    def abstract_model(self, config: Any) -> tuple[nnx.GraphDef, dict]:
        """(graphdef, pure-dict pytree of ShapeDtypeStruct) without allocating anything."""
        return _abstract_model(self.model, config)

    def param_specs(self, params: dict, axis_name: str = "tp", tp: int = 1) -> dict:
        """PartitionSpec pytree for a parameter pytree (arrays or ShapeDtypeStructs; Fp8Weight
        leaves get Fp8Weights of specs, which depend on the tp size: sharding.fp8_spec)."""
        return sharding.param_specs(params, self.tp_dims, axis_name, self.projections, tp)

    def param_shardings(self, layout: Layout, mesh: Mesh, axis_name: str = "tp",
                        params: Any = None) -> dict:
        """NamedSharding pytree of the parameters of `layout` on `mesh`: of the layout's dense
        parameters, or of `params` (e.g. FP8 ones: arrays or ShapeDtypeStructs, global shapes)."""
        layout.check_mesh(mesh, axis_name)
        if params is None:
            _, params = self.abstract_model(layout.shapes)
        return sharding.param_shardings(params, mesh, self.tp_dims, axis_name, self.projections)

    def place_params(self, params: dict, layout: Layout, mesh: Mesh,
                     axis_name: str = "tp") -> dict:
        """`params` placed as param_shardings says (a no-op for arrays already placed so), or a
        clear error where their shapes are not those of `layout`."""
        _, abstract = self.abstract_model(layout.shapes)
        want = jax.tree.map(lambda a: tuple(a.shape), abstract)
        if self.dense_shapes(params) != want:
            raise ValueError(f"params do not have the shapes of the tp={layout.tp} layout (KV "
                             f"heads replicated when tp > num_kv_heads): make them for this mesh "
                             f"with the family's random_params or load_hf_checkpoint")
        return jax.device_put(params, self.param_shardings(layout, mesh, axis_name, params))

    def init_cache(self, layout: Layout, mesh: Mesh, batch_size: int, max_seq_len: int,
                   axis_name: str = "tp", kv_layout: str = "bshd") -> jax.Array:
        """Zero KV cache, created directly sharded (no host copy): one array of every layer's
        keys and values (sharding.cache_dims). With tp > num_kv_heads each rank holds its copy
        of one KV head."""
        layout.check_mesh(mesh, axis_name)
        return sharding.init_cache(layout.shapes, mesh, batch_size, max_seq_len, axis_name,
                                   kv_layout)

    def random_params(self, config: Any, mesh: Mesh, seed: int = 0, *,
                      axis_name: str = "tp", quantize: Optional[str] = None) -> dict:
        """Random parameters (never zero) created directly sharded on the devices. The values
        depend on (config, seed) only, not on the mesh (see weights/random.py).
        quantize="fp8": each projection quantized per output channel where it lies as soon as
        it is made (weights/transforms.py, quantize_one), the LM head included, so the model is
        never held dense: the peak is the FP8 model plus one weight dense."""
        check_quantize(quantize)
        layout = self.layout(config, mesh.shape[axis_name])
        if quantize is not None:  # a TP the FP8 GEMV cannot take: named before anything is made
            fp8_load.check_local_k(self, layout, mesh, axis_name)
        _, abstract = self.abstract_model(config)
        then = None if quantize is None else (
            lambda name, w: quantize_one(name, w, self, axis_name, donate=True))
        return random_weights.random_params(
            abstract, self.param_shardings(layout, mesh, axis_name), seed, self.fan_in,
            layout.kv_replicas, then)


class _Sizes:
    """ModelFamily's parameter shapes and bytes, dense or FP8 (a mixin: the family's tables are
    its fields)."""

    def dense_shapes(self, params: dict) -> dict:
        """Each parameter's shape, an Fp8Weight's or RowWeight's as its einsum weight's (the
        dense layout)."""
        def shape(path, a):
            if is_projection(a):
                return self.projections[sharding.leaf_name(path)].einsum_shape(a)
            return tuple(a.shape)

        return jax.tree_util.tree_map_with_path(shape, params, is_leaf=is_projection)

    def local_bytes(self, params: dict, tp: int, axis_name: str = "tp") -> dict:
        """Per parameter (arrays or ShapeDtypeStructs, global shapes; an Fp8Weight: its e4m3
        values plus its scales), the bytes one rank of a tp-way layout holds of it."""
        def one(path, a, spec):
            parts = ([(a.q, spec.q), (a.scale, spec.scale)] if isinstance(a, Fp8Weight) else
                     [(a.w, spec.w)] if isinstance(a, RowWeight) else [(a, spec)])
            return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                       // (tp if axis_name in tuple(s) else 1) for x, s in parts)

        return jax.tree_util.tree_map_with_path(one, params, self.param_specs(params, axis_name, tp),
                                                is_leaf=is_projection)

    def step_weight_bytes(self, layout: Layout, params: Any = None) -> int:
        """Parameter bytes one rank reads in a batch-1 decode step (a step's memory floor, beside
        its KV cache): each parameter's local shard of the tp layout (of `params`, e.g. FP8
        ones, else the layout's dense parameters) times the share one token reads
        (step_read_fraction: the routed experts of an MoE), except the embedding table, of
        which a step gathers one row (plus, when tied, its vocab/tp slice as the LM head)."""
        config, tp = layout.config, layout.tp
        if params is None:
            _, params = self.abstract_model(layout.shapes)
        total = 0.0
        for path, n in jax.tree_util.tree_flatten_with_path(self.local_bytes(params, tp))[0]:
            name = sharding.leaf_name(path)
            if name == "embed":
                embed = params["embed"]
                vocab, hidden = embed.shape
                total += hidden * jnp.dtype(embed.dtype).itemsize * (
                    1 + (vocab // tp if config.tie_word_embeddings else 0))
                continue
            fraction = self.step_read_fraction[name](config) if name in self.step_read_fraction else 1
            total += n * fraction
        return int(round(total))


class _HFCheckpoints:
    """ModelFamily's Hugging Face checkpoints (a mixin: `loader` and `config_type` are the
    family's fields)."""

    def config_from_hf(self, d: dict, *, max_seq_len: Optional[int] = None,
                       dtype: Optional[str] = None) -> Any:
        return self.config_type.from_hf_config(d, max_seq_len=max_seq_len, dtype=dtype)

    def load_hf_checkpoint(self, path: str, mesh: Mesh, *, axis_name: str = "tp",
                           config: Any = None, dtype: Optional[str] = None,
                           max_seq_len: Optional[int] = None,
                           quantize: Optional[str] = None) -> tuple[Any, dict]:
        """Read `path`/config.json and its safetensors shards; return (config, params) with
        params sharded onto `mesh` (tp_dims; KV heads replicated when tp > num_kv_heads, see
        layout). `dtype` overrides the checkpoint's dtype (the compute dtype). An FP8
        checkpoint (config.json's quantization_config), or quantize="fp8", loads the
        projections as Fp8Weight leaves (weights/fp8_load.py); config.quantization records the
        layout."""
        hf = checkpoint.read_hf_config(path)
        if config is None:
            config = self.config_from_hf(hf, max_seq_len=max_seq_len, dtype=dtype)
        elif dtype is not None:
            config = config.replace(dtype=dtype)
        layout = self.layout(config, mesh.shape[axis_name])
        if quantize is not None or "quantization_config" in hf:
            return fp8_load.load_fp8(self, path, mesh, layout, axis_name, quantize)
        _, abstract = self.abstract_model(layout.shapes)
        params = checkpoint.load_sharded(
            path, abstract, self.param_shardings(layout, mesh, axis_name), self.tp_dims,
            lambda ck: self.loader.hf_builders(layout.shapes, ck, layout.kv_replicas),
            expected=self.hf_shapes(layout))
        return config, params

    def hf_shapes(self, layout: Layout) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> shape, of a checkpoint of layout.config as save_hf_checkpoint
        writes it (dense, each KV head once; the loader checks a checkpoint's against it before
        reading): nothing allocated."""
        _, abstract = self.abstract_model(layout.shapes)
        return checkpoint.hf_shapes(self.loader.to_hf_tensors, abstract, layout.config)

    def to_hf_tensors(self, params: dict, config: Any) -> dict:
        """Our (global) parameters -> HF-named numpy tensors (RowWeight leaves as the dense
        weights they hold). Gathers to the host: for tests and small models."""
        return self.loader.to_hf_tensors(from_rows(params, self), config)

    def save_hf_checkpoint(self, params: dict, config: Any, path: str, *,
                           num_shards: int = 1) -> None:
        """Write config.json and model.safetensors (or num_shards files plus
        model.safetensors.index.json) in Hugging Face's layout: Fp8Weight leaves in the layout
        they came from (fp8_to_hf), RowWeight leaves as the dense weights they hold."""
        tensors, qc = fp8_load.fp8_to_hf(self, from_rows(params, self), config)
        hf = config.to_hf_config()
        if qc is not None:
            hf["quantization_config"] = qc
        checkpoint.save(tensors, hf, path, num_shards=num_shards)


@dataclasses.dataclass(frozen=True, eq=False)
class ModelFamily(_Parameters, _Sizes, _HFCheckpoints):
    name: str
    config_type: type  # a ModelConfig
    presets: Mapping[str, Callable[..., Any]]  # preset name -> f(**overrides) -> config
    model: Callable[..., nnx.Module]  # model(config, rngs=...): global shapes, per-rank __call__
    tp_dims: Mapping[str, int]  # parameter name -> the dimension split over tp (else replicated)
    check_tp: Callable[[Any, int], None]  # raises ValueError unless tp splits the model
    fan_in: Mapping[str, Callable[[tuple], int]]  # linear weights' fan-in, for random init
    loader: HFLoader  # the family's Hugging Face loader module (hf_builders, to_hf_tensors)
    hf_model_types: tuple[str, ...] = ()  # config.json "model_type" values this family reads
    # parameter name -> f(config) -> the share of it one token's step reads (else all of it): an
    # MoE's experts, top-k of them (step_weight_bytes)
    step_read_fraction: Mapping[str, Callable[[Any], float]] = dataclasses.field(
        default_factory=dict)
    # parameter name -> weights.types.Projection: the weights an FP8 model holds as Fp8Weight,
    # and how many dims each contracts (weights/transforms.py, sharding.fp8_spec)
    projections: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # the family's fast one-token step, if it has one (decoder/step_choice.py runs it where
    # DecodeOptions.step names it, or is "auto", and its reason() allows)
    fast_step: Optional[FastStep] = None

    # ---- configs -------------------------------------------------------------------------------

    def preset(self, name: str, **overrides) -> Any:
        if name not in self.presets:
            raise ValueError(f"{self.name} has no preset {name!r}; choose from {sorted(self.presets)}")
        return self.presets[name](**overrides)

    def layout(self, config: Any, tp: int) -> Layout:
        """The model split tp ways (Layout); raises if tp does not split the model."""
        self.check_tp(config, tp)
        return Layout(config, tp, sharding.tp_layout(config, tp), sharding.kv_replicas(config, tp))

    # ---- the forward -------------------------------------------------------------------------------

    def make_forward(self, layout: Layout, mesh: Mesh, options: Any = None, *,
                     last_only: bool = False, attend_len: Optional[int] = None,
                     ar_specs: Any = None, params: Any = None, step: Optional[Callable] = None):
        """The TP forward of `layout` on `mesh`, ready for jax.jit (core/forward.make_forward;
        params: the parameter tree when it is not the layout's dense one, e.g. FP8; step: the
        one-token forward of a fast step, decoder/step_choice.StepChoice.forward())."""
        return forward.make_forward(self, layout, mesh, options, last_only=last_only,
                                    attend_len=attend_len, ar_specs=ar_specs, params=params,
                                    step=step)
