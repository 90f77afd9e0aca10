"""Publication off the response path, the remote tier's interface, and paired timings."""

from __future__ import annotations

import threading
import time

from engine import planes
from engine.models import load_model
from engine.slots import Engine
from engine.snapshot import snapshot
from kvpack.config import Settings
from kvpack.publisher import Publisher
from tests.engine.slotkit import TINY_A
from tests.kvpack.test_service import P, ask, deepest_cut


def test_full_queue_drops_with_count_and_never_blocks():
    """Branch: Publisher.submit on a full queue returns False at once and counts a drop;
    flush waits for queued jobs; a failing job is counted, never raised; after close
    nothing is taken."""
    pub = Publisher(resident=None, durable=None, capacity=1)  # generic jobs only
    started, gate, ran = threading.Event(), threading.Event(), []

    def blocker() -> None:
        started.set()
        gate.wait(10)

    assert pub.submit("blocker", blocker)
    assert started.wait(5)  # the worker holds the blocker; the queue is empty
    assert pub.submit("queued", lambda: ran.append(1))
    t = time.monotonic()
    assert not pub.submit("dropped", lambda: ran.append(2))
    assert time.monotonic() - t < 0.5
    assert not pub.flush(0.05)
    gate.set()
    assert pub.flush(5) and ran == [1]
    assert pub.submit("fails", lambda: 1 / 0) and pub.flush(5)
    assert pub.close(5)
    assert not pub.submit("late", lambda: ran.append(3))
    assert pub.stats() == {"queued": 0, "done": 2, "failed": 1, "dropped": 2}


class PeerThatPromotes:
    """A RemoteTier stand-in: a peer computed the cut; pull() stores it into the local
    durable tier (as kvpack/remote.py's promotion does) and says so."""

    def __init__(self, svc):
        self.svc, self.pulls = svc, 0

    def pull(self, *, identity, tokens, alignment, min_depth):
        self.pulls += 1
        loaded = load_model("tiny", alignment=alignment, namespace="default")
        slot = Engine(loaded, num_slots=1, alignment=alignment).slot(0)
        slot.prefill(tokens)
        layout, parts = planes.encode(snapshot(slot))
        self.svc.durable.publish(
            namespace="default",
            identity=identity,
            tokens=tokens,
            layout=layout,
            parts=parts,
            logits_witnessed=True,
        )
        return True


def test_remote_tier_promotes_then_the_ladder_re_resolves_locally(settings, open_service):
    """Branch: remote. Nothing local can serve; the remote tier promotes a cut into the
    local durable tier; the ladder re-resolves it there and counts a remote hit billed
    from the manifest — and the answer equals a cold run's."""
    svc = open_service(settings)
    cold = ask(svc, P)  # NoPeers: a miss
    elsewhere = Settings.load(data_dir=settings.data_dir / "other", alignment=TINY_A, env={})
    local = open_service(elsewhere)  # its own store and catalog: nothing to serve P from
    peer = local.ladder.remote = PeerThatPromotes(local)
    before = local.accounting.snapshot()
    warm = ask(local, P)
    assert (warm.tier, warm.cached_tokens) == ("remote", len(P))
    assert warm.tokens == cold.tokens and peer.pulls == 1
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
