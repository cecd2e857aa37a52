"""How a decoder runs, in one frozen value: DecodeOptions.

The options travel as ONE value from the Decoder through ModelFamily.make_forward and
CausalLM.__call__ to attention.Step, which the layers read. Fields left None are the platform's
defaults, filled once by `resolve(mesh)` (the Decoder does it): kv_layout
(sharding.default_kv_layout), gemm_rows (default_gemm_rows), attn_impl (default_attn_impl).
The figures behind each default are in docs/performance.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from jax.sharding import Mesh

from ..core.sharding import check_kv_layout, default_kv_layout
from ..core.tp import ALLREDUCE_KINDS, FUSED_MODES, make_fused_add_norm

ATTN_IMPLS = ("xla", "pallas")  # how a step of one token attends (models.core.attention)


def check_attn_impl(attn_impl: str) -> None:
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")


STEPS = ("auto", "xla", "persistent")  # how a one-token step runs (step_choice.py)
STEP_ALLREDUCES = ("sifar", "oneshot")  # the all-reduce inside the persistent step at TP >= 2
SIFAR_KINDS = ("sifar", "sifar_buffers")  # all-reduce kinds that run sifar_jax (and call init)


def _is_gpu(mesh: Mesh) -> bool:
    return mesh.devices.flat[0].platform == "gpu"


def default_gemm_rows(mesh: Mesh) -> int:
    """The rows a batch-1 step's projections run with (tp.project): 2 on GPUs, where XLA:GPU
    streams a one-row projection's weights more slowly than a two-row one's; 1 elsewhere."""
    return 2 if _is_gpu(mesh) else 1


def default_attn_impl(mesh: Mesh) -> str:
    """How a step of one token attends (attention.ATTN_IMPLS): "pallas" on GPUs (JAX's Pallas
    flash-decoding kernel, models.core.pallas_attention), "xla" elsewhere (the kernel would run in
    Pallas' interpreter)."""
    return "pallas" if _is_gpu(mesh) else "xla"


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """How a decoder runs (not what model it runs: that is the config).

    allreduce: tp.ALLREDUCE_KINDS: "psum", "sifar" (the Decoder calls sifar_jax.init(mesh,
      slot_bytes=slot_bytes)), "sifar_buffers" (sifar with explicit dual buffers carried in the
      decode state) or "identity" (no all-reduce: wrong numbers, the timing upper bound).
    algorithm: sifar's ("auto": a payload past sifar's slot falls back to lax.psum; a named
      algorithm raises instead). slot_bytes: sifar's slot size (None: sifar_jax's default), for the
      sifar kinds and the persistent step's all-reduce phase (step="persistent").
    fused: (sifar only) all-reduce, residual add and RMSNorm as one sifar_jax.psum_add_rmsnorm
      call, prefetching the first prefetch_bytes of the next matmul's weight into L2 while it
      waits (None: sifar_jax's default, 0: none).
    batch_size: sequences per batch. max_seq_len: the KV cache's positions (None: sized to each
      request, a power of two, grown as needed, never beyond config.max_seq_len).
    kv_layout: sharding.KV_LAYOUTS ("bshd", "bhsd"); None: the one the platform updates in place.
    gemm_rows: the rows a single-row projection runs with (tp.project); None: default_gemm_rows.
    attn_impl: how a step of one token attends (attention.ATTN_IMPLS); None: default_attn_impl.
    compiler_options: XLA options every prefill, step and chunk executable is compiled with
      (`Lowered.compile`), e.g. {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"};
      stored as sorted (name, value) pairs so that the options stay hashable.
    pack_params: pass the small replicated vectors (norm scales) as one array per dtype
      (decoder/param_pack.py): fewer arguments per call; fused, the norm scales the fused call
      takes stay arrays of their own (a custom call's operand).
    axis_name: the mesh axis the model is split over.
    step: how a one-token step runs (step_choice.py): "auto" (the fast step where it serves the
      decoder on a GPU, else XLA's), "xla", or "persistent" (llama/step.py, at TP >= 2 one rank
      per device; on CPU host devices the op's C++ reference; else ValueError saying why; a
      kv_layout left None is then "bhsd"). step_allreduce: the all-reduce inside it at TP >= 2.
    """

    allreduce: str = "psum"
    algorithm: str = "auto"
    fused: bool = False
    slot_bytes: Optional[int] = None
    prefetch_bytes: Optional[int] = None
    batch_size: int = 1
    max_seq_len: Optional[int] = None
    kv_layout: Optional[str] = None
    gemm_rows: Optional[int] = None
    attn_impl: Optional[str] = None
    compiler_options: Any = ()
    pack_params: bool = True
    axis_name: str = "tp"
    step: str = "auto"
    step_allreduce: str = "sifar"

    def __post_init__(self):
        _check(self)
        opts = self.compiler_options
        if isinstance(opts, Mapping) or opts is None:
            object.__setattr__(self, "compiler_options", tuple(sorted((opts or {}).items())))
        elif not isinstance(opts, tuple):
            raise TypeError(f"compiler_options must be a dict of XLA options, got "
                            f"{type(opts).__name__}")
        object.__setattr__(self, "pack_params", bool(self.pack_params))

    def replace(self, **changes) -> "DecodeOptions":
        return dataclasses.replace(self, **changes)

    @property
    def resolved(self) -> bool:
        """Whether every platform default is filled in (resolve)."""
        return None not in (self.kv_layout, self.gemm_rows, self.attn_impl)

    def resolve(self, mesh: Mesh) -> "DecodeOptions":
        """These options with the platform's defaults filled in for `mesh`, and what needs the
        environment checked (fused: the fused kernel exists). Returns self when resolved."""
        if self.fused:  # a clear error now, not at trace
            make_fused_add_norm(self.allreduce, self.algorithm, self.prefetch_bytes)
        if self.resolved:
            return self
        return self.replace(  # the persistent step reads the "bhsd" cache
            kv_layout=self.kv_layout or ("bhsd" if self.step == "persistent" else
                                         default_kv_layout(mesh)),
            gemm_rows=self.gemm_rows or default_gemm_rows(mesh),
            attn_impl=self.attn_impl or default_attn_impl(mesh))

    def xla_options(self) -> Optional[dict]:
        """compiler_options as the dict `Lowered.compile` takes (None: none)."""
        return dict(self.compiler_options) or None


def _check(o: "DecodeOptions") -> None:
    """A clear error for each option out of range, when the options are made."""
    if o.allreduce not in ALLREDUCE_KINDS:
        raise ValueError(f"allreduce must be one of {ALLREDUCE_KINDS}, got {o.allreduce!r}")
    if o.slot_bytes is not None and o.allreduce not in SIFAR_KINDS and o.step != "persistent":
        raise ValueError(f"slot_bytes is sifar's slot size; allreduce={o.allreduce!r} uses none "
                         f"(nor does step={o.step!r}: the persistent step's all-reduce phase "
                         f"does, asked for with step='persistent')")
    if o.fused not in FUSED_MODES:
        raise ValueError(f"fused must be one of {FUSED_MODES}, got {o.fused!r}")
    if o.prefetch_bytes and not o.fused:
        raise ValueError("prefetch_bytes is the fused call's (fused=True)")
    for name in ("batch_size", "max_seq_len", "gemm_rows"):
        value = getattr(o, name)
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if o.kv_layout is not None:
        check_kv_layout(o.kv_layout)
    if o.attn_impl is not None:
        check_attn_impl(o.attn_impl)
    if o.step not in STEPS:
        raise ValueError(f"step must be one of {STEPS}, got {o.step!r}")
    if o.step_allreduce not in STEP_ALLREDUCES:
        raise ValueError(f"step_allreduce must be one of {STEP_ALLREDUCES}, got "
                         f"{o.step_allreduce!r}")
