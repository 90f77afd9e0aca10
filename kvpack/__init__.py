"""kvpack — the product: reuse ladder, hit accounting, economics, service API, CLI, bench.

From Python: `kvpack.open(...)` (kvpack/api.py). The names below load on first use, so
`import kvpack` (which the command line does too) loads neither MLX nor SQLAlchemy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# engine first: it loads the fast BLAS, which only works before mlx.core is imported.
import engine  # noqa: F401

if TYPE_CHECKING:
    from engine.errors import InvalidRequest, RestoreRefused
    from engine.interop import prefill_aligned, resumes
    from engine.models import ModelLoadError, ModelNotCached
    from kvpack.api import ContextLengthExceeded, Model, Stream, VaultClient, VaultClosed, open
    from kvpack.config import ConfigError
    from kvpack.service.interop import RestoredCache
    from kvpack.service.service import Completion

_LAZY = {
    "open": "kvpack.api",
    "VaultClient": "kvpack.api",
    "Model": "kvpack.api",
    "Stream": "kvpack.api",
    "ContextLengthExceeded": "kvpack.api",
    "VaultClosed": "kvpack.api",
    "Completion": "kvpack.service.service",
    "RestoredCache": "kvpack.service.interop",
    "ConfigError": "kvpack.config",
    "InvalidRequest": "engine.errors",
    "RestoreRefused": "engine.errors",
    "ModelLoadError": "engine.models",
    "ModelNotCached": "engine.models",
    "prefill_aligned": "engine.interop",
    "resumes": "engine.interop",
}
__all__ = [
    "Completion",
    "ConfigError",
    "ContextLengthExceeded",
    "InvalidRequest",
    "Model",
    "ModelLoadError",
    "ModelNotCached",
    "RestoreRefused",
    "RestoredCache",
    "Stream",
    "VaultClient",
    "VaultClosed",
    "open",
    "prefill_aligned",
    "resumes",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpack' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
