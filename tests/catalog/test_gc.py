"""GC: byte-budget eviction order, grace period, and deterministic races with publish."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from cas.errors import ChunkMissing
from catalog import queries
from catalog.errors import ChunksBeingCollected
from catalog.gc import collect
from catalog.models import ChunkRow, ManifestRow
from tests.catalog.helpers import do_publish, find, load, load_of, payloads, tokens

HOUR = timedelta(hours=1)


class Pause:
    """An awaitable checkpoint that holds the caller at `at` (once) until released."""

    def __init__(self, at: str) -> None:
        self.at = at
        self.seen: list[str] = []
        self.reached = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, name: str) -> None:
        self.seen.append(name)
        if name == self.at and not self.reached.is_set():
            self.reached.set()
            await self.release.wait()


def chunk_rows(engine) -> dict[str, ChunkRow]:
    with Session(engine, expire_on_commit=False) as s:
        return {r.id: r for r in s.scalars(select(ChunkRow))}


async def stored_chunk_keys(store) -> set[str]:
    return set(await store.objects.list_keys("chunks/"))


def test_budget_evicts_least_recently_hit_first(aio, chunk_store, db_engine):
    """Eviction order: never-hit (by creation) and older hits go first, until the
    referenced footprint fits the budget; rows first, then the manifest object."""
    hs = [tokens(100 + i, 256) for i in range(3)]
    ms = [
        aio.run(do_publish(chunk_store, db_engine, h, payloads(100 + i, n=1, size=100)))
        for i, h in enumerate(hs)
    ]
    now = datetime.now(UTC)
    with Session(db_engine) as s, s.begin():
        queries.touch_cut(session=s, manifest_id=ms[0].id, at=now + 3 * HOUR)
        queries.touch_cut(session=s, manifest_id=ms[2].id, at=now + 1 * HOUR)
    objects_before = aio.run(chunk_store.objects.list_keys("manifests/"))

    report = aio.run(
        collect(objects=chunk_store.objects, db=db_engine, budget_bytes=100, grace=HOUR)
    )

    assert report.evicted == [ms[1].id, ms[2].id]
    assert (report.footprint_before, report.footprint_after) == (300, 100)
    assert find(db_engine, hs[0]) is not None
    assert find(db_engine, hs[1]) is None and find(db_engine, hs[2]) is None
    objects_after = aio.run(chunk_store.objects.list_keys("manifests/"))
    assert len(objects_before) == 3 and len(objects_after) == 1
    assert report.deleted_chunks == []  # the grace period runs from the eviction


def test_chunks_go_after_the_grace_period_referenced_ones_never(aio, chunk_store, db_engine):
    """Sweep: unreferenced chunks older than grace leave store and catalog; a chunk a
    manifest still references stays however old, and so does one shared with it."""
    shared = payloads(200, n=1, size=64)
    keep = aio.run(
        do_publish(chunk_store, db_engine, tokens(200, 256), shared + payloads(201, n=1))
    )
    gone = aio.run(
        do_publish(chunk_store, db_engine, tokens(202, 256), shared + payloads(202, n=1))
    )
    now = datetime.now(UTC)
    with Session(db_engine) as s, s.begin():
        queries.touch_cut(session=s, manifest_id=keep.id, at=now + HOUR)
    budget = sum(p.size for p in keep.parts)
    first = aio.run(
        collect(objects=chunk_store.objects, db=db_engine, budget_bytes=budget, grace=HOUR)
    )
    assert first.evicted == [gone.id] and first.deleted_chunks == []

    later = aio.run(
        collect(
            objects=chunk_store.objects,
            db=db_engine,
            budget_bytes=budget,
            grace=HOUR,
            now=now + 3 * HOUR,
        )
    )
    only_gone = gone.parts[1].chunk_id.hex
    assert later.deleted_chunks == [only_gone] and later.evicted == []
    assert set(chunk_rows(db_engine)) == {p.chunk_id.hex for p in keep.parts}
    assert aio.run(stored_chunk_keys(chunk_store)) == {
        chunk_store.key(p.chunk_id) for p in keep.parts
    }
    assert aio.run(load(chunk_store, db_engine, tokens(200, 256))).manifest == keep


def age_out(aio, store, engine, history, planes) -> None:
    """Publish a cut and evict it an hour in the past: its chunks are old and unreferenced."""
    aio.run(do_publish(store, engine, history, planes))
    past = datetime.now(UTC) - 2 * HOUR
    report = aio.run(
        collect(objects=store.objects, db=engine, budget_bytes=0, grace=HOUR, now=past)
    )
    assert report.evicted and not report.deleted_chunks


def test_gc_during_publish_spares_reserved_chunks(aio, chunk_store, db_engine):
    """Race 1: publish uploads (an old chunk X already existed) and pauses before its
    commit; GC runs then. The reservation made X recent, so only the truly dead Y goes."""
    x, y, z = payloads(300, n=3)
    age_out(aio, chunk_store, db_engine, tokens(300, 256), [x, y])
    history = tokens(301, 256)

    async def scenario():
        pause = Pause("chunks_stored")
        publishing = asyncio.create_task(
            do_publish(chunk_store, db_engine, history, [x, z], checkpoint=pause)
        )
        await asyncio.wait_for(pause.reached.wait(), 10)
        report = await collect(
            objects=chunk_store.objects, db=db_engine, budget_bytes=None, grace=HOUR
        )
        pause.release.set()
        return report, await publishing

    report, manifest = aio.run(scenario())
    assert report.deleted_chunks == [chunk_store.chunk_id(y[1]).hex]
    loaded = aio.run(load(chunk_store, db_engine, history))
    assert [bytes(v) for _, v in loaded.parts] == [x[1], z[1]]


def test_publish_meeting_a_condemned_chunk_waits_and_stores_it_again(aio, chunk_store, db_engine):
    """Race 2: GC has condemned X and not yet deleted its object when a publish needs X.
    The publish must not trust "X exists": it waits until GC is done, then uploads X anew."""
    x, y, z = payloads(400, n=3)
    age_out(aio, chunk_store, db_engine, tokens(400, 256), [x, y])
    x_id = chunk_store.chunk_id(x[1]).hex
    history = tokens(401, 256)

    async def scenario():
        gc_pause = Pause("condemned")
        collecting = asyncio.create_task(
            collect(
                objects=chunk_store.objects,
                db=db_engine,
                budget_bytes=None,
                grace=HOUR,
                checkpoint=gc_pause,
            )
        )
        await asyncio.wait_for(
            gc_pause.reached.wait(), 10
        )  # X and Y condemned, objects still there
        waiting = Pause("waiting_for_collector")
        publishing = asyncio.create_task(
            do_publish(chunk_store, db_engine, history, [x, z], checkpoint=waiting)
        )
        # The publish should now wait on X; if it (wrongly) finishes instead, go on anyway
        # so the assertions below show what that costs.
        saw = asyncio.create_task(waiting.reached.wait())
        await asyncio.wait({saw, publishing}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        saw.cancel()
        waiting.release.set()
        gc_pause.release.set()
        report = await collecting
        return report, await publishing, waiting.seen

    report, manifest, seen = aio.run(scenario())
    assert x_id in report.deleted_chunks
    assert seen.count("reserved") == 1 and "waiting_for_collector" in seen
    loaded = aio.run(load(chunk_store, db_engine, history))
    assert [bytes(v) for _, v in loaded.parts] == [x[1], z[1]]
    assert chunk_rows(db_engine)[x_id].condemned_at is None


def test_publish_that_outlives_the_grace_period_uploads_again(aio, chunk_store, db_engine):
    """Race 3: a publish stalls after writing chunks and manifest object past the grace
    period; GC collects its reservations. The final transaction notices and the publish
    reserves and uploads again instead of committing a manifest with missing chunks."""
    history, planes = tokens(500, 300), payloads(500, n=2)

    async def scenario():
        pause = Pause("manifest_stored")
        publishing = asyncio.create_task(
            do_publish(chunk_store, db_engine, history, planes, checkpoint=pause)
        )
        await asyncio.wait_for(pause.reached.wait(), 10)
        later = datetime.now(UTC) + 2 * HOUR
        report = await collect(
            objects=chunk_store.objects, db=db_engine, budget_bytes=None, grace=HOUR, now=later
        )
        pause.release.set()
        return report, await publishing, pause.seen

    report, manifest, seen = aio.run(scenario())
    assert sorted(report.deleted_chunks) == sorted(p.chunk_id.hex for p in manifest.parts)
    assert seen.count("reserved") == 2 and seen.count("committed") == 1
    loaded = aio.run(load(chunk_store, db_engine, history))
    assert [bytes(v) for _, v in loaded.parts] == [p for _, p in planes]
    assert len(aio.run(chunk_store.objects.list_keys("manifests/"))) == 1


def test_a_fresh_reservation_by_another_publish_is_not_ours(aio, chunk_store, db_engine):
    """Race 4: after GC collected a stalled publish P's chunk X, publish Q reserves X anew
    and has not uploaded it yet. P must not take Q's fresh row for its own reservation
    (first_stored_at differs): it uploads X itself, so its cut loads before Q finishes."""
    x = payloads(550, n=1)
    history_p, history_q = tokens(550, 256), tokens(551, 256)

    async def scenario():
        p_pause = Pause("manifest_stored")
        p_task = asyncio.create_task(
            do_publish(chunk_store, db_engine, history_p, x, checkpoint=p_pause)
        )
        await asyncio.wait_for(p_pause.reached.wait(), 10)
        later = datetime.now(UTC) + 2 * HOUR
        await collect(
            objects=chunk_store.objects, db=db_engine, budget_bytes=None, grace=HOUR, now=later
        )
        q_pause = Pause("reserved")
        q_task = asyncio.create_task(
            do_publish(chunk_store, db_engine, history_q, x, checkpoint=q_pause)
        )
        await asyncio.wait_for(q_pause.reached.wait(), 10)  # X's row is Q's, X not stored
        p_pause.release.set()
        await p_task
        try:
            return await load(chunk_store, db_engine, history_p), p_pause.seen
        finally:
            q_pause.release.set()
            await q_task

    loaded, seen = aio.run(scenario())
    assert [bytes(v) for _, v in loaded.parts] == [x[0][1]]
    assert seen.count("reserved") == 2


def test_a_dead_collectors_condemnations_are_adopted(aio, chunk_store, db_engine):
    """A collector that dies after condemning leaves rows publishes wait on (typed error
    when the wait runs out); the next collector past the grace period finishes the job."""
    x, y = payloads(600, n=2)
    age_out(aio, chunk_store, db_engine, tokens(600, 256), [x, y])

    async def die(name: str) -> None:
        if name == "condemned":
            raise RuntimeError("collector died")

    with pytest.raises(RuntimeError, match="collector died"):
        aio.run(
            collect(
                objects=chunk_store.objects,
                db=db_engine,
                budget_bytes=None,
                grace=HOUR,
                checkpoint=die,
            )
        )
    history = tokens(601, 256)
    with pytest.raises(ChunksBeingCollected):
        aio.run(do_publish(chunk_store, db_engine, history, [x], reclaim_wait_s=0.1))
    assert find(db_engine, history) is None

    report = aio.run(
        collect(
            objects=chunk_store.objects,
            db=db_engine,
            budget_bytes=None,
            grace=HOUR,
            now=datetime.now(UTC) + 2 * HOUR,
        )
    )
    assert len(report.deleted_chunks) == 2 and chunk_rows(db_engine) == {}
    assert aio.run(stored_chunk_keys(chunk_store)) == set()
    aio.run(do_publish(chunk_store, db_engine, history, [x]))
    assert [bytes(v) for _, v in aio.run(load(chunk_store, db_engine, history)).parts] == [x[1]]


def test_evicted_cut_is_a_miss_not_partial_state(aio, chunk_store, db_engine):
    """A reader holding a Cut that GC evicted gets a typed refusal (its manifest object or
    a chunk is gone), never bytes."""
    from catalog.errors import ManifestMissing

    history = tokens(700, 256)
    aio.run(do_publish(chunk_store, db_engine, history, payloads(700)))
    cut = find(db_engine, history)
    aio.run(collect(objects=chunk_store.objects, db=db_engine, budget_bytes=0, grace=timedelta(0)))
    with pytest.raises((ManifestMissing, ChunkMissing)):
        aio.run(load_of(chunk_store, db_engine, cut))
    with Session(db_engine) as s:
        assert s.scalar(select(ManifestRow.id)) is None


def test_bad_arguments_are_refused(aio, chunk_store, db_engine):
    """Bad input: a negative budget or grace -> ValueError."""
    with pytest.raises(ValueError, match="budget"):
        aio.run(collect(objects=chunk_store.objects, db=db_engine, budget_bytes=-1, grace=HOUR))
    with pytest.raises(ValueError, match="grace"):
        aio.run(collect(objects=chunk_store.objects, db=db_engine, budget_bytes=None, grace=-HOUR))


def test_shared_chunks_count_once_in_the_footprint(aio, chunk_store, db_engine):
    """Budget accounting: a chunk two manifests share is one chunk's worth of bytes, and
    evicting one of them frees only what it held alone."""
    shared = payloads(900, n=1, size=100)
    a = aio.run(
        do_publish(chunk_store, db_engine, tokens(900, 256), shared + payloads(901, n=1, size=10))
    )
    aio.run(
        do_publish(chunk_store, db_engine, tokens(902, 256), shared + payloads(902, n=1, size=20))
    )
    now = datetime.now(UTC)
    with Session(db_engine) as s, s.begin():
        queries.touch_cut(session=s, manifest_id=a.id, at=now - HOUR)  # a is the LRU
    report = aio.run(
        collect(objects=chunk_store.objects, db=db_engine, budget_bytes=125, grace=HOUR)
    )
    assert report.footprint_before == 130
    assert report.evicted == [a.id] and report.footprint_after == 120
