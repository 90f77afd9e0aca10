"""The maintainer (kvpack/maintainer.py) keeping a vault under load: a store budget held
after every pass with hits still bit-identical; a fleet of two servers on one S3 bucket
and one PostgreSQL collecting one at a time, a dead holder's lease taken over, and GC
racing publication losing nothing; and a warm start's first stats refresh kept off the
first requests."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import update

from catalog import lease
from catalog.models import LeaseRow
from kvpack.maintainer import GC_LEASE, Maintainer
from kvpack.service.service import Completion, CompletionRequest, Service
from kvpack.vault import Vault
from tests.engine.slotkit import prompt

N = 200  # tokens: cuts at 192 (aligned) and 200 (exact, logits witnessed)


def ask(svc: Service, tokens: list[int], namespace: str = "default") -> Completion:
    return svc.complete(CompletionRequest(tokens=tokens, max_tokens=8, namespace=namespace))


def footprint(svc: Service) -> int:
    return svc.vault.stats().total.footprint


def test_a_store_budget_holds_after_every_pass_and_hits_stay_bit_identical(settings, open_service):
    """Distinct prompts through a service whose maintainer runs every 50 ms with a budget
    of about two prompts' cuts: after each request (publication flushed) the next full
    pass leaves the footprint within the budget and every cut's chunks verified; a fresh
    instance then serves the newest prompt from the durable tier with the cold output,
    and an evicted one recomputes the same output."""
    svc = open_service(settings)
    prompts = [prompt(N, seed=300 + i) for i in range(6)]
    cold = [ask(svc, prompts[0])]
    assert svc.flush(60)
    per_prompt = footprint(svc)
    budget = int(2.5 * per_prompt)
    maintainer = Maintainer(
        vault=svc.vault,
        quarantine=svc.quarantine,
        budget_bytes=budget,
        gc_interval_s=0.05,
        grace_s=0,
    )
    maintainer.start()
    try:
        for p in prompts[1:]:
            cold.append(ask(svc, p))
            assert svc.flush(60)
            done = maintainer.passes
            assert maintainer.wait_passes(done + 2, 60)  # one pass begun after the flush
            assert footprint(svc) <= budget
            report = svc.vault.verify(read_data=True)
            assert report.ok, [p.to_json() for p in report.problems]
    finally:
        maintainer.stop()
    stats = svc.vault.stats()
    assert stats.total.cuts >= 2 and stats.pending_chunks == 0
    assert footprint(svc) > per_prompt  # the budget kept more than one prompt
    svc.close()

    fresh = open_service(settings)
    newest = ask(fresh, prompts[-1])
    assert (newest.tier, newest.tokens) == ("durable", cold[-1].tokens)
    oldest = ask(fresh, prompts[0])
    assert (oldest.tier, oldest.tokens) == ("none", cold[0].tokens)


@pytest.fixture
def fleet(request, tmp_path, open_service):
    """Two services (two vaults: their own IO loops, engines and connections) on one S3
    prefix and one PostgreSQL database, each with a maintainer that is not started."""
    from kvpack.config import Settings
    from tests.fixtures.db import DatabaseFactory
    from tests.kvpack.conftest import s3_settings

    factory = DatabaseFactory("postgres", tmp_path)
    request.addfinalizer(factory.drop_all)
    shared = Settings.load(
        data_dir=tmp_path / "vault",
        alignment=64,
        env={},
        database_url=factory.create(),
        **s3_settings(request.getfixturevalue("s3_config")),
    )
    services = [open_service(shared), open_service(shared)]
    return [
        (
            svc,
            Maintainer(
                vault=svc.vault,
                quarantine=svc.quarantine,
                gc_interval_s=0.05,
                grace_s=0,
                holder=f"instance-{i}",
            ),
        )
        for i, svc in enumerate(services)
    ]


@pytest.mark.s3
@pytest.mark.postgres
def test_one_collector_at_a_time_and_a_dead_holders_lease_is_taken_over(fleet):
    """Instance 0 pauses inside its GC pass (at its orphan sweep): instance 1's pass is
    skipped, naming instance 0 as the holder; once 0 finishes, 1 collects. A lease held by
    an instance that died is refused until it expires, then taken over."""
    (a, ma), (b, mb) = fleet
    ask(a, prompt(N, seed=400))
    assert a.flush(60)
    reached, release = threading.Event(), threading.Event()

    async def hold(name: str) -> None:
        if name == "orphans":
            reached.set()
            await asyncio.to_thread(release.wait, 60)

    passes = []
    t = threading.Thread(
        target=lambda: passes.append(ma.collect_once(orphans=True, checkpoint=hold))
    )
    t.start()
    try:
        assert reached.wait(60)
        skipped = mb.collect_once()
        assert (skipped.outcome, skipped.holder) == ("skipped", "instance-0")
    finally:
        release.set()
        t.join(60)
    assert passes[0].outcome == "ok"
    assert mb.collect_once().outcome == "ok"

    with b.vault.transaction() as s:
        assert lease.acquire(
            session=s, name=GC_LEASE, holder="dead", ttl=timedelta(hours=1), now=datetime.now(UTC)
        )
    assert (mb.collect_once().outcome, mb.last.holder) == ("skipped", "dead")
    with b.vault.transaction() as s:  # the dead holder's hour is up
        s.execute(update(LeaseRow).values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
    assert mb.collect_once().outcome == "ok"


@pytest.mark.s3
@pytest.mark.postgres
def test_gc_racing_publication_in_a_fleet_loses_nothing(fleet):
    """Both instances serve distinct and repeated prompts while both maintainers collect
    every 50 ms with no grace period and a budget of about two prompts: their passes never
    overlap, every cut left in the catalog verifies byte for byte, and every answer to a
    prompt is the same, whichever tier served it."""
    (a, ma), (b, mb) = fleet
    prompts = [prompt(N, seed=500 + i) for i in range(4)]
    ask(a, prompts[0])
    assert a.flush(60)
    budget = int(2.5 * footprint(a))
    spans: list[tuple[float, float, str]] = []
    lock = threading.Lock()
    for m in (ma, mb):
        m.budget_bytes = budget
        collect = m.vault.collect

        def timed(*args, _collect=collect, _who=m.holder, **kw):
            start = time.monotonic()
            try:
                return _collect(*args, **kw)
            finally:
                with lock:
                    spans.append((start, time.monotonic(), _who))

        m.vault.collect = timed
    answers: dict[int, set[tuple[int, ...]]] = {i: set() for i in range(len(prompts))}
    tiers: list[str] = []

    def load(svc: Service, order: list[int]) -> None:
        for i in order:
            got = ask(svc, prompts[i])
            with lock:
                answers[i].add(tuple(got.tokens))
                tiers.append(got.tier)

    workers = [
        threading.Thread(target=load, args=(a, [1, 2, 3, 1, 0, 2])),
        threading.Thread(target=load, args=(b, [3, 2, 1, 0, 3, 1])),
    ]
    ma.start()
    mb.start()
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join(300)
        assert a.flush(60) and b.flush(60)
        assert ma.wait_passes(ma.passes + 1, 60) or mb.wait_passes(mb.passes + 1, 60)
    finally:
        ma.stop()
        mb.stop()
    assert all(len(outs) == 1 for outs in answers.values()), answers
    assert ma.passes + mb.passes >= 2
    spans.sort()
    for (_, e1, w1), (s2, _, w2) in zip(spans, spans[1:], strict=False):
        assert e1 <= s2, f"{w1} and {w2} collected at once"
    report = a.vault.verify(read_data=True)
    assert report.ok, [p.to_json() for p in report.problems]
    assert report.manifests >= 1


def test_a_caller_that_filled_the_gauges_moves_the_first_refresh_off_the_first_requests(
    settings,
):
    """`kvpack serve` refreshes the gauges before it listens and starts the maintainer with
    `refreshed=True`: the thread's first stats refresh then waits an interval instead of
    running at once, on top of the first requests. Without the flag it runs at once."""
    vault = Vault.open(settings)
    try:
        for refreshed, expected in ((False, 1), (True, 0)):
            calls: list[float] = []
            m = Maintainer(vault=vault, gc_interval_s=0, stats_interval_s=60)
            m.refresh = lambda calls=calls: calls.append(time.monotonic())  # type: ignore[method-assign]
            m.start(refreshed=refreshed)
            time.sleep(0.5)
            m.stop()
            assert len(calls) == expected, refreshed
    finally:
        vault.close()
