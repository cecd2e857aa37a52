"""Parameters: Hugging Face safetensors checkpoints <-> the sharded TP layout; random init.

Loading reads, for each device, only the rows/columns of each HF tensor that its shard needs
(safetensors slices are memory-mapped) and places them with jax.make_array_from_callback, so the
full model is never assembled on the host or on one device. HF stores linear weights as
[out_features, in_features] and uses the rotate_half rotary convention, which llama.py follows,
so no q/k permutation is needed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from . import llama, sharding
from .config import LlamaConfig

INDEX_FILE = "model.safetensors.index.json"


def _hf(name: str, i: Optional[int] = None) -> str:
    return f"model.layers.{i}.{name}.weight" if i is not None else name


class _Checkpoint:
    """Name -> slice reader over one or several safetensors files."""

    def __init__(self, path: str, stack: contextlib.ExitStack):
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors in {path}")
            weight_map = {}
            for fn in files:
                with safe_open(os.path.join(path, fn), framework="np") as f:
                    weight_map.update({k: fn for k in f.keys()})
        self._files = {fn: stack.enter_context(safe_open(os.path.join(path, fn), framework="np"))
                       for fn in sorted(set(weight_map.values()))}
        self._map = weight_map

    def __contains__(self, name: str) -> bool:
        return name in self._map

    def read(self, name: str, dim: int = 0, lo: Optional[int] = None, hi: Optional[int] = None):
        """tensor[lo:hi] along dim (all of it if lo is None), as numpy."""
        if name not in self._map:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        sl = self._files[self._map[name]].get_slice(name)
        if lo is None:
            return sl[:]
        return sl[lo:hi] if dim == 0 else sl[:, lo:hi]


def _builders(config: LlamaConfig, ck: _Checkpoint, kv_replicas: int = 1) -> dict:
    """For each parameter path, f(lo, hi) -> its local chunk along the TP dim (our layout),
    reading only HF rows/columns [lo, hi) scaled to that tensor (heads, ffn rows, vocab rows).
    `config` is the layout's (llama.tp_layout): with kv_replicas r > 1, layout KV head j is a
    copy of the checkpoint's head j // r."""
    c = config
    H, d, g = c.hidden_size, c.head_dim, c.group_size

    def t(a):  # HF [out, in] -> ours [in, out]
        return np.ascontiguousarray(a.T)

    def kv_rows(name, lo, hi):  # layout heads [lo, hi) -> [H, hi - lo, 1, d]
        heads = np.arange(lo, hi) // kv_replicas
        a = t(ck.read(name, 0, heads[0] * d, (heads[-1] + 1) * d)).reshape(H, -1, d)
        return a[:, heads - heads[0], None, :]

    def qkv(i, lo, hi):  # lo, hi: kv heads of the layout
        n = hi - lo
        q = t(ck.read(_hf("self_attn.q_proj", i), 0, lo * g * d, hi * g * d)).reshape(H, n, g, d)
        k = kv_rows(_hf("self_attn.k_proj", i), lo, hi)
        v = kv_rows(_hf("self_attn.v_proj", i), lo, hi)
        return np.concatenate([q, k, v], axis=2)

    def o(i, lo, hi):  # heads
        return t(ck.read(_hf("self_attn.o_proj", i), 1, lo * d, hi * d)).reshape(hi - lo, d, H)

    def gate_up(i, lo, hi):  # ffn rows
        gate = t(ck.read(_hf("mlp.gate_proj", i), 0, lo, hi))
        up = t(ck.read(_hf("mlp.up_proj", i), 0, lo, hi))
        return np.stack([gate, up], axis=1)

    def down(i, lo, hi):
        return t(ck.read(_hf("mlp.down_proj", i), 1, lo, hi))

    def full(name):
        return lambda lo, hi: ck.read(name)

    out = {"embed": full("model.embed_tokens.weight"), "norm": {"weight": full("model.norm.weight")},
           "layers": {}}
    if not config.tie_word_embeddings:
        out["lm_head"] = lambda lo, hi: t(ck.read("lm_head.weight", 0, lo, hi))
    for i in range(c.num_layers):
        out["layers"][i] = {
            "input_norm": {"weight": full(_hf("input_layernorm", i))},
            "post_norm": {"weight": full(_hf("post_attention_layernorm", i))},
            "attn": {"qkv": functools.partial(qkv, i), "o": functools.partial(o, i)},
            "mlp": {"gate_up": functools.partial(gate_up, i), "down": functools.partial(down, i)},
        }
    return out


def load_hf_checkpoint(path: str, mesh: Mesh, *, axis_name: str = "tp",
                       config: Optional[LlamaConfig] = None, dtype: Optional[str] = None,
                       max_seq_len: Optional[int] = None) -> tuple[LlamaConfig, dict]:
    """Read `path`/config.json and its safetensors shards; return (config, params) with params
    sharded onto `mesh` (see llama.TP_DIM; KV heads replicated when tp > num_kv_heads, see
    llama.tp_layout). `dtype` overrides the checkpoint's dtype."""
    if config is None:
        with open(os.path.join(path, "config.json")) as f:
            config = LlamaConfig.from_hf_config(json.load(f), max_seq_len=max_seq_len, dtype=dtype)
    elif dtype is not None:
        config = config.replace(dtype=dtype)
    tp = mesh.shape[axis_name]
    layout = llama.tp_layout(config, tp)
    _, abstract = llama.abstract_model(layout)
    shardings = llama.param_shardings(config, mesh, axis_name)

    with contextlib.ExitStack() as stack:
        ck = _Checkpoint(path, stack)
        builders = _builders(layout, ck, sharding.kv_replicas(config, tp))

        def place(path_, sds, sharding, build: Callable):
            name = str(getattr(path_[-1], "key", path_[-1]))
            dim = llama.TP_DIM.get(name)
            chunks: dict = {}  # a replicated tensor is read once, not once per device

            def callback(index):
                if dim is None:
                    lo, hi = 0, sds.shape[0]
                else:
                    lo, hi, _ = index[dim].indices(sds.shape[dim])
                if (lo, hi) not in chunks:
                    a = np.asarray(build(lo, hi)).astype(sds.dtype)
                    want = list(sds.shape)
                    if dim is not None:
                        want[dim] = hi - lo
                    if a.shape != tuple(want):
                        raise ValueError(f"{jax.tree_util.keystr(path_)}: checkpoint gives shape "
                                         f"{a.shape}, expected {tuple(want)}")
                    chunks[(lo, hi)] = a
                return chunks[(lo, hi)]

            return jax.make_array_from_callback(sds.shape, sharding, callback)

        params = jax.tree_util.tree_map_with_path(place, abstract, shardings, builders)
    return config, params


def to_hf_tensors(params: dict, config: LlamaConfig) -> dict[str, np.ndarray]:
    """Our (global) parameters -> HF-named numpy tensors. Gathers to the host: for tests and small
    models. Parameters laid out with replicated KV heads (llama.tp_layout) give each head once."""
    c = config
    H, d = c.hidden_size, c.head_dim
    get = lambda a: np.asarray(jax.device_get(a))
    out = {"model.embed_tokens.weight": get(params["embed"]),
           "model.norm.weight": get(params["norm"]["weight"])}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = get(params["lm_head"]).T
    for i in range(c.num_layers):
        p = params["layers"][i]
        qkv = get(p["attn"]["qkv"])  # [H, kv * r, g / r + 2, d]
        r, g = qkv.shape[1] // c.num_kv_heads, qkv.shape[2] - 2
        out[_hf("self_attn.q_proj", i)] = qkv[:, :, :g].reshape(H, c.num_heads * d).T
        out[_hf("self_attn.k_proj", i)] = qkv[:, ::r, g].reshape(H, c.num_kv_heads * d).T
        out[_hf("self_attn.v_proj", i)] = qkv[:, ::r, g + 1].reshape(H, c.num_kv_heads * d).T
        out[_hf("self_attn.o_proj", i)] = get(p["attn"]["o"]).reshape(c.num_heads * d, H).T
        gu = get(p["mlp"]["gate_up"])  # [H, 2, F]
        out[_hf("mlp.gate_proj", i)] = gu[:, 0].T
        out[_hf("mlp.up_proj", i)] = gu[:, 1].T
        out[_hf("mlp.down_proj", i)] = get(p["mlp"]["down"]).T
        out[_hf("input_layernorm", i)] = get(p["input_norm"]["weight"])
        out[_hf("post_attention_layernorm", i)] = get(p["post_norm"]["weight"])
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_hf_checkpoint(params: dict, config: LlamaConfig, path: str, *, num_shards: int = 1) -> None:
    """Write config.json and model.safetensors (or num_shards files plus
    model.safetensors.index.json) in Hugging Face's layout."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_hf_config(), f, indent=2)
    tensors = to_hf_tensors(params, config)
    if num_shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    groups = [names[k::num_shards] for k in range(num_shards)]
    weight_map = {}
    for k, group in enumerate(groups):
        fn = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, os.path.join(path, fn), metadata={"format": "pt"})
        weight_map.update({n: fn for n in group})
    total = sum(a.nbytes for a in tensors.values())
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def mix32(x: int) -> int:
    """murmur3 finaliser on a Python int (host side: derives per-tensor salts)."""
    x &= 0xFFFFFFFF
    for m in (0x85EBCA6B, 0xC2B2AE35):
        x = ((x ^ (x >> 16)) * m) & 0xFFFFFFFF
    return x ^ (x >> 16)


def hash_uniform(shape, salt: int) -> jax.Array:
    """Uniform in (-1, 1), never 0, as a hash of each element's global index. Elementwise on an
    iota, so under jit with out_shardings every device computes only its own shard, the values do
    not depend on the sharding (same model at every TP size), and it compiles in well under a
    second (threefry over dozens of distinct shapes took seconds on XLA:CPU)."""
    idx = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for ax in reversed(range(len(shape))):  # row-major flat index (wraps past 2**32: harmless)
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, ax) * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= shape[ax]
    x = idx * jnp.uint32(0x9E3779B1) + jnp.uint32(salt)
    for m in (0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F):
        x = (x ^ (x >> 16)) * jnp.uint32(m)
    x = x ^ (x >> 15)
    return ((x >> 8).astype(jnp.float32) + 0.5) * (2.0 / 2 ** 24) - 1.0


def _init_std(name: str, shape) -> float:
    fan_in = {"qkv": shape[0], "o": shape[0] * shape[1], "gate_up": shape[0], "down": shape[0],
              "lm_head": shape[0]}.get(name)
    return 1.0 if fan_in is None else fan_in ** -0.5


def random_params(config: LlamaConfig, mesh: Mesh, seed: int = 0, *, axis_name: str = "tp") -> dict:
    """Random parameters (never zero) created directly sharded on the devices: no host copy, so
    8B bf16 is fine. Linear weights have std 1/sqrt(fan_in), the embedding std 1, norm weights
    1 +- 0.1. The values depend on (config, seed) only, not on the mesh (with tp > num_kv_heads
    the KV heads are copied, llama.tp_layout)."""
    r = sharding.kv_replicas(config, mesh.shape[axis_name])
    _, abstract = llama.abstract_model(config)
    shardings = llama.param_shardings(config, mesh, axis_name)

    def init():
        leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        out = []
        for i, (path, sds) in enumerate(leaves):
            name = str(getattr(path[-1], "key", path[-1]))
            u = hash_uniform(sds.shape, mix32(mix32(seed) + 0x632BE5AB * (i + 1)))
            if name == "weight":  # RMSNorm gain
                w = 1.0 + 0.1 * u
            else:  # uniform with the target std
                w = u * (_init_std(name, sds.shape) * 3 ** 0.5)
            if name == "qkv":
                w = sharding.replicate_kv(w, r)
            out.append(w.astype(sds.dtype))
        return jax.tree_util.tree_unflatten(treedef, out)

    return jax.jit(init, out_shardings=shardings)()
