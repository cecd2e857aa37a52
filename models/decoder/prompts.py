"""A request's token ids on the host: checked against the vocabulary, shaped [batch, T], and
prompts of different lengths left-padded to one width (each row's last prompt token in the same
slot; the state's `start` says where each row's real tokens begin)."""

from __future__ import annotations

import numpy as np

from .capacity import MAX_STOP_IDS, prompt_bucket


def check_ids(tokens, vocab_size: int) -> np.ndarray:
    """tokens as int32, or a ValueError naming the first id outside [0, vocab_size) (an id
    past the embedding table would be read as garbage, never as an error, on a device)."""
    tokens = np.asarray(tokens)
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got {tokens.dtype}")
    bad = (tokens < 0) | (tokens >= vocab_size)
    if bad.any():
        raise ValueError(f"token id {int(tokens[bad].flat[0])} is outside the vocabulary "
                         f"[0, {vocab_size})")
    return tokens.astype(np.int32)


def as_batch(tokens: np.ndarray, rows: int, what: str = "tokens") -> np.ndarray:
    """tokens [rows, T] from [rows, T], or [T] for batch 1 ([rows] as [rows, 1] otherwise)."""
    if tokens.ndim == 1:
        tokens = tokens[None, :] if rows == 1 else tokens[:, None]
    if tokens.ndim != 2 or tokens.shape[0] != rows:
        raise ValueError(f"{what} of shape {tokens.shape}: expected [batch_size={rows}, T]")
    return tokens


def prompt_rows(prompt, rows: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [rows, T], lengths [rows]) of a prompt [B, T] (or [T] for batch 1), or of B
    sequences of different lengths (a list: each row's tokens first, then zeros); ids checked."""
    if isinstance(prompt, (list, tuple)) and prompt and all(
            np.ndim(p) == 1 for p in prompt) and len({len(p) for p in prompt}) > 1:
        if len(prompt) != rows:
            raise ValueError(f"{len(prompt)} prompts for batch_size={rows}")
        seqs = [check_ids(p, vocab_size) for p in prompt]
        lengths = np.array([len(r) for r in seqs], np.int32)
        if not lengths.min():
            raise ValueError("empty prompt: a sequence needs at least one token")
        tokens = np.zeros((len(seqs), lengths.max()), np.int32)
        for row, r in enumerate(seqs):
            tokens[row, :len(r)] = r
        return tokens, lengths
    tokens = as_batch(check_ids(prompt, vocab_size), rows, "prompt")
    if tokens.shape[1] == 0:
        raise ValueError("empty prompt: a sequence needs at least one token")
    return tokens, np.full(rows, tokens.shape[1], np.int32)


def prompt_width(t: int, reserve: int, limit: int) -> int:
    """The slots a prompt of t tokens takes: its bucket, or t itself where the bucket and the
    reserve would not fit the cache's limit (an executable of its own)."""
    width = prompt_bucket(t)
    return width if width + reserve <= limit else t


def left_pad(tokens: np.ndarray, lengths: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [rows, width], each row's first slot): every row's last token in slot width - 1."""
    pad = width - lengths
    padded = np.zeros((tokens.shape[0], width), np.int32)
    for row, (toks, n) in enumerate(zip(tokens, lengths)):
        padded[row, pad[row]:] = toks[:n]
    return padded, pad


def stop_array(ids: tuple, vocab_size: int) -> np.ndarray:
    """Stop ids as the state's fixed-size operand [MAX_STOP_IDS] (-1: none)."""
    for e in ids:
        if not 0 <= e < vocab_size:
            raise ValueError(f"stop id {e} is outside the vocabulary [0, {vocab_size})")
    return np.array(list(ids) + [-1] * (MAX_STOP_IDS - len(ids)), np.int32)
