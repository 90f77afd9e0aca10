"""The durable tier: the vault's catalog and object store, the sole authority.

- find: one `find_deepest` query (catalog/queries.py) over the ask's token chain. Its
  answer carries the catalog row's facts, so load needs no second catalog read.
- load: the manifest object, its MAC and its agreement with the row, then every chunk
  fetched concurrently, tag-verified and re-hashed (catalog/publish.py load_cut). The
  engine gets the verified parts as Planes; kvpack never decodes them.
- served: the cut's catalog row is stamped as hit, off the response path (GC evicts the
  least recently hit first).
- refused: the cut failed verification (its manifest object gone or failing its checks,
  a chunk corrupt or missing, the engine's gate): it is condemned at once
  (catalog/condemn.py), so find never offers it again, and counted in
  kvpack_condemned_cuts_total{reason}. The request recomputes, and the recompute's
  publication republishes the history cleanly: the next identical request is a durable
  hit again. A condemnation that cannot reach storage is logged; the next refusal tries
  again.
"""

from __future__ import annotations

import logging

from catalog.condemn import broken_chunk, kind_of
from catalog.ids import IdentityDigest
from engine.errors import RestoreRefused
from engine.state import Planes
from kvpack.accounting.counters import Accounting
from kvpack.background import Background
from kvpack.tiers.base import OUTAGES, Ask, Candidate, Loaded, TierName
from kvpack.vault import Vault

log = logging.getLogger(__name__)


class DurableTier:
    name: TierName = "durable"

    def __init__(
        self, vault: Vault, background: Background, *, accounting: Accounting | None = None
    ) -> None:
        self.vault = vault
        self.background = background
        self.accounting = accounting

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
        cut = candidate.handle
        kind = "restore_refused" if isinstance(error, RestoreRefused) else kind_of(error)
        try:
            condemned = self.vault.condemn(
                cut.manifest_id, kind=kind, reason=str(error), chunk=broken_chunk(error)
            )
        except OUTAGES as e:
            log.warning("could not condemn cut %s (%s): %s", cut.manifest_id, kind, e)
            return
        for c in condemned:
            log.warning("condemned cut %s (identity %s, depth %d): %s: %s", c.manifest_id,
                        c.identity[:12], c.depth, c.kind, c.reason)  # fmt: skip
        if self.accounting is not None and condemned:
            self.accounting.count_condemned(
                reason=kind, cuts=len(condemned), namespace=self._namespace(cut.identity)
            )

    def _namespace(self, identity: IdentityDigest) -> str | None:
        """The tenant of a refused cut (refusals are rare: one catalog read)."""
        try:
            namespace = (self.vault.identity_components(identity) or {}).get("namespace")
        except OUTAGES:
            return None
        return namespace if isinstance(namespace, str) and namespace else None
