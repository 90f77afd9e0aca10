"""Background work off the response path, a peer tier that promotes, and paired timings."""

from __future__ import annotations

import threading

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from catalog.models import ChunkRow
from engine.format import encode
from engine.models import load_model
from engine.slots import SlotPool
from kvpack.background import Background
from kvpack.config import Settings
from kvpack.service.service import CompletionRequest, run_steps
from kvpack.tiers.base import Candidate
from tests.engine.slotkit import TINY_A, prompt
from tests.engine.test_streams import released_on
from tests.kvpack.service.test_service import MAX, P, ask, deepest_cut, resident_cut


def test_full_queue_drops_with_count_and_never_blocks():
    """Branch: Background.submit on a full queue returns False at once and counts a drop;
    flush waits for queued jobs; a failing job is counted, never raised; after close
    nothing is taken."""
    pub = Background(capacity=1)
    started, gate, ran = threading.Event(), threading.Event(), []

    def blocker() -> None:
        started.set()
        gate.wait(10)

    assert pub.submit("blocker", blocker)
    assert started.wait(5)  # the worker holds the blocker; the queue is empty
    assert pub.submit("queued", lambda: ran.append(1))
    assert not pub.submit("dropped", lambda: ran.append(2))  # returns while the worker waits
    assert not pub.flush(0.05)
    gate.set()
    assert pub.flush(5) and ran == [1]
    assert pub.submit("fails", lambda: 1 / 0) and pub.flush(5)
    assert pub.close(5)
    assert not pub.submit("late", lambda: ran.append(3))
    assert pub.stats() == {"queued": 0, "done": 2, "failed": 1, "dropped": 2}


def test_the_worker_releases_its_mlx_streams_as_it_ends(monkeypatch):
    """The worker's jobs copy MLX arrays; its last act is to release its streams (MLX 0.32
    can abort the process at exit otherwise: engine/streams.py)."""
    released = released_on(monkeypatch)
    pub = Background(capacity=2)
    assert pub.submit("job", lambda: None) and pub.flush(5) and released == []
    assert pub.close(5)
    assert released == ["kvpack-background"]


class PeerThatPromotes:
    """A peer tier stand-in: a peer computed the cut; load() stores it into the local
    vault (as kvpack/remote/importer.py's promotion does), then serves it back from there."""

    name = "remote"

    def __init__(self, svc):
        self.svc, self.loads = svc, 0

    def find(self, ask):
        return Candidate(self.name, ask.depth, None)

    def load(self, candidate, ask):
        self.loads += 1
        loaded = load_model("tiny", alignment=TINY_A, namespace="default")
        slot = SlotPool(loaded, num_slots=1).slot(0)
        slot.prefill(list(ask.tokens))
        planes = encode(slot.export())
        self.svc.vault.publish(
            ask.scope, ask.tokens, layout=planes.layout, parts=planes.parts,
            logits_witnessed=True,
        )  # fmt: skip
        return self.svc.durable.load(self.svc.durable.find(ask), ask)

    def served(self, candidate, ask):
        return None

    def refused(self, candidate, error):
        return None


def test_a_peer_tier_promotes_then_serves_what_the_local_vault_verified(settings, open_service):
    """Branch: remote. Nothing local can serve; the peer tier promotes a cut into the
    local vault and serves it from there; the ladder counts a remote hit billed from the
    manifest — and the answer equals a cold run's."""
    svc = open_service(settings)
    cold = ask(svc, P)  # no peers: a miss
    elsewhere = Settings.load(data_dir=settings.data_dir / "other", alignment=TINY_A, env={})
    local = open_service(elsewhere)  # its own store and catalog: nothing to serve P from
    peer = PeerThatPromotes(local)
    local.ladder.peers = [peer]
    before = local.accounting.snapshot()
    warm = ask(local, P)
    assert (warm.tier, warm.cached_tokens) == ("remote", len(P))
    assert warm.tokens == cold.tokens and peer.loads == 1
    after = local.accounting.snapshot()
    # Per-tenant series exist once their tenant was seen: absent before means zero.
    assert after["kvpack_hits_total:remote"] - before.get("kvpack_hits_total:remote", 0) == 1
    billed = after["kvpack_bytes_served_total:remote"] - before.get(
        "kvpack_bytes_served_total:remote", 0
    )
    assert billed == deepest_cut(local, P).bytes


def test_paired_timing_from_a_local_prefill_and_a_later_hit_persists(settings, open_service):
    """Branch: pairing. A cold prefill from depth 0 and the first later hit on the same cut
    in the same process make one measured pair, persisted in the catalog's economics
    ledger (a second service over the same catalog reads it back); a further hit on that
    cut pairs nothing (each prefill measurement pairs once)."""
    svc = open_service(settings)
    assert svc.economics()["pairs"] == 0
    assert svc.economics()["speedup"]["value"] is None
    ask(svc, P)
    assert svc.flush(30)
    assert ask(svc, P).tier == "resident"
    assert ask(svc, P).tier == "resident"
    assert svc.flush(30)
    econ = svc.economics()
    assert econ["pairs"] == 1 and econ["paired_tokens"] == len(P)
    assert econ["speedup"]["basis"] == "measured" and econ["speedup"]["value"] > 0
    assert econ["joules_saved"]["basis"] == "mock"
    assert econ["flops_avoided"]["value"] == 2 * svc.loaded.num_params * 2 * len(P)
    svc.close()
    again = open_service(settings)
    assert again.economics()["pairs"] == 1
    assert again.economics()["by_tier"]["resident"]["pairs"] == 1


def chunk_rows(svc) -> int:
    with Session(svc.vault.db) as s:
        return s.scalar(select(func.count()).select_from(ChunkRow))


def sealed_and_stored(svc) -> tuple[float, float]:
    a = svc.accounting
    return a.total("kvpack_chunks_sealed_total"), a.total("kvpack_chunks_already_stored_total")


def test_chunks_sealed_per_cold_request_are_the_chunks_new_to_the_store(settings, open_service):
    """Branch: dedup on publish. The first prompt seals every chunk it stores; a longer
    prompt over the same first blocks seals exactly the chunks new to the store (counted
    against the catalog's chunk rows) and counts its shared blocks as already stored."""
    svc = open_service(settings)
    ask(svc, P)
    assert svc.flush(30)
    sealed, stored = sealed_and_stored(svc)
    assert sealed == chunk_rows(svc) > 0
    longer = P[: 4 * TINY_A] + prompt(2 * TINY_A, seed=31)
    rows = chunk_rows(svc)
    assert ask(svc, longer).cached_tokens == 4 * TINY_A
    assert svc.flush(30)
    more_sealed, more_stored = sealed_and_stored(svc)
    assert more_sealed - sealed == chunk_rows(svc) - rows > 0
    assert more_stored - stored >= 4  # blocks 0-3, shared with P's cuts
    assert deepest_cut(svc, longer).depth == len(longer)


class PublishWatch:
    """Wraps the vault's publish: records, at each start, whether the request had been
    served (its generator returned) and signals that one started."""

    def __init__(self, svc) -> None:
        self.served, self.starts, self.started = False, [], threading.Event()
        publish = svc.vault.publish

        def watched(*args, **kw):
            self.starts.append(self.served)
            self.started.set()
            return publish(*args, **kw)

        svc.vault.publish = watched


def until_decoding(steps) -> None:
    while next(steps) != "decode":
        pass


def test_durable_publication_starts_only_after_the_request_is_served(settings, open_service):
    """Branch: deferral. While the request decodes, its cuts are encoded and held resident
    but not one durable publish starts (waited for well past the moment a publish queued
    without deferral would have run); once the request is served they all run."""
    svc = open_service(settings)
    watch = PublishWatch(svc)
    steps = svc.steps(CompletionRequest(tokens=P, max_tokens=MAX))
    until_decoding(steps)
    assert svc.background.flush(30)  # encoded and held: the durable cuts are queued
    assert resident_cut(svc, P[: 4 * TINY_A]) is not None
    assert not watch.started.wait(2.0)
    assert svc.publication.deferred.stats()["queued"] > 0
    watch.served = True
    run_steps(steps)
    assert svc.flush(30)
    assert watch.starts == [True, True]  # the last aligned cut and the exact cut
    assert deepest_cut(svc, P).depth == len(P)


def test_the_max_defer_bounds_how_long_a_request_holds_its_publication(tmp_path, open_service):
    """Branch: the bound. A request still decoding past publish_max_defer_s no longer holds
    its durable cuts: they are published while it is unfinished."""
    settings = Settings.load(
        data_dir=tmp_path / "vault", alignment=TINY_A, env={}, publish_max_defer_s=0.2
    )
    svc = open_service(settings)
    watch = PublishWatch(svc)
    steps = svc.steps(CompletionRequest(tokens=P, max_tokens=MAX))
    until_decoding(steps)
    assert svc.flush(30)  # returns with the request still open
    assert watch.starts == [False, False]
    assert deepest_cut(svc, P).depth == len(P)
    run_steps(steps)


def test_publication_off_publishes_nothing(tmp_path, open_service):
    """Branch: publish = false (the A/B control). A cold request is served as usual, but no
    cut is held or published: nothing in the resident tier, the catalog or the store, no
    chunk sealed, and the same request again is cold."""
    settings = Settings.load(data_dir=tmp_path / "vault", alignment=TINY_A, env={},
                             publish=False)  # fmt: skip
    svc = open_service(settings)
    cold = ask(svc, P)
    assert svc.flush(30)
    assert resident_cut(svc, P) is None and deepest_cut(svc, P) is None
    assert chunk_rows(svc) == 0 and svc.vault.run(svc.vault.objects.list_keys("chunks/")) == []
    assert sealed_and_stored(svc) == (0, 0)
    again = ask(svc, P)
    assert (again.tier, again.tokens) == ("none", cold.tokens)
