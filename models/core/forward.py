"""The tensor-parallel forward of a model family: one rank's computation (transformer.CausalLM)
under jax.shard_map, with the all-reduce, fused or not, that the options choose."""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from ..decoder.options import DecodeOptions
from . import sharding
from .tp import TPContext, make_allreduce, make_allreduce_into, make_fused_add_norm


def make_forward(family, layout: "family.Layout", mesh: Mesh, options: Any = None, *,
                 last_only: bool = False, attend_len: Optional[int] = None,
                 ar_specs: Any = None, params: Any = None, step: Optional[Callable] = None):
    """The TP forward of `family`'s model split as `layout`, on `mesh`, as a pure function,
    ready for jax.jit:

        forward(params, cache, tokens, positions, ar, start=None) -> (logits, cache, ar)

    params/cache are global arrays sharded as param_shardings/init_cache; tokens [B, T],
    positions [T] and start ([B], each row's first cache slot, see attention.Step; None: 0)
    are replicated; logits [B, T (1 if last_only), vocab] come out split over vocab; `ar`
    is the all-reduce buffer pytree of the decode state ({} unless sifar_buffers;
    `ar_specs` its specs). options: an options.DecodeOptions (None: the defaults), resolved
    for `mesh` here if it is not: the all-reduce, fused or not, the cache's kv_layout,
    gemm_rows, attn_impl. attend_len: attention over that many cache positions (see
    attention.Step). params: the parameter tree (arrays or ShapeDtypeStructs) when it is not
    the layout's dense one (FP8: Fp8Weight leaves, their specs from sharding.fp8_spec; each
    rank takes its blocks of a scale left whole, sharding.local_fp8). step: a fast step's
    forward of one token (FastStep.make_forward, as decoder/step_choice.py chose it; None: the
    XLA step), run for a call of a single token of a single row. Works for a 1-device mesh
    (tp=1) too.
    """
    options = (options or DecodeOptions()).resolve(mesh)
    axis_name = options.axis_name
    layout.check_mesh(mesh, axis_name)
    graphdef, abstract = family.abstract_model(layout.shapes)
    pspecs = family.param_specs(abstract if params is None else params, axis_name, layout.tp)
    cspec = sharding.cache_spec(axis_name, options.kv_layout)
    aspecs = {} if ar_specs is None else ar_specs
    reduce_fn = make_allreduce(options.allreduce, options.algorithm)
    fused_fn = (make_fused_add_norm(options.allreduce, options.algorithm,
                                    options.prefetch_bytes) if options.fused else None)
    into_fn = make_allreduce_into(options.algorithm)

    def per_rank(params, cache, tokens, positions, ar, start):
        model = nnx.merge(graphdef, sharding.local_fp8(params, pspecs, axis_name))
        ctx = TPContext(axis_name, layout.tp, reduce_fn, ar, into_fn, fused_fn)
        logits, cache = model(tokens, positions, cache, ctx, options, last_only=last_only,
                              attend_len=attend_len, start=start)
        if ctx.buffers and ctx.count % 2:
            # The next step starts with buffer "a" again: an odd count would reuse the buffer
            # the last all-reduce wrote, which dual buffering forbids.
            raise ValueError(f"explicit dual buffers need an even number of all-reduces per "
                             f"step, got {ctx.count}")
        return logits, cache, ctx.buffers

    def mapped(check_vma: bool):
        return jax.shard_map(
            per_rank, mesh=mesh,
            in_specs=(pspecs, cspec, P(), P(), aspecs, P()),
            out_specs=(P(None, None, axis_name), cspec, aspecs), check_vma=check_vma)

    checked = mapped(True)
    # JAX's Pallas decode kernel declares no varying axes for its results, which
    # check_vma=True refuses: a one-token call that may run it is traced without the check
    # (calls of several tokens, prefills, keep it: they run the einsums).
    one_token = mapped(False) if options.attn_impl == "pallas" else checked

    def forward(params, cache, tokens, positions, ar, start=None):
        if step is not None and tokens.shape == (1, 1):
            return step(params, cache, tokens, positions, ar, start)
        fn = one_token if tokens.shape[1] == 1 else checked
        return fn(params, cache, tokens, positions, ar, start)

    return forward
