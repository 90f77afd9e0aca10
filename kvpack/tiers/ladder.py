"""The reuse ladder: where a request's prefix state comes from (docs/architecture.md: step 3).

Every tier answers the same two questions (kvpack/tiers/base.py). The ladder:
1. session: a live slot of the tenant whose history is a prefix of the request
   continues there — a session continuation, never a hit (kvpack/tiers/session.py).
2. plan: ask the authority (the durable tier) for its deepest cut; ask each cache (the
   resident tier) for a cut no deeper than that (invariant 2: durable caps resident),
   used only when it reaches the authority's depth; then, unless a local candidate is
   exact already, ask each peer tier (remote) for a deeper cut than the best local one.
   If the authority cannot answer (an outage) nothing is planned: the cap is unknown, so
   no cache may serve (fail closed), and a peer's cut could not be promoted anyway.
3. load: candidates deepest first (at equal depth, caches before the authority); load,
   install through the engine's shadow -> gate -> swap, and stop at the first that
   commits. A verification failure is counted and falls through, an outage falls
   through uncounted (invariant 9); the engine refuses anything that does not fit.
4. a hit: counted from the committed-restore receipt only (invariant 4); the tier that
   served is told (LRU, catalog hit stamp), the caches are filled with the state that a
   slower tier served (as installed: a reader's Snapshot, so nothing is read or decoded
   again), and a paired timing is recorded when this process prefilled the same cut.
   The stamp, the fill and the timing run in the background, never on the response
   path; `serve` may be given an `after_served` that holds them back until the request
   is served (the service's, kvpack/service/publication.py), so that none of them runs
   beside the request's first token.
5. miss: the slot is reset and the request prefills from scratch.
Steps 2-5 are `restore(ask, install)` for any installer: `serve` installs into a slot,
kvpack/service/interop.py into mlx-lm's own caches (the same gate and build, so a hit).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from catalog.ledger import PairedTiming
from engine.slots import Slot
from engine.state import Planes, Snapshot
from kvpack.accounting.counters import Accounting, CommittedRestore, commit_restore
from kvpack.accounting.pairing import PrefillClock
from kvpack.background import Background
from kvpack.tiers.base import OUTAGES, VERIFICATION_FAILURES, Ask, Cache, Candidate, Cut, Tier
from kvpack.tiers.session import Tenant

log = logging.getLogger(__name__)
T = TypeVar("T")
Submit = Callable[[str, Callable[[], object]], bool]  # Background.submit's shape


@dataclass(frozen=True)
class Installed:
    """Where a request's prefix came from: the slot it is in and the tier that served it."""

    slot: Slot
    tier: str  # "session" | "resident" | "durable" | "remote" | "none"
    depth: int  # tokens the tier supplied
    restore_seconds: float = 0.0
    restore_bytes: int = 0  # the receipt's manifest bytes (or the resident estimate)


class Ladder:
    def __init__(
        self,
        *,
        authority: Tier,
        caches: Sequence[Cache],
        peers: Sequence[Tier] = (),
        accounting: Accounting,
        background: Background,
        clock: PrefillClock,
        record_timing: Callable[[PairedTiming], None],
    ) -> None:
        self.authority = authority
        self.caches = list(caches)
        self.peers = list(peers)
        self.accounting = accounting
        self.background = background
        self.clock = clock
        self.record_timing = record_timing

    @property
    def tiers(self) -> dict[str, Tier]:
        return {t.name: t for t in (self.authority, *self.caches, *self.peers)}

    def serve(
        self, tenant: Tenant, tokens: Sequence[int], *, after_served: Submit | None = None
    ) -> Installed:
        """Install the deepest available state for `tokens` in a slot of `tenant`;
        `after_served` takes a hit's background work (default: the background, at once)."""
        ns = tenant.namespace
        slot = tenant.session_slot(tokens)
        if slot is not None:
            tenant.touch(slot)
            self.accounting.count_session_continuation(namespace=ns)
            return Installed(slot, "session", slot.depth)
        slot = tenant.lru_slot()
        tenant.touch(slot)
        # Nothing the slot holds serves this request (the session rung found nothing), and
        # every outcome replaces it: emptied first, its memory serves the restore's shadow.
        slot.reset()
        ask = Ask.of(tenant.scope, tokens)
        found = self.restore(ask, lambda cut: slot.restore(cut, prompt=ask.tokens), after_served)
        if found is None:
            return Installed(slot, "none", 0)
        _, receipt = found
        restored = receipt.manifest_bytes or receipt.estimated_bytes or 0
        return Installed(slot, receipt.tier, receipt.depth, receipt.restore_seconds, restored)

    def restore(
        self, ask: Ask, install: Callable[[Cut], T], after_served: Submit | None = None
    ) -> tuple[T, CommittedRestore] | None:
        """Steps 2-5 without the session rung: the planned candidates, deepest first,
        through `install` (a slot's restore, or mlx-lm caches built through the same gate);
        the first that returns is the hit, with its result. None is a miss (counted)."""
        tiers = self.tiers
        for candidate in self.plan(ask):
            found = self._try(tiers[candidate.tier], candidate, ask, install, after_served)
            if found is not None:
                return found
        self.accounting.count_miss(namespace=ask.scope.namespace)
        return None

    def plan(self, ask: Ask) -> list[Candidate]:
        """Every candidate worth loading, in the order to try them (no side effects)."""
        try:
            best = self.authority.find(ask)
        except OUTAGES as e:
            log.warning("%s lookup unavailable, recomputing: %s", self.authority.name, e)
            return []
        cap = best.depth if best is not None else 0
        local = [c for c in (self._find(t, ask.bounded(at_most=cap)) for t in self.caches) if c]
        local = [c for c in local if best is not None and c.depth == best.depth]
        local += [best] if best is not None else []
        if cap == ask.depth:
            return local  # exact already: no peer can beat it
        remote = [self._find(t, ask.bounded(deeper_than=cap)) for t in self.peers]
        deeper = sorted((c for c in remote if c), key=lambda c: -c.depth)
        return deeper + local

    def _find(self, tier: Tier, ask: Ask) -> Candidate | None:
        try:
            return tier.find(ask)
        except OUTAGES as e:
            log.warning("%s lookup unavailable: %s", tier.name, e)
            return None

    def _try(
        self,
        tier: Tier,
        candidate: Candidate,
        ask: Ask,
        install: Callable[[Cut], T],
        after_served: Submit | None,
    ) -> tuple[T, CommittedRestore] | None:
        started = time.perf_counter()
        try:
            loaded = tier.load(candidate, ask)
            try:
                result, receipt = commit_restore(
                    lambda: install(loaded.cut),
                    tier=tier.name,
                    depth=candidate.depth,
                    manifest_bytes=loaded.manifest_bytes,
                    estimated_bytes=loaded.estimated_bytes,
                    namespace=ask.scope.namespace,
                    started_at=started,
                )
            finally:
                loaded.close()
        except VERIFICATION_FAILURES as e:
            log.warning(
                "%s cut at depth %d refused, recomputing: %s", tier.name, candidate.depth, e
            )
            self.accounting.count_verification_failure(
                tier=tier.name, namespace=ask.scope.namespace
            )
            tier.refused(candidate, e)
            return None
        except OUTAGES as e:
            log.warning("%s cut at depth %d unavailable: %s", tier.name, candidate.depth, e)
            return None
        later = after_served or self.background.submit
        stamp = tier.served(candidate, ask)
        held = loaded.holdable()
        if tier not in self.caches and held is not None:
            self._fill(ask, candidate.depth, held, later)
        if stamp is not None:  # after the fill, which a next ask for this cut may use
            later(f"hit {tier.name}@{candidate.depth}", stamp)
        self._hit(ask, receipt, later)
        return result, receipt

    def _fill(self, ask: Ask, depth: int, cut: Snapshot | Planes, submit: Submit) -> None:
        """Hold state a slower tier served in every cache (off the response path). A
        reader's Snapshot is views of the slot's buffers: the cache copies what it does
        not hold yet, and while that job holds them the slot's next write into a buffer
        copies that buffer first (MLX arrays are values), once."""
        tokens = ask.tokens[:depth]
        for cache in self.caches:
            submit(f"fill {cache.name}@{depth}", partial(cache.hold, ask.scope, tokens, cut))

    def _hit(self, ask: Ask, receipt: CommittedRestore, later: Submit) -> None:
        self.accounting.count_hit(receipt)
        timing = self.clock.pair(
            identity=ask.scope.identity, chain=ask.chain.at(receipt.depth), receipt=receipt
        )
        if timing is not None:
            later("pair", lambda: self.record_timing(timing))
