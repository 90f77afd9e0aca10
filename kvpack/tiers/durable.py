"""The durable tier: the vault's catalog and object store, the sole authority.

- find: one `find_deepest` query (catalog/queries.py) over the ask's token chain. Its
  answer carries the catalog row's facts and, from a remote store, the row's chunk
  list, so load does not read the catalog again.
- load: the manifest object, its MAC and its agreement with the row (catalog/publish.py
  open_cut), with the chunks' fetch started (kvpack/vault.py read_cut: from a remote
  store at once, as the catalog lists them, so one round trip comes before the bytes
  flow, not two; a manifest that lists other chunks than its row is refused). What load
  returns is a reader (CutReader), not yet the bytes.
- reader: a verified manifest as an engine Source (engine/intake.py). The installer makes
  the intake for the manifest's layout on the thread that runs MLX — the shadow caches
  the cut becomes — and hands the reader its destinations: every chunk, fetched
  concurrently into scratch buffers meanwhile (cas ChunkStore.get_into), or, from a
  local directory, mapped once the destinations exist (ChunkStore.open_mapped), is
  decrypted, re-hashed and copied into them, its tag checked. Nothing is decoded,
  joined or copied after that, and kvpack never decodes the parts. A fetch that fails or a
  chunk that does not verify raises out of the install before the swap: the slot keeps
  what it had, and the ladder falls through (an outage uncounted; a verification
  failure counted and condemned). A reader no install filled is closed by the ladder,
  which stops its fetch.
  After a restore, `installed` is the Snapshot it became (views of the restored caches,
  each part with its verified frame digest): what the ladder promotes into the caches.
- served: the cut's catalog row is stamped as hit (GC evicts the least recently hit
  first): a job the ladder runs in the background once the request is served, not
  beside its first token.
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
from collections.abc import Callable, Mapping
from typing import Any

from catalog.condemn import broken_chunk, kind_of
from catalog.ids import IdentityDigest
from catalog.queries import Cut
from catalog.scope import Scope
from engine.errors import RestoreRefused
from engine.intake import Intake
from engine.state import Snapshot
from kvpack.accounting.counters import Accounting
from kvpack.tiers.base import OUTAGES, Ask, Candidate, Loaded, TierName
from kvpack.vault import ChunkReading, Vault

log = logging.getLogger(__name__)


class CutReader:
    """A durable cut whose manifest is verified and whose chunks are on their way, read
    into an intake on demand (a Source)."""

    def __init__(self, reading: ChunkReading) -> None:
        self.reading, self.manifest = reading, reading.manifest
        self._intake: Intake | None = None

    @classmethod
    def open(cls, vault: Vault, cut: Cut, scope: Scope) -> CutReader:
        """The reader of a catalog cut: its manifest opened and checked against the row,
        its chunks already fetched meanwhile (kvpack/vault.py read_cut)."""
        return cls(vault.read_cut(cut, scope))

    @property
    def layout(self) -> Mapping[str, Any]:
        return self.manifest.layout

    @property
    def depth(self) -> int:
        return self.manifest.depth

    def fill(self, intake: Intake) -> None:
        """Every chunk straight into the intake's destinations, verified, the fetch under
        way while the intake allocates them; raises cas's typed errors (or a TimeoutError)
        with the intake half-filled and unusable."""
        parts = [(p.role, p.size) for p in self.manifest.parts]
        self.reading.into(lambda: intake.destinations(parts), intake.evaluate_parts)
        self._intake = intake

    def close(self) -> None:
        """Stop the fetch of a reader no install filled (a refused layout, say)."""
        self.reading.cancel()

    @property
    def installed(self) -> Snapshot | None:
        """The Snapshot the reader was restored as (None before a restore took it)."""
        intake = self._intake
        return intake.snapshot if intake is not None and intake.taken else None


class DurableTier:
    name: TierName = "durable"

    def __init__(self, vault: Vault, *, accounting: Accounting | None = None) -> None:
        self.vault = vault
        self.accounting = accounting

    def find(self, ask: Ask) -> Candidate | None:
        cut = self.vault.find(
            ask.scope, ask.chain, deeper_than=ask.deeper_than, at_most=ask.at_most
        )
        return None if cut is None else Candidate(self.name, cut.depth, cut)

    def load(self, candidate: Candidate, ask: Ask) -> Loaded:
        reader = CutReader.open(self.vault, candidate.handle, ask.scope)
        return Loaded(cut=reader, manifest_bytes=reader.manifest.bytes)

    def served(self, candidate: Candidate, ask: Ask) -> Callable[[], object]:
        manifest_id = candidate.handle.manifest_id
        return lambda: self.vault.touch_cut(manifest_id)

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
