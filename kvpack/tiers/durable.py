"""The durable tier: the vault's catalog and object store, the sole authority.

- find: one `find_deepest` query (catalog/queries.py) over the ask's token chain. Its
  answer carries the catalog row's facts, so load needs no second catalog read.
- load: the manifest object, its MAC and its agreement with the row, then every chunk
  fetched concurrently, tag-verified and re-hashed (catalog/publish.py load_cut). The
  engine gets the verified parts as Planes; kvpack never decodes them.
- served: the cut's catalog row is stamped as hit, off the response path (GC evicts the
  least recently hit first).
"""

from __future__ import annotations

from engine.state import Planes
from kvpack.background import Background
from kvpack.tiers.base import Ask, Candidate, Loaded, TierName
from kvpack.vault import Vault


class DurableTier:
    name: TierName = "durable"

    def __init__(self, vault: Vault, background: Background) -> None:
        self.vault = vault
        self.background = background

    def find(self, ask: Ask) -> Candidate | None:
        cut = self.vault.find(
            ask.scope, ask.chain, deeper_than=ask.deeper_than, at_most=ask.at_most
        )
        return None if cut is None else Candidate(self.name, cut.depth, cut)

    def load(self, candidate: Candidate, ask: Ask) -> Loaded:
        loaded = self.vault.load(candidate.handle, ask.scope)
        m = loaded.manifest
        planes = Planes(layout=m.layout, parts=tuple(loaded.parts))
        return Loaded(cut=planes, manifest_bytes=m.bytes)

    def served(self, candidate: Candidate, ask: Ask) -> None:
        manifest_id = candidate.handle.manifest_id
        self.background.submit("hit", lambda: self.vault.touch_cut(manifest_id))

    def refused(self, candidate: Candidate, error: BaseException) -> None:
        return None  # the row stays listed: the next request meets the same refusal
