"""The catalog's ids, beside cas's ChunkId (cas/ids.py): each a small frozen value.

- IdentityDigest: the identity (docs/architecture.md: the digest of everything that makes a KV state
  meaningful), 32 bytes. The engine computes it; everything below the engine keys by it.
- ChainDigest: one link of a token chain (catalog/chain.py), 32 bytes: the name of a
  prefix of a token history.
- ManifestId: 16 bytes derived from the idempotency key (catalog/manifest.py), so one
  history under one identity is one manifest.

In the catalog's tables and in object keys every id is its lowercase hex.
"""

from __future__ import annotations

from dataclasses import dataclass

from cas.ids import Digest


@dataclass(frozen=True, slots=True, repr=False)
class IdentityDigest(Digest):
    """An identity digest."""


@dataclass(frozen=True, slots=True, repr=False)
class ChainDigest(Digest):
    """A token-chain link: the name of tokens[:depth] under one alignment."""


@dataclass(frozen=True, slots=True, repr=False)
class ManifestId(Digest):
    """The id of a manifest (the first 16 bytes of its idempotency key)."""

    SIZE = 16
