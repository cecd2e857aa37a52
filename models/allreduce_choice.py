"""Which all-reduce a payload gets under sifar: the one place models/ holds sifar_jax's
slot/padding rule (until sifar_jax exports its own query: `sifar_jax.allreduce_choice(shape,
dtype, axis_name, *, algorithm="auto")`, which replaces `psum_reason` below)."""

from __future__ import annotations

import math
from typing import Optional

import jax.numpy as jnp

from .capacity import prompt_bucket
from .options import SIFAR_KINDS


def psum_reason(shape: tuple, dtype, axis_name: str) -> Optional[str]:
    """Why sifar_jax (algorithm "auto") hands a payload of `shape` and `dtype` over `axis_name`
    to lax.psum, or None where sifar runs it: a dtype sifar does not reduce, or a payload (padded
    to 16 bytes) larger than the smallest slot of the axis' communicators."""
    import sifar_jax

    dtype = jnp.dtype(dtype)
    if dtype not in sifar_jax.SUPPORTED_DTYPES:
        return f"sifar does not reduce {dtype.name}"
    payload = math.prod(shape) * dtype.itemsize
    slots = [c.slot_bytes for c in sifar_jax.communicators(axis_name)]
    if slots and -(-payload // 16) * 16 > min(slots):
        return f"a {payload} B payload > sifar's {min(slots)} B slot"
    return None


def prefill_allreduce(options, config, prompt_len: int) -> str:
    """Which all-reduce a prefill of prompt_len tokens (padded to its bucket) runs: the
    options', or for sifar "psum (fallback: ...)" where its payload (rows x padded prompt x
    hidden) is not sifar's (algorithm "auto" hands it to lax.psum; a named one raises)."""
    if options.allreduce not in SIFAR_KINDS:
        return options.allreduce
    shape = (options.batch_size, prompt_bucket(prompt_len), config.hidden_size)
    why = psum_reason(shape, config.dtype, options.axis_name)
    return options.allreduce if why is None else f"psum (fallback: {why})"
