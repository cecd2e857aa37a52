"""Which all-reduce a prefill runs: the decoder's, or lax.psum where sifar_jax hands the payload
over (sifar_jax.allreduce_choice holds the rule; models/ does not re-derive it)."""

from __future__ import annotations

from .capacity import prompt_bucket
from .options import SIFAR_KINDS


def prefill_allreduce(options, config, prompt_len: int) -> str:
    """Which all-reduce a prefill of prompt_len tokens (padded to its bucket) runs: the
    options', or for sifar "psum (fallback: ...)" where sifar_jax hands its payload (rows x
    padded prompt x hidden) to lax.psum (algorithm "auto"; a named one raises at trace time)."""
    if options.allreduce not in SIFAR_KINDS:
        return options.allreduce
    import sifar_jax

    shape = (options.batch_size, prompt_bucket(prompt_len), config.hidden_size)
    choice = sifar_jax.allreduce_choice(shape, config.dtype, options.axis_name,
                                        algorithm=options.algorithm)
    if choice.sifar or not choice.psum_axes:  # sifar, or an axis of one device: nothing to reduce
        return options.allreduce
    return f"psum (fallback: {choice.reason})"
