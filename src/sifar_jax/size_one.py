"""A sum over mesh axes of one device: a change of type, no communication.

`lax.psum(x, "z")` over an axis of one device keeps an all-reduce of one
participant in the compiled program (XLA:CPU and XLA:GPU do not drop it), and
a bf16 sum over ("z", "y") then rounds twice. `sifar_psum` folds such axes into
its own call's type (psum.py) and, where they are all the axes, binds this
primitive: the result is x, typed as lax.psum types it (no longer varying over
those axes), and it lowers to nothing. Its transpose is lax.psum's (a cast to
varying, which moves nothing either).
"""

from __future__ import annotations

import functools

import jax

from . import _jax_compat
from ._jax_compat import lax_psum

ad, batching, mlir = _jax_compat.ad, _jax_compat.batching, _jax_compat.mlir

size_one_psum_p = _jax_compat.Primitive("sifar_size_one_psum")


def psum(x, axes: tuple):
    """lax.psum(x, axes) for mesh axes of one device each: x, retyped."""
    return size_one_psum_p.bind(x, axes=tuple(axes))


def _abstract_eval(x, *, axes):
    return _jax_compat.psum_type(x, axes)


def _jvp(primals, tangents, *, axes):
    out = psum(primals[0], axes)
    t = tangents[0]
    if type(t) is ad.Zero:
        return out, _jax_compat.zero_tangent(out)
    return out, psum(t, axes)


def _transpose(ct, x, *, axes):
    assert ad.is_undefined_primal(x)
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    (ct_in,) = jax.linear_transpose(functools.partial(lax_psum, axis_name=axes), x.aval)(ct)
    return [ct_in]


def _batch(args, dims, *, axes):
    return psum(args[0], axes), dims[0]


size_one_psum_p.def_abstract_eval(_abstract_eval)
size_one_psum_p.def_impl(lambda x, *, axes: x)
mlir.register_lowering(size_one_psum_p, lambda ctx, x, *, axes: [x])
ad.primitive_jvps[size_one_psum_p] = _jvp
ad.primitive_transposes[size_one_psum_p] = _transpose
batching.primitive_batchers[size_one_psum_p] = _batch
