"""Warm start (kvpack/service/warm.py) on the tiny model: the object store's client, the
hash lanes and a catalog connection exist afterwards, the shadow's crossover is measured
and a hit's stamp has run once, on the embedded default and on S3 + PostgreSQL; a restart
reads the recently used cuts' chunk files back into the page cache, and on S3 one recent
chunk through a hit's read path; the
engine ran a prefill, restore and decode, and left nothing behind (no cut, no counter, a
fresh slot, the same cold answer as a service that never warmed)."""

from __future__ import annotations

import gc
import logging

import pytest

from cas.chunks import DEFAULT_CONCURRENCY
from cas.ids import ChunkId
from catalog import queries
from catalog.models import ManifestRow
from catalog.opened import OpenedManifests
from engine import unfilled
from kvpack.config import Settings
from kvpack.service.service import FRAME_ROOM, CompletionRequest
from kvpack.service.warm import warm
from tests.engine.slotkit import TINY_A
from tests.fixtures.pages import evicted, pages, resident

PROMPT = list(range(3, 3 + 2 * TINY_A + 5))
PHASES = {
    "memory",
    "shadow",
    "store",
    "manifests",
    "chunk",
    "cache",
    "catalog",
    "engine",
    "objects",
}


def published_by_a_first_service(settings: Settings, open_service) -> None:
    """PROMPT's cuts published into the vault by a service that then closes."""
    first = open_service(settings)
    assert first.complete(CompletionRequest(tokens=PROMPT, max_tokens=2)).tier == "none"
    assert first.flush(30)
    first.close()


@pytest.fixture(autouse=True)
def _as_found(monkeypatch):
    """warm() freezes the process's objects, and measures the shadow's crossover: the
    test process goes on collecting them, with the crossover it had."""
    monkeypatch.setattr(unfilled, "_crossover", unfilled._crossover)
    yield
    gc.unfreeze()


def test_warm_opens_the_store_and_catalog_and_leaves_no_trace(shared_settings, open_service,
                                                              caplog):  # fmt: skip
    """Branches: each dependency answered (no warning); the store's client, the durable
    reader's scratch buffers (where the store maps its objects: its opener threads) and
    a pooled catalog connection are there before any request; the objects left are
    frozen out of the garbage collector's later passes; nothing was published or
    counted."""
    service = open_service(shared_settings)
    vault = service.vault
    stamped: list[object] = []
    touch_cut = vault.touch_cut
    vault.touch_cut = lambda manifest_id: stamped.append(manifest_id) or touch_cut(manifest_id)  # type: ignore[method-assign]
    unfilled._crossover = -1  # not a crossover: warm must measure one
    with caplog.at_level(logging.WARNING, logger="kvpack.service.warm"):
        seconds = warm(service)
    assert set(seconds) == PHASES and not caplog.records
    assert unfilled._crossover > 0
    assert gc.get_freeze_count() > 0  # startup's objects are out of later full collections
    if hasattr(vault.objects, "breaker"):  # S3: the client exists on the vault's loop
        assert vault.objects._conn is not None and vault.objects._conn.loop is vault.io.loop
    assert vault.db.pool.checkedin() >= 1
    assert len(stamped) == 1  # a hit's stamp ran once, of no cut (none exists: below)
    tenant = service.tenant(service.loaded.identity.namespace)
    block = service.loaded.layout.cache_bytes(service.loaded.alignment)
    chunks = vault.chunks(tenant.scope.namespace)
    if chunks.maps:  # a local store's files are mapped: no scratch, an opener per chunk
        assert chunks.scratch.held_bytes == 0
        assert len(chunks.openers._threads) == DEFAULT_CONCURRENCY
    else:  # a scratch buffer of a block per chunk in flight
        assert chunks.scratch.held_bytes >= DEFAULT_CONCURRENCY * block > 0
    lanes = vault.chunks(tenant.scope.namespace).lanes  # the hash lanes' threads started
    lent = [lanes.take() for _ in range(lanes.size)]
    assert all(lane is not None and lane.thread.is_alive() for lane in lent)
    assert all(slot.depth == 0 for slot in tenant.pool.slots)
    assert service.flush(30) and service.background.stats()["done"] == 0
    assert len(service.resident) == 0 and vault.stats().total.cuts == 0
    assert service.accounting.total("kvpack_restored_tokens_total") == 0


def test_a_warmed_service_answers_as_a_cold_one(tmp_path, open_service):
    """The first request after warming is cold (the warm-up published nothing) and its
    output is a never-warmed service's, token for token."""
    outputs = []
    for name, warmed in (("plain", False), ("warmed", True)):
        settings = Settings.load(data_dir=tmp_path / name, alignment=TINY_A, env={})
        service = open_service(settings)
        if warmed:
            warm(service)
        done = service.complete(CompletionRequest(tokens=PROMPT, max_tokens=8))
        assert done.tier == "none"
        outputs.append(done.tokens)
    assert outputs[0] == outputs[1]


def test_warm_with_the_store_unreachable_logs_and_goes_on(tmp_path, open_service, caplog):
    """Branch: a dependency that does not answer is skipped with a warning; warm-up ends
    (readiness reports the outage; the server still starts)."""
    settings = Settings.load(
        data_dir=tmp_path / "vault", alignment=TINY_A, env={}, store_url="s3://nowhere/x",
        s3_endpoint="http://127.0.0.1:9", s3_access_key="k", s3_secret_key="s",
    )  # fmt: skip
    service = open_service(settings)
    with caplog.at_level(logging.WARNING, logger="kvpack.service.warm"):
        seconds = warm(service)
    assert set(seconds) == PHASES
    skipped = [r.getMessage() for r in caplog.records if r.name == "kvpack.service.warm"]
    assert len(skipped) == 1 and skipped[0].startswith("warm start: store skipped")


@pytest.mark.parametrize("preload", ["1GiB", "0"])
def test_a_restart_reads_the_recently_used_cuts_back_into_memory(tmp_path, open_service,
                                                                  preload):  # fmt: skip
    """The cache phase: the chunk files of the cuts a first service published, dropped
    from the page cache, are all in it again once a restarted service has warmed; with
    the preload setting "0" they stay on the disk."""
    env = {"KVPACK_PRELOAD": preload}
    settings = Settings.load(data_dir=tmp_path / "vault", alignment=TINY_A, env=env)
    published_by_a_first_service(settings, open_service)
    files = evicted(p for p in (tmp_path / "vault" / "objects" / "chunks").rglob("*")
                    if p.is_file())  # fmt: skip
    assert len(files) >= 2  # the prompt's aligned blocks, at least
    warm(open_service(settings))
    expected = [pages(p) for p in files] if preload != "0" else [0] * len(files)
    assert [resident(p) for p in files] == expected


def test_a_restart_opens_the_recently_used_cuts_manifests(shared_settings, open_service):
    """The manifests phase: a restarted service holds the manifests of the cuts a first
    one published, opened and checked against their rows, so its first durable hit
    reads no manifest object from the store, only the cut's chunks."""
    published_by_a_first_service(shared_settings, open_service)
    second = open_service(shared_settings)
    vault = second.vault
    published = vault.read(lambda s: queries.recent_cuts(session=s, limit=100))
    assert len(published) >= 2 and len(vault.opened) == 0
    warm(second)
    assert all(cut.object_key in vault.opened for cut in published)
    read: list[str] = []
    store = vault.objects
    for name in ("get", "get_into", "map"):  # every way a store hands over an object
        if hasattr(store, name):
            real = getattr(store, name)
            setattr(
                store, name, lambda key, *a, real=real, **k: read.append(key) or real(key, *a, **k)
            )
    assert second.complete(CompletionRequest(tokens=PROMPT, max_tokens=2)).tier == "durable"
    manifests = {cut.object_key for cut in published}
    assert read and not manifests & set(read)  # the chunks, and no manifest


def test_a_restart_reads_a_recent_cuts_first_chunk_as_a_hit_would(
    shared_settings, open_service, monkeypatch
):
    """The chunk phase: a restarted service on S3 reads the first chunk of its most
    recently used cut through the chunk store's read (the direct GET, opened behind the
    read), so its first durable hit runs none of that path for the first time; nothing
    is served, counted or stamped. From a local directory it reads none: which chunk
    files come back into memory is the preload setting's to say. The recent cuts are
    the manifests phase's: the catalog is asked for them once."""
    published_by_a_first_service(shared_settings, open_service)
    asked = []
    recent_cuts = queries.recent_cuts
    monkeypatch.setattr(queries, "recent_cuts", lambda **k: asked.append(k) or recent_cuts(**k))
    second = open_service(shared_settings)
    vault = second.vault
    scope = second.tenant(second.loaded.identity.namespace).scope
    chunks = vault.chunks(scope.namespace)
    read: list[tuple[ChunkId, int]] = []
    get_into = chunks.get_into

    async def recorded(refs, outs):
        read.extend((ref.id, ref.size) for ref in refs)
        await get_into(refs, outs)

    chunks.get_into = recorded  # type: ignore[method-assign]
    warm(second)
    assert len(asked) == 1
    newest = vault.read(lambda s: recent_cuts(session=s, limit=1))[0]
    first_chunk = vault.opened.get(newest.object_key).manifest.chunk_refs[0]
    assert read == ([] if chunks.maps else [(first_chunk.id, first_chunk.size)])
    assert second.flush(30) and second.background.stats()["done"] == 0
    assert second.accounting.total("kvpack_restored_tokens_total") == 0
    with vault.transaction() as s:
        assert s.get(ManifestRow, newest.manifest_id.hex).hits == 0


def test_preloading_manifests_skips_one_that_does_not_open(shared_settings, open_service):
    """Vault.preload_manifests: the most recently used cuts first, at most `count`; a
    damaged manifest object is skipped, not held, and the others are."""
    published_by_a_first_service(shared_settings, open_service)
    vault = open_service(shared_settings).vault
    newest, *older = vault.read(lambda s: queries.recent_cuts(session=s, limit=100))
    assert vault.preload_manifests(1, 10.0) == [newest] and len(vault.opened) == 1
    assert newest.object_key in vault.opened
    vault.opened = OpenedManifests()
    data = bytearray(vault.run(vault.objects.get(newest.object_key)))
    data[-3] ^= 0x04
    vault.run(vault.objects.delete(newest.object_key))
    assert vault.run(vault.objects.put_if_absent(newest.object_key, bytes(data)))
    assert vault.preload_manifests(100, 10.0) == older and len(older) >= 1
    assert newest.object_key not in vault.opened
    assert all(cut.object_key in vault.opened for cut in older)


def test_the_restore_reserve_is_two_full_context_slots_unless_set(tmp_path, open_service):
    """Service.restore_reserve (what the memory phase maps): by default twice one slot's
    caches at the model's full context (the restore, and the slot's copy of it while the
    promotion holds it) and the durable reader's scratch buffers; the restore_reserve
    setting replaces it ("0": none)."""
    default = open_service(Settings.load(data_dir=tmp_path / "a", alignment=TINY_A, env={}))
    loaded = default.loaded
    # a scratch buffer per chunk in flight: a block's caches and its frame's room
    block = loaded.layout.cache_bytes(loaded.alignment) + FRAME_ROOM
    full = loaded.layout.cache_bytes(loaded.context_length)
    assert default.restore_reserve == 2 * full + DEFAULT_CONCURRENCY * block > 2 * full > 0
    env = {"KVPACK_RESTORE_RESERVE": "0"}
    none = open_service(Settings.load(data_dir=tmp_path / "b", alignment=TINY_A, env=env))
    assert none.restore_reserve == 0
