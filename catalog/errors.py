"""Catalog errors are types that carry data. Nothing above catalog/ matches on strings."""

from __future__ import annotations

from collections.abc import Sequence

from cas.errors import VaultError


class CatalogError(VaultError):
    """Base of every error the catalog raises."""


class ManifestInvalid(CatalogError):
    """A manifest failed its MAC, names an unknown key, or is malformed; nothing of it is used."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"manifest invalid: {reason}")
        self.reason = reason


class IdentityMismatch(CatalogError):
    """State published under one identity was asked for under another."""

    def __init__(self, expected: bytes, got: bytes) -> None:
        super().__init__(f"identity mismatch: expected {expected.hex()[:12]}, got {got.hex()[:12]}")
        self.expected, self.got = expected, got


class StaleGeneration(CatalogError):
    """A manifest's generation is not the one the catalog holds for it (replayed or stale)."""

    def __init__(self, manifest_id: str, expected: int, got: int) -> None:
        super().__init__(f"manifest {manifest_id}: generation {got} is stale (catalog: {expected})")
        self.manifest_id, self.expected, self.got = manifest_id, expected, got


class GenerationExhausted(CatalogError, ValueError):
    """Generations never wrap: a generation above 2**63-1 is refused."""

    def __init__(self, generation: int) -> None:
        super().__init__(f"generation {generation} is outside 0..2**63-1 (generations never wrap)")
        self.generation = generation


class CutMissing(CatalogError):
    """The catalog no longer holds the cut (evicted, or never published)."""

    def __init__(self, manifest_id: str) -> None:
        super().__init__(f"cut {manifest_id} is not in the catalog")
        self.manifest_id = manifest_id


class ChunksBeingCollected(CatalogError):
    """A publish waited too long for GC to finish deleting chunks it needs to store again."""

    def __init__(self, chunk_ids: Sequence[str]) -> None:
        super().__init__(f"{len(chunk_ids)} chunk(s) still being collected: {list(chunk_ids)[:3]}")
        self.chunk_ids = tuple(chunk_ids)
