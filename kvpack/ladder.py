"""The reuse ladder: where a request's prefix state comes from (DESIGN flow step 2).

Tiers, in order; the first that can serve stops the climb:
- session: a live slot's history is a prefix of the request (equal only with witnessed
  logits) → continue in that slot. A session continuation, never a hit.
- resident: the deepest cut in this process's radix for the identity, capped by the
  deepest durable-authenticated cut (invariant 2). It serves only when it reaches that
  cap; a shallower resident cut leaves the deeper durable cut to serve.
- durable: `find_deepest` → concurrent verified chunk fetch → planes.decode → restore.
- remote: a RemoteTier asks peers; whatever it promotes into the local durable tier is
  re-resolved there and counted as a remote hit. `NoPeers` always falls through.
- miss: the least recently used slot, reset, prefilled from scratch.

A hit is recorded only from the receipt of a committed restore (invariant 4). Any
verification failure (a corrupt or missing chunk, a manifest that fails its MAC or
names another identity, planes the engine refuses) is counted and falls through —
never wrong output; a storage outage (store unreachable, catalog errors, timeouts) falls
through uncounted — slower, never failed (invariant 9).

Tenant: one namespace's engine. Its identity carries the namespace salt, so every
lookup is scoped to it and a state of another tenant or model is unreachable (inv. 1).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sqlalchemy.exc import SQLAlchemyError

from cas.errors import ChunkCorrupt, ChunkMissing, StoreUnavailable, UnknownKey
from catalog.chain import TokenChain
from catalog.errors import CutMissing, ManifestInvalid, StaleGeneration
from catalog.errors import IdentityMismatch as CatalogIdentityMismatch
from catalog.queries import Cut
from engine import planes
from engine.errors import RestoreRefused
from engine.identity import Identity
from engine.restore import restore
from engine.slots import Engine, Slot
from engine.snapshot import Snapshot
from kvpack.accounting import Accounting, CommittedRestore, Tier, commit_restore
from kvpack.durable import DurableTier
from kvpack.pairing import PrefillClock
from kvpack.publisher import Publisher
from kvpack.resident import ResidentTier

log = logging.getLogger(__name__)

VERIFICATION_FAILURES = (
    ChunkCorrupt,
    ChunkMissing,
    UnknownKey,
    ManifestInvalid,
    CatalogIdentityMismatch,
    StaleGeneration,
    RestoreRefused,  # engine: identity, shape, logits, corrupt planes, shadow build
)
OUTAGES = (StoreUnavailable, SQLAlchemyError, TimeoutError, CutMissing)


class RemoteTier(Protocol):
    def pull(
        self, *, identity: Identity, tokens: Sequence[int], alignment: int, min_depth: int
    ) -> bool:
        """Ask peers for a cut deeper than `min_depth`; True when one was verified and
        promoted into the local durable tier (the ladder then re-resolves it there)."""
        ...


class NoPeers:
    """No peer configured: the remote tier always falls through."""

    def pull(
        self, *, identity: Identity, tokens: Sequence[int], alignment: int, min_depth: int
    ) -> bool:
        return False


@dataclass
class Tenant:
    """One namespace: its identity and an engine whose slots only it uses."""

    namespace: str
    identity: Identity
    engine: Engine
    _ticks: dict[int, int] = field(default_factory=dict)
    _clock: itertools.count = field(default_factory=itertools.count)

    def touch(self, slot: Slot) -> None:
        self._ticks[slot.index] = next(self._clock)

    def lru_slot(self) -> Slot:
        return min(self.engine.slots, key=lambda s: self._ticks.get(s.index, -1))

    def session_slot(self, tokens: Sequence[int]) -> Slot | None:
        """The deepest slot whose history is a prefix of `tokens` (equal: logits witnessed)."""
        best = None
        for slot in self.engine.slots:
            history = slot.tokens
            if not history or len(history) > len(tokens):
                continue
            if len(history) == len(tokens) and not slot.logits_witnessed:
                continue
            if tuple(tokens[: len(history)]) == history and (
                best is None or slot.depth > best.depth
            ):
                best = slot
        return best


@dataclass(frozen=True)
class Served:
    slot: Slot
    tier: str  # "session" | "resident" | "durable" | "remote" | "none"
    depth: int  # tokens the tier supplied
    restore_seconds: float = 0.0


class Ladder:
    def __init__(
        self,
        *,
        resident: ResidentTier,
        durable: DurableTier,
        remote: RemoteTier,
        publisher: Publisher,
        accounting: Accounting,
        clock: PrefillClock,
    ) -> None:
        self.resident = resident
        self.durable = durable
        self.remote = remote
        self.publisher = publisher
        self.accounting = accounting
        self.clock = clock

    def serve(self, tenant: Tenant, tokens: Sequence[int], chain: TokenChain) -> Served:
        """Install the deepest available state for `tokens` in a slot of `tenant`."""
        ns = tenant.namespace
        slot = tenant.session_slot(tokens)
        if slot is not None:
            tenant.touch(slot)
            self.accounting.record_session_continuation(namespace=ns)
            return Served(slot, "session", slot.depth)
        slot = tenant.lru_slot()
        tenant.touch(slot)
        cut = self._deepest(tenant, chain)
        cap = cut.depth if cut is not None else 0
        served = self._resident(tenant, tokens, chain, slot, cap) if cut is not None else None
        if served is None and cut is not None:
            served = self._durable(tenant, tokens, chain, slot, cut, "durable")
        if served is None and self.remote.pull(
            identity=tenant.identity, tokens=tokens, alignment=self.durable.alignment, min_depth=cap
        ):
            cut = self._deepest(tenant, chain)
            if cut is not None and cut.depth > cap:
                served = self._durable(tenant, tokens, chain, slot, cut, "remote")
        if served is None:
            slot.reset()
            self.accounting.record_miss(namespace=ns)
            served = Served(slot, "none", 0)
        return served

    # -- tiers ------------------------------------------------------------------------

    def _deepest(self, tenant: Tenant, chain: TokenChain) -> Cut | None:
        try:
            return self.durable.deepest(identity=tenant.identity.digest, chain=chain)
        except OUTAGES as e:
            # Unknown cap: the resident tier may not serve either (fail closed).
            log.warning("durable lookup unavailable, recomputing: %s", e)
            return None

    def _resident(
        self, tenant: Tenant, tokens: Sequence[int], chain: TokenChain, slot: Slot, cap: int
    ) -> Served | None:
        cut = self.resident.lookup(
            identity=tenant.identity.digest,
            tokens=tokens,
            alignment=self.durable.alignment,
            cap_depth=cap,
        )
        if cut is None or cut.depth < cap:
            return None
        started = time.perf_counter()
        try:
            snap = planes.decode(dict(cut.layout), cut.parts)
            _, receipt = commit_restore(
                lambda: _install(slot, snap, tokens),
                tier="resident",
                depth=cut.depth,
                estimated_bytes=self.resident.estimated_bytes(cut),
                namespace=tenant.namespace,
                started_at=started,
            )
        except RestoreRefused as e:
            log.warning("resident cut at depth %d refused: %s", cut.depth, e)
            self.accounting.record_verification_failure(tier="resident", namespace=tenant.namespace)
            self.resident.discard(cut)
            return None
        return self._hit(tenant, chain, slot, receipt)

    def _durable(
        self,
        tenant: Tenant,
        tokens: Sequence[int],
        chain: TokenChain,
        slot: Slot,
        cut: Cut,
        tier: Tier,
    ) -> Served | None:
        started = time.perf_counter()
        try:
            loaded = self.durable.load(
                namespace=tenant.namespace, identity=tenant.identity.digest, cut=cut
            )
            snap = planes.decode(dict(loaded.manifest.layout), loaded.planes)
            _, receipt = commit_restore(
                lambda: _install(slot, snap, tokens),
                tier=tier,
                depth=cut.depth,
                manifest_bytes=loaded.manifest.bytes,
                namespace=tenant.namespace,
                started_at=started,
            )
        except VERIFICATION_FAILURES as e:
            log.warning("%s cut %s refused, recomputing: %s", tier, cut.manifest_id, e)
            self.accounting.record_verification_failure(tier=tier, namespace=tenant.namespace)
            return None
        except OUTAGES as e:
            log.warning("%s cut %s unavailable, recomputing: %s", tier, cut.manifest_id, e)
            return None
        self.publisher.hit(cut.manifest_id)
        self.publisher.promote(tenant, tokens[: cut.depth], loaded)
        return self._hit(tenant, chain, slot, receipt)

    def _hit(
        self, tenant: Tenant, chain: TokenChain, slot: Slot, receipt: CommittedRestore
    ) -> Served:
        self.accounting.record_hit(receipt)
        digest = tenant.identity.digest
        entry = self.clock.pair(
            identity=digest, chain_digest=chain.at(receipt.depth), receipt=receipt
        )
        if entry is not None:
            self.publisher.pair(entry)
        return Served(slot, receipt.tier, receipt.depth, receipt.restore_seconds)


def _install(slot: Slot, snap: Snapshot, tokens: Sequence[int]) -> None:
    """Restore `snap` as the first snap.depth tokens of `tokens`: the whole request needs
    witnessed logits (exact), a shorter cut is an aligned ancestor."""
    mode = "exact" if snap.depth == len(tokens) else "ancestor"
    restore(slot, snap, tokens=tokens[: snap.depth], mode=mode)
