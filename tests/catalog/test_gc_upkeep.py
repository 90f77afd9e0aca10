"""GC beyond the budget: tenant quotas that never reach another tenant, orphaned
manifest and chunk objects, and the dry-run plan agreeing with the pass it predicts."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from cas.chunks import ChunkStore
from catalog import queries, quotas
from catalog.gc import collect
from catalog.gcplan import plan
from catalog.models import ChunkRow, ManifestRow
from tests.catalog.helpers import ALICE, BOB, do_publish, find, payloads, tokens

HOUR = timedelta(hours=1)


def tenant_store(chunk_store: ChunkStore, namespace: str) -> ChunkStore:
    return ChunkStore(chunk_store.objects, chunk_store.keyring, namespace=namespace)


def set_quota(engine, namespace: str, limit: int) -> None:
    with Session(engine) as s, s.begin():
        quotas.set_quota(session=s, namespace=namespace, limit=limit, now=datetime.now(UTC))


def age(engine, manifest_id, hours: int) -> None:
    """Make a cut look created (and last hit) `hours` ago."""
    at = datetime.now(UTC) - timedelta(hours=hours)
    with Session(engine) as s, s.begin():
        s.execute(
            update(ManifestRow).where(ManifestRow.id == manifest_id.hex).values(created_at=at)
        )


def test_a_tenant_over_its_quota_loses_its_own_oldest_cuts_never_another_tenants(
    aio, chunk_store, db_engine
):
    """Tenant a (quota: two cuts) holds four cuts, tenant b (no quota) holds three older
    ones: GC evicts a's two oldest and nothing of b's, even though b's cuts are the least
    recently hit of the vault."""
    a, b = tenant_store(chunk_store, "a"), tenant_store(chunk_store, "b")
    b_cuts = [
        aio.run(
            do_publish(
                b, db_engine, tokens(40 + i, 256), payloads(40 + i, n=1, size=100), ident=BOB
            )
        )
        for i in range(3)
    ]
    a_cuts = [
        aio.run(do_publish(a, db_engine, tokens(50 + i, 256), payloads(50 + i, n=1, size=100)))
        for i in range(4)
    ]
    for i, m in enumerate(b_cuts):
        age(db_engine, m.id, 20 - i)
    for i, m in enumerate(a_cuts):
        age(db_engine, m.id, 10 - i)
    set_quota(db_engine, "a", 200)

    report = aio.run(collect(objects=a.objects, db=db_engine, budget_bytes=None, grace=HOUR))

    assert report.evicted == [a_cuts[0].id, a_cuts[1].id]
    assert report.quota_evicted == {"a": 2}
    assert [find(db_engine, tokens(50 + i, 256)) is not None for i in range(4)] == [
        False,
        False,
        True,
        True,
    ]
    assert all(find(db_engine, tokens(40 + i, 256), BOB) is not None for i in range(3))
    with Session(db_engine) as s:
        assert queries.referenced_bytes(session=s, namespace="a") == 200
        assert queries.referenced_bytes(session=s, namespace="b") == 300


def test_the_budget_applies_after_the_quotas(aio, chunk_store, db_engine):
    """Quotas first (a's own cuts), then the vault budget (anyone's, least recently hit)."""
    a, b = tenant_store(chunk_store, "a"), tenant_store(chunk_store, "b")
    old_b = aio.run(
        do_publish(b, db_engine, tokens(60, 256), payloads(60, n=1, size=100), ident=BOB)
    )
    a_cuts = [
        aio.run(do_publish(a, db_engine, tokens(61 + i, 256), payloads(61 + i, n=1, size=100)))
        for i in range(3)
    ]
    age(db_engine, old_b.id, 30)
    for i, m in enumerate(a_cuts):
        age(db_engine, m.id, 10 - i)
    set_quota(db_engine, "a", 200)
    report = aio.run(collect(objects=a.objects, db=db_engine, budget_bytes=100, grace=HOUR))
    assert report.evicted == [a_cuts[0].id, old_b.id, a_cuts[1].id]
    assert report.footprint_after == 100


def test_orphaned_manifest_objects_go_once_older_than_the_grace_period(aio, chunk_store, db_engine):
    """A manifest object no row names (a publish died before its commit) is deleted once
    older than the grace period; a fresh one (a publish in flight) and a named one stay."""
    kept = aio.run(do_publish(chunk_store, db_engine, tokens(70, 256), payloads(70)))
    orphan = f"manifests/{ALICE.hex}/{'ab' * 16}-0000000000000001"
    aio.run(chunk_store.objects.put_if_absent(orphan, b"left by a dead publish"))
    fresh = aio.run(
        collect(
            objects=chunk_store.objects, db=db_engine, budget_bytes=None, grace=HOUR, orphans=True
        )
    )
    assert fresh.orphan_manifests == []
    later = aio.run(
        collect(
            objects=chunk_store.objects,
            db=db_engine,
            budget_bytes=None,
            grace=HOUR,
            orphans=True,
            now=datetime.now(UTC) + 2 * HOUR,
        )
    )
    assert later.orphan_manifests == [orphan]
    keys = aio.run(chunk_store.objects.list_keys("manifests/"))
    assert orphan not in keys and len(keys) == 1
    assert find(db_engine, tokens(70, 256)).manifest_id == kept.id


def test_an_orphaned_chunk_object_is_claimed_then_deleted(aio, chunk_store, db_engine):
    """A chunk object with no row (its publish died after GC took its reservation) is
    claimed with a condemned row, deleted, and the row removed; referenced chunks stay."""
    kept = aio.run(do_publish(chunk_store, db_engine, tokens(80, 256), payloads(80, n=2)))
    ref = aio.run(chunk_store.put(payloads(81, n=1)[0][1]))
    report = aio.run(
        collect(
            objects=chunk_store.objects, db=db_engine, budget_bytes=None, grace=HOUR, orphans=True
        )
    )
    assert report.orphan_chunks == [ref.id.hex]
    assert not aio.run(chunk_store.contains(ref.id))
    with Session(db_engine) as s:
        assert set(s.scalars(select(ChunkRow.id))) == {p.chunk_id.hex for p in kept.parts}
    assert all(aio.run(chunk_store.contains(p.chunk_id)) for p in kept.parts)


def test_an_orphan_claim_leaves_a_chunk_a_publish_reserved_meanwhile(aio, chunk_store, db_engine):
    """The claim is an INSERT that loses to a publish's reservation: a chunk object whose
    row a publish created after the listing is not deleted."""
    from catalog.gc import _orphan_chunks

    x = payloads(90, n=1)
    ref = aio.run(chunk_store.put(x[0][1]))

    async def scenario():
        from tests.catalog.test_gc import Pause

        listed = Pause("objects_deleted")
        real_list = chunk_store.objects.list_keys

        async def list_then_publish(prefix):
            keys = await real_list(prefix)
            # a publish reserves the chunk right after the collector listed the store
            await do_publish(chunk_store, db_engine, tokens(90, 256), x)
            return keys

        chunk_store.objects.list_keys = list_then_publish
        from catalog.gc import GcReport

        report = GcReport()
        try:
            await _orphan_chunks(
                chunk_store.objects, db_engine, datetime.now(UTC), "run1", 500, report, listed
            )
        finally:
            del chunk_store.objects.list_keys
        return report

    report = aio.run(scenario())
    assert report.orphan_chunks == []
    assert aio.run(chunk_store.contains(ref.id))
    assert find(db_engine, tokens(90, 256)) is not None


def test_the_dry_run_plan_predicts_the_pass(aio, chunk_store, db_engine):
    """gcplan replays the eviction in memory: the same victims, the same footprints, and
    it deletes nothing."""
    a = tenant_store(chunk_store, "a")
    shared = payloads(95, n=1, size=100)
    cuts = [
        aio.run(
            do_publish(a, db_engine, tokens(95 + i, 256), shared + payloads(100 + i, n=1, size=50))
        )
        for i in range(4)
    ]
    for i, m in enumerate(cuts):
        age(db_engine, m.id, 10 - i)
    set_quota(db_engine, "a", 230)
    with Session(db_engine) as s:
        predicted = plan(session=s, budget_bytes=190, cutoff=datetime.now(UTC) - HOUR)
    assert find(db_engine, tokens(95, 256)) is not None  # nothing deleted
    report = aio.run(collect(objects=a.objects, db=db_engine, budget_bytes=190, grace=HOUR))
    assert [m for m, _, _ in predicted.evict] == [m.hex for m in report.evicted]
    assert [why for _, _, why in predicted.evict] == ["quota", "quota", "budget"]
    assert (predicted.footprint_before, predicted.footprint_after) == (
        report.footprint_before,
        report.footprint_after,
    )
    assert predicted.freed_bytes == report.freed_bytes == 150


def test_collect_is_safe_to_run_twice_at_once(aio, chunk_store, db_engine):
    """Two collectors at once (no lease) still delete every unreferenced chunk exactly
    once and no referenced one."""
    keep = aio.run(do_publish(chunk_store, db_engine, tokens(110, 256), payloads(110)))
    aio.run(do_publish(chunk_store, db_engine, tokens(111, 256), payloads(111)))
    with Session(db_engine) as s, s.begin():
        queries.touch_cut(session=s, manifest_id=keep.id, at=datetime.now(UTC) + HOUR)
    evicted = aio.run(
        collect(objects=chunk_store.objects, db=db_engine, budget_bytes=keep.bytes, grace=HOUR)
    )
    assert len(evicted.evicted) == 1

    async def both():
        later = datetime.now(UTC) + 2 * HOUR
        return await asyncio.gather(
            *[
                collect(
                    objects=chunk_store.objects,
                    db=db_engine,
                    budget_bytes=None,
                    grace=timedelta(0),
                    now=later,
                )
                for _ in range(2)
            ]
        )

    reports = aio.run(both())
    deleted = [c for r in reports for c in r.deleted_chunks]
    assert len(deleted) == len(set(deleted)) == 3
    assert all(aio.run(chunk_store.contains(p.chunk_id)) for p in keep.parts)
