"""Opened manifests: manifests verified once, kept in memory by object key.

A manifest object never changes: every publish attempt writes its own key ("<manifest
id>-<generation>", catalog/publish.py) and nothing rewrites one. So a manifest fetched,
MAC-verified and decoded once is, for as long as this process holds it, exactly what
fetching it again would return. A reader that finds a cut's object key here skips the
manifest's read; it still checks the held manifest against the cut's catalog row and
the asked identity (publish.check_row), so a row that disagrees (another identity, a
stale generation) is refused as it would be after a fetch. The chunks are read and
verified from the store every time, as before.

- held: at most `budget` bytes of sealed envelopes (their sizes in the store), the
  least recently used dropped first; an envelope larger than the budget is not kept.
- filled by: every open of a manifest through the vault (a durable hit's read_cut,
  load_cut, a publish that meets its history already published), every manifest a
  publish seals, and the warm start, which reads the manifests of the most recently
  used cuts (Vault.preload_manifests, kvpack/service/warm.py).

Thread-safe: the vault's loop fills it while the engine's thread reads it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from catalog.manifest import SealedManifest

# A manifest lists one entry per part: the demo model's took 939 bytes at 256 tokens,
# 2,006 at 2,048 and 5,565 at 7,936 (a `kvpack bench --keep-data` vault), so this holds
# about 3,000 of the deepest cuts' manifests.
DEFAULT_BUDGET = 16 << 20


class OpenedManifests:
    def __init__(self, budget: int = DEFAULT_BUDGET) -> None:
        if budget < 0:
            raise ValueError(f"budget must be >= 0 bytes, got {budget}")
        self.budget = budget
        self._held: OrderedDict[str, tuple[SealedManifest, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"OpenedManifests({len(self)} held, {self.held_bytes} of {self.budget} bytes)"

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def __contains__(self, object_key: str) -> bool:
        with self._lock:
            return object_key in self._held

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def get(self, object_key: str) -> SealedManifest | None:
        """The manifest opened from `object_key`, if held (it becomes the most recent)."""
        with self._lock:
            held = self._held.get(object_key)
            if held is None:
                return None
            self._held.move_to_end(object_key)
            return held[0]

    def put(self, object_key: str, sealed: SealedManifest, size: int) -> None:
        """Hold `sealed`, opened and verified from the `size`-byte object `object_key`."""
        if size < 0:
            raise ValueError(f"size must be >= 0 bytes, got {size}")
        with self._lock:
            old = self._held.pop(object_key, None)
            if old is not None:
                self._bytes -= old[1]
            if size > self.budget:
                return
            self._held[object_key] = (sealed, size)
            self._bytes += size
            while self._bytes > self.budget:
                _, (_, dropped) = self._held.popitem(last=False)
                self._bytes -= dropped
