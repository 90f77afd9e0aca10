"""The ladder as a loop over tiers, with fake tiers and fake slots: every order, the cap,
fall-through on refusals and outages, when a peer is asked, and what a hit sets off.

The fakes implement the tier protocol (kvpack/tiers/base.py) over a table depth ->
outcome; the slots record what was installed. Nothing here needs the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from cas.errors import ChunkCorrupt, StoreUnavailable
from cas.ids import ChunkId
from catalog.ids import IdentityDigest
from catalog.scope import Scope
from engine.errors import RestoreRefused
from kvpack.accounting.counters import Accounting
from kvpack.accounting.pairing import PrefillClock
from kvpack.background import Background
from kvpack.tiers.base import Ask, Candidate, Loaded
from kvpack.tiers.ladder import Ladder

A = 4
SCOPE = Scope(IdentityDigest(bytes(32 * [3])), "default", A)
PROMPT = list(range(10, 20))  # 10 tokens: aligned links at 4 and 8, the end at 10
OK, CORRUPT, REFUSED_BY_ENGINE, DOWN = "ok", "corrupt", "engine refuses", "down"


@dataclass
class FakeTier:
    """Serves the depths in `cuts`, each with an outcome when loaded."""

    name: str
    cuts: dict[int, str] = field(default_factory=dict)
    find_down: bool = False
    asks: list[Ask] = field(default_factory=list)
    loads: list[int] = field(default_factory=list)
    served_at: list[int] = field(default_factory=list)
    refused_at: list[int] = field(default_factory=list)
    held: list[tuple[int, str]] = field(default_factory=list)

    def find(self, ask: Ask) -> Candidate | None:
        self.asks.append(ask)
        if self.find_down:
            raise StoreUnavailable("find", "x", "down")
        top = ask.depth if ask.at_most is None else min(ask.at_most, ask.depth)
        depths = [d for d in self.cuts if ask.deeper_than < d <= top]
        return Candidate(self.name, max(depths), None) if depths else None

    def load(self, candidate: Candidate, ask: Ask) -> Loaded:
        self.loads.append(candidate.depth)
        outcome = self.cuts[candidate.depth]
        if outcome == CORRUPT:
            raise ChunkCorrupt(ChunkId(bytes(32)), "flipped")
        if outcome == DOWN:
            raise StoreUnavailable("get", "x", "reset")
        cut = f"{self.name}@{candidate.depth}" + ("!" if outcome == REFUSED_BY_ENGINE else "")
        if self.name == "resident":
            return Loaded(cut, estimated_bytes=candidate.depth)  # type: ignore[arg-type]
        return Loaded(cut, manifest_bytes=candidate.depth)  # type: ignore[arg-type]

    def served(self, candidate: Candidate, ask: Ask) -> None:
        self.served_at.append(candidate.depth)

    def refused(self, candidate: Candidate, error: BaseException) -> None:
        self.refused_at.append(candidate.depth)

    def hold(self, scope: Scope, tokens, cut) -> None:
        self.held.append((len(tokens), cut))


class FakeSlot:
    index = 0
    tokens: tuple[int, ...] = ()
    logits_witnessed = False

    def __init__(self) -> None:
        self.installed: list[str] = []
        self.resets = 0
        self.resets_at_restore: list[int] = []

    @property
    def depth(self) -> int:
        return len(self.tokens)

    def restore(self, cut: str, *, prompt) -> None:
        self.resets_at_restore.append(self.resets)
        if cut.endswith("!"):
            raise RestoreRefused("shape gate")
        self.installed.append(cut)

    def reset(self) -> None:
        self.resets += 1


class FakeTenant:
    scope = SCOPE
    namespace = SCOPE.namespace

    def __init__(self, session: FakeSlot | None = None) -> None:
        self.slot, self.session = FakeSlot(), session

    def session_slot(self, tokens):
        return self.session

    def lru_slot(self) -> FakeSlot:
        return self.slot

    def touch(self, slot) -> None:
        return None


@dataclass
class Rig:
    resident: FakeTier
    durable: FakeTier
    remote: FakeTier
    ladder: Ladder
    accounting: Accounting
    background: Background

    def serve(self, tenant: FakeTenant | None = None):
        tenant = tenant or FakeTenant()
        installed = self.ladder.serve(tenant, PROMPT)  # type: ignore[arg-type]
        assert self.background.flush(5)
        return installed, tenant.slot

    def count(self, name: str, **labels: str) -> float:
        return self.accounting.total(name, **labels)


@pytest.fixture
def rig():
    resident, durable, remote = FakeTier("resident"), FakeTier("durable"), FakeTier("remote")
    accounting, background = Accounting(per_namespace=True), Background()
    ladder = Ladder(
        authority=durable,
        caches=[resident],
        peers=[remote],
        accounting=accounting,
        background=background,
        clock=PrefillClock(),
        record_timing=lambda timing: None,
    )
    yield Rig(resident, durable, remote, ladder, accounting, background)
    background.close()


def test_resident_at_the_authoritys_depth_serves_first(rig):
    """Equal depth: the cache before the authority; the cache is asked no deeper than
    the authority's cut (invariant 2), and a resident hit fills nothing."""
    rig.durable.cuts, rig.resident.cuts = {8: OK}, {8: OK, 10: OK}
    installed, slot = rig.serve()
    assert (installed.tier, installed.depth, slot.installed) == ("resident", 8, ["resident@8"])
    assert rig.resident.asks[0].at_most == 8
    assert rig.durable.loads == [] and rig.resident.served_at == [8]
    assert rig.resident.held == []
    assert rig.count("kvpack_hits_total", tier="resident") == 1


def test_a_shallower_cache_cut_does_not_beat_the_authoritys_deeper_one(rig):
    rig.durable.cuts, rig.resident.cuts = {8: OK}, {4: OK}
    installed, slot = rig.serve()
    assert (installed.tier, installed.depth) == ("durable", 8)
    assert rig.resident.loads == []


def test_no_authority_cut_means_no_cache_hit(rig):
    """Invariant 2: without a durable cut the cap is 0 and the cache serves nothing."""
    rig.resident.cuts = {8: OK, 10: OK}
    installed, slot = rig.serve()
    assert installed.tier == "none" and rig.resident.loads == [] and slot.resets == 1


def test_an_authority_outage_plans_nothing_and_fails_closed(rig):
    """Invariant 9 / fail closed: the cap is unknown, so no cache may serve, and a peer's
    cut could not be promoted: a miss, no verification failure counted."""
    rig.durable.find_down = True
    rig.resident.cuts, rig.remote.cuts = {8: OK}, {10: OK}
    installed, slot = rig.serve()
    assert installed.tier == "none" and slot.resets == 1
    assert rig.resident.asks == [] and rig.remote.asks == []
    assert rig.count("kvpack_misses_total") == 1
    assert rig.count("kvpack_verification_failures_total") == 0


@pytest.mark.parametrize("failure", [CORRUPT, REFUSED_BY_ENGINE])
def test_a_refused_cache_cut_falls_through_to_the_authority_and_is_counted(rig, failure):
    rig.durable.cuts, rig.resident.cuts = {8: OK}, {8: failure}
    installed, slot = rig.serve()
    assert (installed.tier, slot.installed) == ("durable", ["durable@8"])
    assert rig.resident.refused_at == [8]
    assert rig.count("kvpack_verification_failures_total", tier="resident") == 1
    assert rig.resident.held == [(8, "durable@8")]  # the cache is filled from below


def test_a_refused_authority_cut_falls_through_to_a_miss(rig):
    rig.durable.cuts = {10: CORRUPT}
    installed, slot = rig.serve()
    assert installed.tier == "none" and slot.resets == 1
    assert rig.durable.refused_at == [10]
    assert rig.count("kvpack_verification_failures_total", tier="durable") == 1
    assert rig.count("kvpack_misses_total") == 1


def test_an_outage_while_loading_falls_through_uncounted(rig):
    rig.durable.cuts, rig.resident.cuts = {8: OK}, {8: DOWN}
    installed, _ = rig.serve()
    assert installed.tier == "durable"
    assert rig.count("kvpack_verification_failures_total") == 0
    assert rig.resident.refused_at == []


def test_a_peer_is_asked_to_beat_a_shallow_local_cut_and_wins(rig):
    """The remote tier is asked whenever a peer could beat the best local candidate,
    not only on a full miss: deeper_than the local depth; its deeper cut goes first."""
    rig.durable.cuts, rig.remote.cuts = {4: OK}, {10: OK}
    installed, slot = rig.serve()
    assert (installed.tier, installed.depth, slot.installed) == ("remote", 10, ["remote@10"])
    assert rig.remote.asks[0].deeper_than == 4
    assert rig.durable.loads == []
    assert rig.resident.held == [(10, "remote@10")]


def test_a_refused_peer_cut_falls_back_to_the_local_one(rig):
    rig.durable.cuts, rig.remote.cuts = {8: OK}, {10: CORRUPT}
    installed, _ = rig.serve()
    assert (installed.tier, installed.depth) == ("durable", 8)
    assert rig.count("kvpack_verification_failures_total", tier="remote") == 1


def test_no_peer_is_asked_when_a_local_cut_is_exact(rig):
    rig.durable.cuts, rig.remote.cuts = {10: OK}, {10: OK}
    installed, _ = rig.serve()
    assert installed.tier == "durable" and rig.remote.asks == []


def test_a_peer_is_asked_on_a_full_miss(rig):
    rig.remote.cuts = {8: OK}
    installed, _ = rig.serve()
    assert (installed.tier, installed.depth) == ("remote", 8)
    assert rig.remote.asks[0].deeper_than == 0


def test_a_session_continuation_asks_no_tier_and_is_never_a_hit(rig):
    rig.durable.cuts = {10: OK}
    session = FakeSlot()
    session.tokens = tuple(PROMPT[:6])
    installed, _ = rig.serve(FakeTenant(session))
    assert (installed.tier, installed.depth) == ("session", 6)
    assert rig.durable.asks == [] and rig.count("kvpack_hits_total") == 0
    assert rig.count("kvpack_session_continuations_total") == 1


def test_only_a_committed_restore_counts_and_bills_its_tier(rig):
    """Invariant 4 and 7: one hit per committed restore, billed from the manifest for the
    authority and as an estimate for the cache; nothing for a refused one."""
    rig.durable.cuts, rig.resident.cuts = {8: OK}, {8: REFUSED_BY_ENGINE}
    rig.serve()
    assert rig.count("kvpack_hits_total") == 1
    assert rig.count("kvpack_bytes_served_total", tier="durable") == 8
    assert rig.count("kvpack_resident_bytes_served_estimate_total") == 0
    rig.resident.cuts = {8: OK}
    rig.serve()
    assert rig.count("kvpack_resident_bytes_served_estimate_total") == 8


def test_the_slot_is_emptied_before_a_restore_and_once_in_all(rig):
    """The slot a restore goes into holds nothing this request uses (no session matched)
    and every outcome replaces it, so it is reset before the first install — its memory
    then serves the shadow — and not again, on a hit after a refusal or on a miss."""
    rig.durable.cuts, rig.resident.cuts = {8: OK}, {8: REFUSED_BY_ENGINE}
    installed, slot = rig.serve()
    assert installed.tier == "durable" and slot.resets_at_restore == [1, 1]
    assert slot.resets == 1
    rig.durable.cuts, rig.resident.cuts = {}, {}
    installed, slot = rig.serve()
    assert installed.tier == "none" and slot.resets == 1 and slot.resets_at_restore == []
