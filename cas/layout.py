"""The object-store layout is one table; one function builds every key.

Keys are relative to the store: a bucket prefix (s3://bucket/prefix) is the S3
backend's business (S3Config.prefix), never part of these keys.
"""

from __future__ import annotations

from typing import Literal

Kind = Literal["chunk", "manifest", "quarantine"]

_LAYOUT: dict[str, str] = {
    "chunk": "chunks/{0:.2}/{0}",
    "manifest": "manifests/{0}/{1}",
    "quarantine": "quarantine/{0}/{1}",
}


def object_key(kind: Kind, *parts: str) -> str:
    """Key of an object. Parts: chunk (hex); manifest (identity hex, manifest id);
    quarantine (import id, name)."""
    return _LAYOUT[kind].format(*parts)


def prefix_of(kind: Kind) -> str:
    """The key prefix every object of `kind` starts with (for listing)."""
    return _LAYOUT[kind].split("/", 1)[0] + "/"
