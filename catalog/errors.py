"""Catalog errors are types that carry data. Nothing above catalog/ matches on strings."""

from __future__ import annotations

from collections.abc import Sequence

from cas.errors import VaultError
from catalog.ids import ManifestId


class CatalogError(VaultError):
    """Base of every error the catalog raises."""


class ManifestInvalid(CatalogError):
    """A manifest failed its MAC, names an unknown key, or is malformed; nothing of it is used."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"manifest invalid: {reason}")
        self.reason = reason


class ManifestMissing(ManifestInvalid):
    """The catalog names a manifest object the store no longer holds: the row's promise is
    broken, so the cut is as unusable as a corrupt one (a verification failure)."""

    def __init__(self, manifest_id: ManifestId, object_key: str) -> None:
        super().__init__(f"manifest object {object_key} of cut {manifest_id} is missing")
        self.manifest_id, self.object_key = manifest_id, object_key


class StaleGeneration(CatalogError):
    """A manifest's generation is not the one the catalog holds for it (replayed or stale)."""

    def __init__(self, manifest_id: ManifestId, expected: int, got: int) -> None:
        super().__init__(f"manifest {manifest_id}: generation {got} is stale (catalog: {expected})")
        self.manifest_id, self.expected, self.got = manifest_id, expected, got


class GenerationExhausted(CatalogError, ValueError):
    """Generations never wrap: a generation above 2**63-1 is refused."""

    def __init__(self, generation: int) -> None:
        super().__init__(f"generation {generation} is outside 0..2**63-1 (generations never wrap)")
        self.generation = generation


class ChunksBeingCollected(CatalogError):
    """A publish waited too long for GC to finish deleting chunks it needs to store again."""

    def __init__(self, chunk_ids: Sequence[str]) -> None:
        super().__init__(f"{len(chunk_ids)} chunk(s) still being collected: {list(chunk_ids)[:3]}")
        self.chunk_ids = tuple(chunk_ids)
