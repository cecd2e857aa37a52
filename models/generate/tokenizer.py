"""Text in, text out for a Hugging Face checkpoint directory: its tokenizer (tokenizer.json, read
with the `tokenizers` package), its chat template (tokenizer_config.json's chat_template or
chat_template.jinja, rendered with jinja2 as transformers renders it), its stop tokens
(generation_config.json's eos_token_id, else config.json's: an int or a list), and decoding
tokens to text as they arrive (TextStream), never cutting a character that several tokens
share. The optional extra `text` (pyproject) installs tokenizers and jinja2.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Optional, Sequence

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
INCOMPLETE = "\ufffd"  # what decoding a partial UTF-8 sequence ends with


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _token_text(value: Any) -> Optional[str]:
    """tokenizer_config's bos/eos entries: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def checkpoint_eos_ids(path: str) -> list[int]:
    """The stop ids of the checkpoint at `path`: generation_config.json's eos_token_id, else
    config.json's (an int or a list); [] where neither has one."""
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(os.path.join(path, name)).get("eos_token_id")
        if eos is not None:
            return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return []


def has_tokenizer(path: str) -> bool:
    return os.path.isfile(os.path.join(path, TOKENIZER_FILE))


class TextTokenizer:
    """The tokenizer, chat template and stop ids of the checkpoint at `path`."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError("text in and out needs the `tokenizers` package: "
                              "pip install 'sifar-jax[text]'") from e
        file = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{path}: no {TOKENIZER_FILE}")
        self.path = path
        self.tokenizer = Tokenizer.from_file(file)
        self.config = _read_json(os.path.join(path, TOKENIZER_CONFIG))
        self.chat_template = self._chat_template()
        self.eos_ids = self._eos_ids()

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (special tokens included)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def _chat_template(self) -> Optional[str]:
        file = os.path.join(self.path, CHAT_TEMPLATE_FILE)
        if os.path.isfile(file):
            with open(file) as f:
                return f.read()
        t = self.config.get("chat_template")
        if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
            t = next((x["template"] for x in t if x.get("name") == "default"), None)
        return t

    def _eos_ids(self) -> list[int]:
        """generation_config.json's eos_token_id, else config.json's, else the tokenizer's
        eos_token; [] where none says."""
        ids = checkpoint_eos_ids(self.path)
        if ids:
            return ids
        text = _token_text(self.config.get("eos_token"))
        tid = self.tokenizer.token_to_id(text) if text else None
        return [] if tid is None else [tid]

    def encode(self, text: str, *, chat: bool = False) -> list[int]:
        """The prompt's ids: the text as the tokenizer adds special tokens to it (a BOS), or with
        chat=True the text as a user message in the chat template, with the generation prompt
        (the template writes its own special tokens: none are added)."""
        if not chat:
            return self.tokenizer.encode(text).ids
        return self.tokenizer.encode(self.render_chat(text), add_special_tokens=False).ids

    def render_chat(self, text: str, system: Optional[str] = None) -> str:
        """The chat template applied to one user message (and a system one), ready for the
        assistant's answer (add_generation_prompt)."""
        if not self.chat_template:
            raise ValueError(f"{self.path}: the tokenizer has no chat template "
                             f"({TOKENIZER_CONFIG}'s chat_template or {CHAT_TEMPLATE_FILE})")
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text}]
        return _render(self.chat_template, messages=messages, add_generation_prompt=True,
                       bos_token=_token_text(self.config.get("bos_token")) or "",
                       eos_token=_token_text(self.config.get("eos_token")) or "")

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def stream(self, context: Sequence[int] = ()) -> "TextStream":
        return TextStream(self, context)


def _render(template: str, **kw) -> str:
    """A chat template rendered as transformers renders it (a sandboxed jinja2 environment,
    trim_blocks and lstrip_blocks, raise_exception and strftime_now available)."""
    import datetime

    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ImportError("chat templates need jinja2: pip install 'sifar-jax[text]'") from e

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env.from_string(template).render(**kw)


class TextStream:
    """Text from tokens as they arrive: push(id) returns the text those ids add, holding it back
    while it ends in a partial character (a UTF-8 sequence split over tokens decodes to U+FFFD
    until its last byte arrives); flush() returns what is left at the end. Each piece is the
    difference of two decodes of a short window of ids (a few ids of context before the new
    ones), so tokenizers that drop or add a leading space by position decode as a whole text
    would; the pieces joined are decode(all ids)."""

    CONTEXT = 5  # ids decoded before the new ones

    def __init__(self, tokenizer: TextTokenizer, context: Sequence[int] = ()):
        self._tok = tokenizer
        self._ids = list(context)[-self.CONTEXT:]
        self._prefix = 0  # window start
        self._read = len(self._ids)  # ids before this are already returned as text

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        before = self._tok.decode(self._ids[self._prefix:self._read])
        now = self._tok.decode(self._ids[self._prefix:])
        if len(now) <= len(before) or now.endswith(INCOMPLETE):
            return ""
        self._prefix, self._read = max(self._read - self.CONTEXT, 0), len(self._ids)
        return now[len(before):]

    def flush(self) -> str:
        before = self._tok.decode(self._ids[self._prefix:self._read])
        now = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return now[len(before):]

    def feed(self, ids: Iterable[int]) -> str:
        """Every piece of `ids`, then the rest: the text they add."""
        return "".join(self.push(i) for i in ids) + self.flush()
