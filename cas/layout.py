"""The object-store layout is one table; one function builds every key."""

from __future__ import annotations

from typing import Literal

Kind = Literal["chunk", "manifest", "quarantine"]

_LAYOUT: dict[str, str] = {
    "chunk": "chunks/{0:.2}/{0}",
    "manifest": "manifests/{0}/{1}",
    "quarantine": "quarantine/{0}/{1}",
}


def object_key(kind: Kind, *parts: str, prefix: str = "") -> str:
    """Key of an object. Parts: chunk (hex); manifest (identity hex, manifest id);
    quarantine (import id, name)."""
    key = _LAYOUT[kind].format(*parts)
    return f"{prefix.rstrip('/')}/{key}" if prefix else key
