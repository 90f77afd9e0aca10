"""Condemnation (catalog/condemn.py): a broken cut leaves the catalog at once, a broken
chunk takes every cut using it, and the same history republishes cleanly over it."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from cas.errors import ChunkCorrupt, ChunkMissing
from catalog.condemn import broken_chunk, condemn, kind_of
from catalog.errors import ManifestMissing
from catalog.models import ChunkRow, CondemnationRow
from tests.catalog.helpers import do_publish, find, load, payloads, tokens
from tests.catalog.test_gc import Pause


async def flip(store, key: str) -> None:
    data = bytearray(await store.objects.get(key))
    data[len(data) // 2] ^= 0x01
    await store.objects.delete(key)
    await store.objects.put_if_absent(key, bytes(data))


def test_a_corrupt_chunk_condemns_every_cut_using_it_and_republishes_clean(
    aio, chunk_store, db_engine
):
    """Two cuts share chunk X; X's object is flipped. Condemning for X removes both cuts
    (with the reason recorded), deletes X's object and row, and publishing one history
    again stores X afresh: it loads and verifies."""
    x = payloads(10, n=1)
    h1, h2 = tokens(10, 256), tokens(11, 256)
    m1 = aio.run(do_publish(chunk_store, db_engine, h1, x + payloads(11, n=1)))
    aio.run(do_publish(chunk_store, db_engine, h2, x + payloads(12, n=1)))
    x_id = m1.parts[0].chunk_id
    aio.run(flip(chunk_store, chunk_store.key(x_id)))
    with pytest.raises(ChunkCorrupt) as failed:
        aio.run(load(chunk_store, db_engine, h1))
    assert (kind_of(failed.value), broken_chunk(failed.value)) == ("chunk_corrupt", x_id)

    condemned = aio.run(
        condemn(
            objects=chunk_store.objects,
            db=db_engine,
            manifest_id=m1.id,
            kind="chunk_corrupt",
            reason=str(failed.value),
            chunk=x_id,
        )
    )

    assert {c.depth for c in condemned} == {256} and len(condemned) == 2
    assert find(db_engine, h1) is None and find(db_engine, h2) is None
    assert not aio.run(chunk_store.contains(x_id))
    with Session(db_engine) as s:
        assert x_id.hex not in set(s.scalars(select(ChunkRow.id)))
        rows = list(s.scalars(select(CondemnationRow)))
        assert {r.kind for r in rows} == {"chunk_corrupt"} and {r.chunk for r in rows} == {x_id.hex}
    again = aio.run(do_publish(chunk_store, db_engine, h1, x + payloads(11, n=1)))
    assert again.id == m1.id
    loaded = aio.run(load(chunk_store, db_engine, h1))
    assert bytes(loaded.parts[0][1]) == x[0][1]


def test_a_publish_that_reserved_the_broken_chunk_first_uploads_it_again(
    aio, chunk_store, db_engine
):
    """Race: publish P reserved chunk X (whose object is corrupt: put-if-absent says "it
    exists") and pauses before committing; X is condemned meanwhile. P's commit sees the
    row condemned, reserves again (waiting until the broken object is gone) and uploads
    X itself: its cut loads clean."""
    x = payloads(20, n=1)
    first = aio.run(do_publish(chunk_store, db_engine, tokens(20, 256), x))
    x_id = first.parts[0].chunk_id
    aio.run(flip(chunk_store, chunk_store.key(x_id)))
    history = tokens(21, 256)

    async def scenario():
        pause = Pause("manifest_stored")
        publishing = asyncio.create_task(
            do_publish(chunk_store, db_engine, history, x, checkpoint=pause)
        )
        await asyncio.wait_for(pause.reached.wait(), 10)
        await condemn(
            objects=chunk_store.objects,
            db=db_engine,
            manifest_id=first.id,
            kind="chunk_corrupt",
            reason="flipped",
            chunk=x_id,
        )
        pause.release.set()
        await publishing
        return pause.seen

    seen = aio.run(scenario())
    assert seen.count("reserved") == 2
    loaded = aio.run(load(chunk_store, db_engine, history))
    assert bytes(loaded.parts[0][1]) == x[0][1]


def test_publishing_over_a_row_whose_manifest_object_is_gone_condemns_it(
    aio, chunk_store, db_engine
):
    """The same history published again while its row names a deleted manifest object
    does not return the broken row (as before: ManifestMissing for ever): it condemns the
    row and publishes anew."""
    history, planes = tokens(30, 256), payloads(30)
    aio.run(do_publish(chunk_store, db_engine, history, planes))
    cut = find(db_engine, history)
    aio.run(chunk_store.objects.delete(cut.object_key))
    with pytest.raises(ManifestMissing):
        aio.run(load(chunk_store, db_engine, history))
    aio.run(do_publish(chunk_store, db_engine, history, planes))
    fresh = find(db_engine, history)
    assert fresh.object_key != cut.object_key
    assert [bytes(v) for _, v in aio.run(load(chunk_store, db_engine, history)).parts] == [
        p for _, p in planes
    ]
    with Session(db_engine) as s:
        assert [r.kind for r in s.scalars(select(CondemnationRow))] == ["manifest_missing"]


def test_a_missing_chunk_is_a_broken_chunk_too(aio, chunk_store, db_engine):
    history = tokens(40, 256)
    m = aio.run(do_publish(chunk_store, db_engine, history, payloads(40, n=2)))
    aio.run(chunk_store.delete(m.parts[1].chunk_id))
    with pytest.raises(ChunkMissing) as failed:
        aio.run(load(chunk_store, db_engine, history))
    assert broken_chunk(failed.value) == m.parts[1].chunk_id
    assert kind_of(failed.value) == "chunk_missing"
    assert kind_of(ValueError("x")) == "refused" and broken_chunk(ValueError("x")) is None
