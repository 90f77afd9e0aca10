"""Typed errors raised while loading a model."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """`spec` could not be loaded as a model; `reason` says why."""

    def __init__(self, spec: str, reason: str) -> None:
        super().__init__(f"cannot load model {spec!r}: {reason}")
        self.spec = spec
        self.reason = reason


class UnknownModelSpec(ModelLoadError):
    """`spec` is neither a built-in name nor an existing model directory or GGUF file."""


class UnsupportedModel(ModelLoadError):
    """The model exists but uses an architecture, tokenizer or quantization not handled here."""
