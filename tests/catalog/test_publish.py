"""publish / load_cut on {SQLite, PostgreSQL} x {local directory, S3}."""

from __future__ import annotations

import asyncio
import threading

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from cas.chunks import ChunkStore
from cas.errors import ChunkCorrupt
from cas.local import LocalDirStore
from catalog.condemn import condemn
from catalog.errors import ManifestInvalid, ManifestMissing, StaleGeneration
from catalog.manifest import Manifest, open_manifest, seal_manifest
from catalog.models import ChunkRow, ManifestChunkRow, ManifestRow
from catalog.publish import MAX_MANIFEST_BYTES, ChunkTally, open_cut, open_mapped_cut
from tests.catalog.helpers import ALICE, BOB, do_publish, find, load_of, payloads, tokens


def count(engine, model) -> int:
    with Session(engine) as s:
        return s.scalar(select(func.count()).select_from(model))


async def keys(store: ChunkStore, kind: str) -> list[str]:
    return await store.objects.list_keys(f"{kind}/")


def test_publish_then_find_and_load(aio, chunk_store, db_engine):
    """Happy path: the published cut is found and loads verified, parts in order; the Cut
    carries the row's facts, so loading reads nothing from the catalog again."""
    h, parts = tokens(1, 300), payloads(1)
    m = aio.run(do_publish(chunk_store, db_engine, h, parts))
    assert (m.depth, m.aligned, m.logits_witnessed) == (300, False, True)
    cut = find(db_engine, h)
    assert (cut.manifest_id, cut.depth, cut.generation) == (m.id, len(h), m.generation)
    assert cut.bytes == sum(len(p) for _, p in parts)
    loaded = aio.run(load_of(chunk_store, db_engine, cut))
    assert loaded.manifest == m
    assert [(r, bytes(v)) for r, v in loaded.parts] == parts
    with Session(db_engine) as s:
        rows = s.execute(select(ManifestChunkRow.role).order_by(ManifestChunkRow.ordinal)).all()
        assert [r.role for r in rows] == [r for r, _ in parts]


def test_same_history_twice_is_one_manifest(aio, chunk_store, db_engine):
    """Idempotency: a second publish returns the first manifest; nothing new is written."""
    h = tokens(3, 512)
    first = aio.run(do_publish(chunk_store, db_engine, h, payloads(3)))
    second = aio.run(do_publish(chunk_store, db_engine, h, payloads(3)))
    assert second == first  # same id, same generation: the stored one
    assert count(db_engine, ManifestRow) == 1
    assert len(aio.run(keys(chunk_store, "manifests"))) == 1


def test_equal_chunks_are_stored_once_across_histories(aio, chunk_store, db_engine):
    """Dedup: two histories sharing a plane store that chunk once (one row, one object)."""
    shared = payloads(4, n=1)
    aio.run(do_publish(chunk_store, db_engine, tokens(4, 256), shared + payloads(5, n=1)))
    aio.run(do_publish(chunk_store, db_engine, tokens(5, 256), shared + payloads(6, n=1)))
    assert count(db_engine, ChunkRow) == 3
    assert len(aio.run(keys(chunk_store, "chunks"))) == 3


def test_eight_concurrent_publishers_asyncio(aio, chunk_store, db_engine):
    """Race: 8 tasks publish the same chunks and history -> all succeed, one manifest,
    one copy of each chunk, one manifest object (losers remove theirs)."""
    h, parts = tokens(6, 700), payloads(6, n=4)

    async def race():
        return await asyncio.gather(
            *(do_publish(chunk_store, db_engine, h, parts) for _ in range(8))
        )

    results = aio.run(race())
    assert len({(m.id, m.generation) for m in results}) == 1
    assert count(db_engine, ManifestRow) == 1
    assert count(db_engine, ChunkRow) == 4
    assert len(aio.run(keys(chunk_store, "chunks"))) == 4
    assert len(aio.run(keys(chunk_store, "manifests"))) == 1


def test_eight_concurrent_publishers_threads(db_engine, tmp_path, keyring):
    """Race across threads (own event loop and store handle each, one directory and
    database): all succeed with the same manifest, one copy of everything."""
    h, parts = tokens(7, 600), payloads(7, n=3)
    results: list[Manifest] = []
    errors: list[BaseException] = []
    everyone_reserved = threading.Barrier(8, timeout=30)

    async def point(name: str) -> None:
        if name == "reserved":  # all 8 are past the idempotency fast path
            await asyncio.to_thread(everyone_reserved.wait)

    def worker():
        store = ChunkStore(LocalDirStore(tmp_path / "objects"), keyring, namespace="test")
        try:
            results.append(asyncio.run(do_publish(store, db_engine, h, parts, checkpoint=point)))
        except BaseException as e:  # reported below with the others
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(results) == 8 and len({(m.id, m.generation) for m in results}) == 1
    assert count(db_engine, ManifestRow) == 1
    store = ChunkStore(LocalDirStore(tmp_path / "objects"), keyring, namespace="test")
    assert len(asyncio.run(keys(store, "chunks"))) == 3
    assert len(asyncio.run(keys(store, "manifests"))) == 1


def test_load_under_another_identity_is_refused(aio, chunk_store, db_engine):
    """Invariant 1: a cut loaded under another identity -> ManifestInvalid, nothing returned."""
    h = tokens(8, 256)
    aio.run(do_publish(chunk_store, db_engine, h, payloads(8)))
    cut = find(db_engine, h)
    with pytest.raises(ManifestInvalid, match=f"identity {ALICE.short}"):
        aio.run(load_of(chunk_store, db_engine, cut, BOB))


async def replace_object(store: ChunkStore, key: str, data: bytes) -> None:
    await store.objects.delete(key)
    assert await store.objects.put_if_absent(key, data)


def test_tampered_manifest_object_is_refused(aio, chunk_store, db_engine):
    """Fault: a flipped bit in the stored manifest -> ManifestInvalid, nothing returned."""
    h = tokens(9, 256)
    aio.run(do_publish(chunk_store, db_engine, h, payloads(9)))
    cut = find(db_engine, h)
    data = bytearray(aio.run(chunk_store.objects.get(cut.object_key)))
    data[-3] ^= 0x04
    aio.run(replace_object(chunk_store, cut.object_key, bytes(data)))
    with pytest.raises(ManifestInvalid):
        aio.run(load_of(chunk_store, db_engine, cut))


def test_manifest_sealed_by_another_vault_is_refused(aio, chunk_store, db_engine, keyring):
    """Fault: a manifest MAC'd by an unknown key (a foreign vault) -> ManifestInvalid."""
    from cas.keys import Keyring

    h = tokens(10, 256)
    m = aio.run(do_publish(chunk_store, db_engine, h, payloads(10)))
    cut = find(db_engine, h)
    aio.run(
        replace_object(chunk_store, cut.object_key, seal_manifest(m, Keyring.generate().rotate()))
    )
    with pytest.raises(ManifestInvalid, match="unknown key"):
        aio.run(load_of(chunk_store, db_engine, cut))


def test_replayed_older_generation_is_refused(aio, chunk_store, db_engine):
    """Invariant 10: an authentic manifest of an older generation in place of the current
    one -> StaleGeneration."""
    h = tokens(11, 256)
    m = aio.run(do_publish(chunk_store, db_engine, h, payloads(11)))
    cut = find(db_engine, h)
    older = Manifest(
        **{**{f: getattr(m, f) for f in m.__dataclass_fields__}, "generation": m.generation - 1}
    )
    aio.run(replace_object(chunk_store, cut.object_key, seal_manifest(older, chunk_store.keyring)))
    with pytest.raises(StaleGeneration) as e:
        aio.run(load_of(chunk_store, db_engine, cut))
    assert (e.value.expected, e.value.got) == (m.generation, m.generation - 1)


def test_manifest_of_another_cut_under_this_key_is_refused(aio, chunk_store, db_engine):
    """Fault: an authentic manifest of a different cut swapped in -> ManifestInvalid."""
    h = tokens(12, 600)
    aio.run(do_publish(chunk_store, db_engine, h[:512], payloads(12)))
    other = aio.run(do_publish(chunk_store, db_engine, h[:256], payloads(13)))
    cut = find(db_engine, h[:512])
    assert cut.depth == 512
    aio.run(replace_object(chunk_store, cut.object_key, seal_manifest(other, chunk_store.keyring)))
    with pytest.raises(ManifestInvalid, match="does not match"):
        aio.run(load_of(chunk_store, db_engine, cut))


def test_corrupt_chunk_returns_nothing(aio, chunk_store, db_engine):
    """Fault: a damaged chunk under a valid manifest -> ChunkCorrupt, no parts returned."""
    h = tokens(14, 256)
    m = aio.run(do_publish(chunk_store, db_engine, h, payloads(14)))
    key = chunk_store.key(m.parts[1].chunk_id)
    data = bytearray(aio.run(chunk_store.objects.get(key)))
    data[len(data) // 2] ^= 0x01
    aio.run(replace_object(chunk_store, key, bytes(data)))
    with pytest.raises(ChunkCorrupt):
        aio.run(load_of(chunk_store, db_engine, find(db_engine, h)))


def test_missing_manifest_object_is_a_verification_failure(aio, chunk_store, db_engine):
    """Fault: the manifest object its row names is gone -> ManifestMissing, a kind of
    ManifestInvalid (the row's promise is broken: a miss, never partial state, and never
    mistaken for an outage)."""
    h = tokens(15, 256)
    aio.run(do_publish(chunk_store, db_engine, h, payloads(15)))
    cut = find(db_engine, h)
    aio.run(chunk_store.objects.delete(cut.object_key))
    with pytest.raises(ManifestMissing) as e:
        aio.run(load_of(chunk_store, db_engine, cut))
    assert isinstance(e.value, ManifestInvalid) and e.value.object_key == cut.object_key


def test_manifest_object_is_sealed_with_the_vault_key(aio, chunk_store, db_engine):
    """What publish stores opens with the vault keyring and matches the catalog row."""
    h = tokens(16, 300)
    m = aio.run(do_publish(chunk_store, db_engine, h, payloads(16)))
    cut = find(db_engine, h)
    assert open_manifest(aio.run(chunk_store.objects.get(cut.object_key)), chunk_store.keyring) == m
    assert cut.object_key.startswith(f"manifests/{ALICE.hex}/{m.id.hex}-")


def test_empty_history_is_refused(aio, chunk_store, db_engine):
    """Bad input: publishing zero tokens -> ValueError."""
    with pytest.raises(ValueError, match="empty history"):
        aio.run(do_publish(chunk_store, db_engine, [], payloads(17)))


def test_generations_increase_strictly_and_never_wrap(monkeypatch):
    """next_generation: strictly increasing even if the clock stalls or steps back;
    past 2**63-1 it raises GenerationExhausted instead of wrapping."""
    from catalog import publish as publish_module
    from catalog.errors import GenerationExhausted

    clock = iter([10**18, 10**18, 10**18 - 5])
    monkeypatch.setattr(publish_module, "_last_generation", 0)
    monkeypatch.setattr(publish_module.time, "time_ns", lambda: next(clock))
    assert [publish_module.next_generation() for _ in range(3)] == [
        10**18,
        10**18 + 1,
        10**18 + 2,
    ]
    monkeypatch.setattr(publish_module.time, "time_ns", lambda: 2**63)
    with pytest.raises(GenerationExhausted):
        publish_module.next_generation()


def test_repeated_parts_share_one_chunk(aio, chunk_store, db_engine):
    """Two parts with equal bytes are one chunk (stored once) and both load back."""
    same = b"\x00" * 256
    h = tokens(18, 256)
    aio.run(do_publish(chunk_store, db_engine, h, [("k", same), ("v", same), ("x", b"x")]))
    assert count(db_engine, ChunkRow) == 2
    loaded = aio.run(load_of(chunk_store, db_engine, find(db_engine, h)))
    assert [(r, bytes(v)) for r, v in loaded.parts] == [("k", same), ("v", same), ("x", b"x")]


def test_publish_digests_each_chunk_once(aio, chunk_store, db_engine, digest_calls):
    """One keyed digest per part on publish: the ids computed up front are the ones the
    store seals under (its check of its own output decrypts and compares, no digest)."""
    calls = digest_calls
    parts = payloads(19, n=4)
    aio.run(do_publish(chunk_store, db_engine, tokens(19, 300), parts))
    assert sorted(calls) == sorted(len(p) for _, p in parts)


def sealing(store: ChunkStore, monkeypatch) -> list[bytes]:
    """The plaintexts `store` seals from now on, in order."""
    sealed: list[bytes] = []
    seal = store._seal.seal

    def counted(chunk_id, data):
        sealed.append(bytes(data))
        return seal(chunk_id, data)

    monkeypatch.setattr(store._seal, "seal", counted)
    return sealed


def test_a_longer_prefix_seals_only_its_new_chunks(aio, chunk_store, db_engine, monkeypatch):
    """A chunk a committed manifest already references is neither sealed nor uploaded
    again: the second cut seals its two new chunks only (tally: 2 sealed, 3 stored), and
    both cuts load back whole."""
    sealed = sealing(chunk_store, monkeypatch)
    h, first, more = tokens(20, 512), payloads(20), payloads(21, n=2)
    one = ChunkTally()
    aio.run(do_publish(chunk_store, db_engine, h[:256], first, tally=one))
    assert (one.sealed, one.stored) == (3, 0) and len(sealed) == 3
    two = ChunkTally()
    aio.run(do_publish(chunk_store, db_engine, h, first + more, tally=two))
    assert (two.sealed, two.stored) == (2, 3)
    assert sealed[3:] == [p for _, p in more]
    for history, parts in ((h[:256], first), (h, first + more)):
        loaded = aio.run(load_of(chunk_store, db_engine, find(db_engine, history)))
        assert [(r, bytes(v)) for r, v in loaded.parts] == parts


def test_a_reserved_chunk_is_not_stored(aio, chunk_store, db_engine, monkeypatch):
    """A chunk row no committed manifest references (a publish reserved it and died before
    uploading) is not "stored": the next publish seals and uploads it."""
    sealed = sealing(chunk_store, monkeypatch)
    h, parts = tokens(22, 256), payloads(22, n=2)

    async def die(name: str) -> None:
        if name == "reserved":
            raise RuntimeError("died after reserving")

    with pytest.raises(RuntimeError):
        aio.run(do_publish(chunk_store, db_engine, h, parts, checkpoint=die))
    assert count(db_engine, ChunkRow) == 2 and not sealed
    tally = ChunkTally()
    aio.run(do_publish(chunk_store, db_engine, h, parts, tally=tally))
    assert (tally.sealed, tally.stored) == (2, 0)
    loaded = aio.run(load_of(chunk_store, db_engine, find(db_engine, h)))
    assert [(r, bytes(v)) for r, v in loaded.parts] == parts


def test_a_stored_chunk_condemned_mid_publish_is_uploaded_afresh(aio, chunk_store, db_engine):
    """Race: the chunk was stored when the publish reserved it, then a read found it broken
    and condemned it (object and row deleted) before the publish committed. The commit's
    re-check restarts the publish, which now seals and uploads the chunk: the new cut
    loads whole (invariant 6)."""
    h, parts = tokens(23, 512), payloads(23, n=2)
    aio.run(do_publish(chunk_store, db_engine, h[:256], parts))
    shared = find(db_engine, h[:256])
    broken = chunk_store.chunk_id(parts[0][1])
    calls = []

    async def condemn_once(name: str) -> None:
        calls.append(name)
        if name == "reserved" and calls.count("reserved") == 1:
            await condemn(objects=chunk_store.objects, db=db_engine,
                          manifest_id=shared.manifest_id, kind="chunk_missing",
                          reason="test", chunk=broken)  # fmt: skip

    tally = ChunkTally()
    more = payloads(24, n=1)
    aio.run(do_publish(chunk_store, db_engine, h, parts + more, checkpoint=condemn_once,
                       tally=tally))  # fmt: skip
    assert calls.count("reserved") == 2  # restarted
    # First attempt: the new chunk sealed, both shared ones stored. The restart: the
    # condemned cut took its references along, so all three are sealed.
    assert (tally.sealed, tally.stored) == (1 + 3, 2 + 0)
    assert find(db_engine, h[:256]) is None  # the condemned cut is gone
    loaded = aio.run(load_of(chunk_store, db_engine, find(db_engine, h)))
    assert [(r, bytes(v)) for r, v in loaded.parts] == parts + more
    assert aio.run(chunk_store.contains(broken))


def test_a_held_manifest_is_not_read_again_and_is_still_checked_against_its_row(
    aio, chunk_store, db_engine
):
    """OpenedManifests (catalog/opened.py): a publish holds the manifest it sealed and an
    open holds the one it read; an open then takes the held one without reading the
    store (a damaged object there goes unnoticed: what is held was verified when read),
    and still refuses it for a row that is not its own (another identity, a stale
    generation, other facts), as after a read."""
    import dataclasses

    from catalog.opened import OpenedManifests

    opened = OpenedManifests()
    h = tokens(32, 600)
    m = aio.run(do_publish(chunk_store, db_engine, h[:512], payloads(32), opened=opened))
    cut = find(db_engine, h[:512])
    assert cut.object_key in opened and len(opened) == 1
    data = bytearray(aio.run(chunk_store.objects.get(cut.object_key)))
    data[-3] ^= 0x04
    aio.run(replace_object(chunk_store, cut.object_key, bytes(data)))
    keyring = chunk_store.keyring
    assert aio.run(open_cut(chunk_store.objects, keyring, cut, ALICE, opened)).manifest == m
    assert open_mapped_cut(chunk_store.objects, keyring, cut, ALICE, opened).manifest == m
    with pytest.raises(ManifestInvalid):  # not held: read, and refused
        aio.run(open_cut(chunk_store.objects, keyring, cut, ALICE))
    rows = [  # another identity's row, a stale generation, other facts
        (BOB, dataclasses.replace(cut, identity=BOB), ManifestInvalid),
        (ALICE, dataclasses.replace(cut, generation=cut.generation + 1), StaleGeneration),
        (ALICE, dataclasses.replace(cut, depth=cut.depth - 1), ManifestInvalid),
    ]
    for asked, row, error in rows:
        with pytest.raises(error):
            aio.run(open_cut(chunk_store.objects, keyring, row, asked, opened))
        with pytest.raises(error):
            open_mapped_cut(chunk_store.objects, keyring, row, asked, opened)
    other = aio.run(do_publish(chunk_store, db_engine, h[:256], payloads(33)))  # not held
    other_cut = find(db_engine, h[:256])
    assert other_cut.object_key not in opened
    assert (
        aio.run(open_cut(chunk_store.objects, keyring, other_cut, ALICE, opened)).manifest == other
    )
    assert other_cut.object_key in opened  # read, verified, held


@pytest.mark.parametrize("fault", ["intact", "flip", "foreign", "stale", "other", "gone", "huge"])
def test_a_manifest_opened_in_place_is_refused_as_a_read_one(aio, tmp_path, keyring, db_engine,
                                                              fault):  # fmt: skip
    """open_mapped_cut (a store that maps its objects, a local directory: on the calling
    thread) answers as open_cut does — the same manifest, or the same error — for an
    intact manifest, a flipped bit, a foreign vault's MAC, an older generation, another
    cut's manifest and a missing object; an object past MAX_MANIFEST_BYTES is
    ManifestInvalid, unread."""
    from cas.keys import Keyring

    chunk_store = ChunkStore(LocalDirStore(tmp_path), keyring, namespace="test")
    h = tokens(30, 600)
    m = aio.run(do_publish(chunk_store, db_engine, h[:512], payloads(30)))
    other = aio.run(do_publish(chunk_store, db_engine, h[:256], payloads(31)))
    cut = find(db_engine, h[:512])
    data = bytearray(aio.run(chunk_store.objects.get(cut.object_key)))
    data[-3] ^= 0x04
    older = Manifest(**{**{f: getattr(m, f) for f in m.__dataclass_fields__},
                        "generation": m.generation - 1})  # fmt: skip
    replaced = {
        "flip": bytes(data),
        "foreign": seal_manifest(m, Keyring.generate().rotate()),
        "stale": seal_manifest(older, chunk_store.keyring),
        "other": seal_manifest(other, chunk_store.keyring),
        "huge": bytes(MAX_MANIFEST_BYTES + 1),
    }
    if fault == "gone":
        aio.run(chunk_store.objects.delete(cut.object_key))
    elif fault in replaced:
        aio.run(replace_object(chunk_store, cut.object_key, replaced[fault]))
    keyring = chunk_store.keyring

    def outcome(opener):
        try:
            return opener().manifest
        except (ManifestInvalid, StaleGeneration) as e:
            return type(e), str(e)

    read = outcome(lambda: aio.run(open_cut(chunk_store.objects, keyring, cut, ALICE)))
    in_place = outcome(lambda: open_mapped_cut(chunk_store.objects, keyring, cut, ALICE))
    if fault == "huge":
        assert in_place[0] is ManifestInvalid
        assert in_place[1].endswith(f"{cut.object_key} has {MAX_MANIFEST_BYTES + 1} bytes")
        assert read[0] is ManifestInvalid
    else:
        assert in_place == read
        assert (read == m) is (fault == "intact")
