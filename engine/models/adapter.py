"""Adapters: an mlx-lm LoRA/DoRA/full fine-tune directory (adapter_config.json +
adapters.safetensors) applied on top of a loaded model. Its files' digest is the
identity's `adapter` component."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tuner.utils import load_adapters

from engine.identity import WeightDigests
from engine.models.errors import ModelLoadError

ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")


def apply_adapter(model: nn.Module, path: Path, *, digests: WeightDigests | None = None) -> bytes:
    """Apply the adapter in `path` to `model` (in place); return the adapter digest."""
    path = Path(path).expanduser().resolve()
    missing = [name for name in ADAPTER_FILES if not (path / name).is_file()]
    if missing:
        raise ModelLoadError(str(path), f"not an adapter directory (missing {', '.join(missing)})")
    try:
        load_adapters(model, str(path))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(str(path), f"adapter does not fit the model: {e}") from e
    mx.eval(model.parameters())
    files = [path / name for name in ADAPTER_FILES]
    return (digests or WeightDigests()).files_digest(files, root=path)
