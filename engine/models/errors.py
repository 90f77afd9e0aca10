"""Typed errors raised while loading a model."""

from __future__ import annotations

from pathlib import Path


class ModelLoadError(ValueError):
    """`spec` could not be loaded as a model; `reason` says why."""

    def __init__(self, spec: str, reason: str) -> None:
        super().__init__(f"cannot load model {spec!r}: {reason}")
        self.spec = spec
        self.reason = reason


class UnknownModelSpec(ModelLoadError):
    """`spec` is neither a built-in name, an existing model directory or GGUF file, nor a
    Hugging Face repo id."""


class UnsupportedModel(ModelLoadError):
    """The model exists but uses an architecture, tokenizer or quantization not handled here."""


class ModelNotCached(ModelLoadError):
    """Hugging Face repo `repo_id` at `revision` is not in the local cache: `folder` (the
    repo's folder in the cache) is where it was looked for; `why` says what is missing.
    Nothing was downloaded."""

    def __init__(self, spec: str, *, repo_id: str, revision: str, folder: Path, why: str) -> None:
        super().__init__(
            spec,
            f"Hugging Face repo {repo_id!r} at revision {revision!r} is not in the local cache "
            f"({why}; looked in {folder}). Nothing is downloaded: fetch it first, e.g. "
            f"`hf download {repo_id}" + (f" --revision {revision}`" if revision != "main" else "`"),
        )
        self.repo_id = repo_id
        self.revision = revision
        self.folder = folder
        self.why = why
