"""Sizes a decoder picks on the host: the KV cache's capacity, the attention buckets a step
attends over, the prompt buckets a prompt is left-padded to, and the stop ids a request gives.

Attention runs over the smallest bucket (a power of two >= MIN_BUCKET, or the capacity) that
holds the filled positions, so a step costs what the filled length costs, not the whole cache.
Prompts are left-padded to a prompt bucket, so a prefill compiles once per bucket, not once per
prompt length.
"""

from __future__ import annotations

import numpy as np

MIN_BUCKET = 64  # smallest attention bucket and smallest cache (positions)
MIN_PROMPT_BUCKET = 16  # shortest padded prompt
ON_DEVICE_CHUNK = 16  # tokens per dispatch of the on_device loop
MAX_STOP_IDS = 8  # stop ids a request may give (Llama 3 instruct has 3): a fixed-size operand


def cache_reserve(max_new_tokens: int, loop: str, chunk: int = ON_DEVICE_CHUNK) -> int:
    """Cache positions a request of max_new_tokens needs after its prompt under `loop` (the
    on_device loop's last chunk may run past max_new_tokens)."""
    return max_new_tokens + (chunk if loop == "on_device" else 0)


def _pow2_at_least(n: int, smallest: int) -> int:
    b = smallest
    while b < n:
        b *= 2
    return b


def bucket_up(n: int) -> int:
    """The smallest power of two >= n, at least MIN_BUCKET."""
    return _pow2_at_least(n, MIN_BUCKET)


def prompt_bucket(n: int) -> int:
    """The length a prompt of n tokens is left-padded to: the smallest power of two >= n, at
    least MIN_PROMPT_BUCKET."""
    return _pow2_at_least(n, MIN_PROMPT_BUCKET)


def prompt_buckets(max_prompt_len: int) -> list[int]:
    """Every prompt bucket of prompts up to max_prompt_len tokens."""
    out = [MIN_PROMPT_BUCKET]
    while out[-1] < max_prompt_len:
        out.append(out[-1] * 2)
    return out


def attention_buckets(capacity: int) -> list[int]:
    """The attention lengths a cache of `capacity` positions compiles steps for."""
    out, b = [], MIN_BUCKET
    while b < capacity:
        out.append(b)
        b *= 2
    return out + [capacity]


def stop_ids(eos_id) -> tuple[int, ...]:
    """eos_id (None, an id, or a sequence of ids) as a tuple of ids."""
    if eos_id is None:
        return ()
    ids = tuple(int(e) for e in (np.ravel(eos_id) if np.ndim(eos_id) else [eos_id]))
    if len(ids) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS} stop ids, got {len(ids)}")
    return ids
