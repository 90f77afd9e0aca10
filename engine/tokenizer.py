"""Tokenizers: text <-> token ids, and the chat template that turns messages into ids.

- Tokenizer: the protocol the engine and the service speak. Besides encode/decode it
  exposes the two digests that enter the identity: `digest` (vocabulary, merges,
  special tokens, pre-tokenizer — everything that maps text to ids) and
  `chat_template_digest` (the template text that maps messages to text).
- FastTokenizer: a `tokenizers` backend (byte-level BPE here) plus a Jinja chat template.
  The tiny test model (256 byte tokens, no merges), the GGUF demo model (vocab and
  merges from its metadata) and mlx-lm model directories (tokenizer.json) all use it.

Special tokens written in the text given to `encode` are recognised, as Hugging Face
tokenizers do; the chat template relies on that.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol, runtime_checkable

import jinja2
import jinja2.sandbox
import tokenizers


class ChatTemplateError(ValueError):
    """The chat template could not render these messages."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"chat template failed: {reason}")
        self.reason = reason


@runtime_checkable
class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def chat_template(self) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]: ...

    @property
    def digest(self) -> bytes: ...

    @property
    def chat_template_digest(self) -> bytes: ...


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    # Same environment Hugging Face uses for chat templates, so templates written for it
    # render identically (trim_blocks/lstrip_blocks, sandboxed, raise_exception, tojson).
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


@dataclass(frozen=True)
class FastTokenizer:
    """A `tokenizers` byte-level BPE with special tokens and a Jinja chat template."""

    backend: tokenizers.Tokenizer
    chat_template: str
    bos_token: str | None = None
    eos_tokens: tuple[str, ...] = ()
    template_vars: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for tok in (self.bos_token, *self.eos_tokens):
            if tok is not None:
                self._special_id(tok)
        if not self.eos_tokens:
            raise ValueError("a tokenizer needs at least one end-of-sequence token")

    def _special_id(self, tok: str) -> int:
        token_id = self.backend.token_to_id(tok)
        if token_id is None:
            raise ValueError(f"special token {tok!r} is not in the vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._special_id(self.bos_token)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self._special_id(t) for t in self.eos_tokens)

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not), so a long
        # prompt tokenized on a worker thread never stalls the threads beside it.
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template")
        try:
            return _compile_template(self.chat_template).render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_tokens[0],
                **self.template_vars,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(str(e)) from e

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text)

    @property
    def digest(self) -> bytes:
        return _tokenizer_digest(self.backend.to_str(), self.bos_token, self.eos_tokens)

    @property
    def chat_template_digest(self) -> bytes:
        vars_json = json.dumps(dict(self.template_vars), sort_keys=True, default=str)
        return _sha256(
            b"kvpack.chat-template.v1\0" + self.chat_template.encode() + b"\0" + vars_json.encode()
        )


@lru_cache(maxsize=8)
def _tokenizer_digest(serialized: str, bos: str | None, eos: tuple[str, ...]) -> bytes:
    # Canonical JSON of the whole tokenizer (model, vocab, merges, normalizer, pre-tokenizer,
    # added tokens), so two tokenizers that map text to ids alike share a digest.
    canonical = json.dumps(json.loads(serialized), sort_keys=True, separators=(",", ":"))
    specials = json.dumps({"bos": bos, "eos": list(eos)}, sort_keys=True)
    return _sha256(b"kvpack.tokenizer.v1\0" + canonical.encode() + b"\0" + specials.encode())


def byte_level_bpe(
    vocab: Mapping[str, int],
    merges: Iterable[tuple[str, str]],
    *,
    special_tokens: Sequence[str] = (),
    added_tokens: Sequence[str] = (),
    split_digits: bool = False,
) -> tokenizers.Tokenizer:
    """A GPT-2-style byte-level BPE from a vocabulary and merge list."""
    from tokenizers import decoders, models, pre_tokenizers

    backend = tokenizers.Tokenizer(models.BPE(vocab=dict(vocab), merges=list(merges)))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split_digits:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    if special_tokens:
        backend.add_special_tokens(
            [tokenizers.AddedToken(t, special=True, normalized=False) for t in special_tokens]
        )
    if added_tokens:
        backend.add_tokens([tokenizers.AddedToken(t, normalized=False) for t in added_tokens])
    return backend
