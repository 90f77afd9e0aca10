"""LocalDirStore specifics: atomic put-if-absent across processes, no visible temp files,
OS errors translated once, chunks opened from mapped files, files preloaded."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

from cas.chunks import ChunkStore
from cas.errors import ChunkCorrupt, ChunkMissing, StoreUnavailable
from cas.keys import Keyring
from cas.local import TEMP_PREFIX, LocalDirStore, Mapped
from tests.fixtures.pages import evicted, pages, resident


def _put_from_process(root: str, body: bytes) -> bool:
    return asyncio.run(LocalDirStore(root).put_if_absent("chunks/aa/race", body))


def test_put_if_absent_is_atomic_across_processes(tmp_path):
    """4 processes race to create one key: one wins, its complete bytes are what is stored."""
    bodies = [bytes([i]) * 300_000 for i in range(4)]
    with ProcessPoolExecutor(4) as pool:
        created = list(pool.map(_put_from_process, [str(tmp_path)] * 4, bodies))
    assert created.count(True) == 1
    stored = (tmp_path / "chunks" / "aa" / "race").read_bytes()
    assert stored == bodies[created.index(True)]


def test_no_temp_files_remain_or_show(tmp_path):
    """After puts (created and existed) no temp file is left; list_keys never shows one."""
    store = LocalDirStore(tmp_path)
    asyncio.run(store.put_if_absent("a/b", b"1"))
    asyncio.run(store.put_if_absent("a/b", b"2"))
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b"]
    (tmp_path / "a" / f"{TEMP_PREFIX}stray").write_bytes(b"x")  # a crashed writer's leftover
    assert asyncio.run(store.list_keys("a/")) == ["a/b"]
    with pytest.raises(ValueError):
        asyncio.run(store.put_if_absent(f"a/{TEMP_PREFIX}x", b"x"))


def test_os_errors_become_store_unavailable(tmp_path):
    """A root that is not a directory: writes raise StoreUnavailable naming the op and key."""
    root = tmp_path / "file"
    root.write_bytes(b"not a dir")
    store = LocalDirStore(root)
    with pytest.raises(StoreUnavailable) as e:
        asyncio.run(store.put_if_absent("k/1", b"x"))
    assert (e.value.op, e.value.key) == ("put", "k/1")


def test_chunks_open_where_their_files_lie(tmp_path, keyring, aio, monkeypatch):
    """A local store's chunks are opened from their mapped files, one on a hash lane: no
    scratch buffer is lent, the bytes come back intact, every mapping is unmapped once
    the call has returned, and a flipped bit in a file is refused."""
    store = ChunkStore(LocalDirStore(tmp_path), keyring, namespace="test")
    blobs = [os.urandom(3 << 20), os.urandom(5000)]
    refs = aio.run(store.put_many(blobs))
    lent, mappings = [], []
    monkeypatch.setattr(store.scratch, "lend", lambda size: lent.append(size))
    real = Mapped.__init__
    monkeypatch.setattr(Mapped, "__init__", lambda m, area: (mappings.append(m), real(m, area))[1])
    assert aio.run(store.get_many(refs)).tobytes() == b"".join(blobs)
    assert lent == [] and len(mappings) == 2
    assert all(m._area.closed for m in mappings)
    path = tmp_path / store.key(refs[0].id)
    path.write_bytes(flipped(path.read_bytes(), 100))
    with pytest.raises(ChunkCorrupt, match="tag"):
        aio.run(store.get_many(refs))


def flipped(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


@pytest.mark.parametrize(
    ("damage", "error", "reason"),
    [
        ("flip", ChunkCorrupt, "tag"),
        ("truncate", ChunkCorrupt, "plaintext bytes"),
        ("empty", ChunkCorrupt, "magic"),
        ("pad", ChunkCorrupt, "too many"),
        ("relabel", ChunkCorrupt, "tag"),
        ("foreign", ChunkCorrupt, "tag"),
        ("gone", ChunkMissing, "missing"),
    ],
)
def test_a_chunk_damaged_on_disk_is_refused_from_its_mapping(tmp_path, keyring, aio, damage,
                                                             error, reason):  # fmt: skip
    """Each way a chunk's file can be damaged in place — a flipped bit, truncation, an
    empty file, bytes appended, another chunk's file under its name, the same plaintext
    sealed by another vault, the file gone — is refused from the mapped file, naming the
    chunk."""
    store = ChunkStore(LocalDirStore(tmp_path / "ours"), keyring, namespace="test")
    plain = os.urandom(2 << 20)
    ref, other = aio.run(store.put_many([plain, os.urandom(2 << 20)]))
    path = tmp_path / "ours" / store.key(ref.id)
    data = path.read_bytes()
    theirs = ChunkStore(LocalDirStore(tmp_path / "theirs"), Keyring.generate(), namespace="test")
    foreign = aio.run(theirs.put(plain))
    damaged = {
        "flip": lambda: flipped(data, len(data) // 2),
        "truncate": lambda: data[:-1],
        "empty": lambda: b"",
        "pad": lambda: data + bytes(4096),
        "relabel": lambda: (tmp_path / "ours" / store.key(other.id)).read_bytes(),
        "foreign": lambda: (tmp_path / "theirs" / theirs.key(foreign.id)).read_bytes(),
    }
    if damage == "gone":
        path.unlink()
    else:
        path.write_bytes(damaged[damage]())
    with pytest.raises(error, match=reason) as caught:
        aio.run(store.get(ref))
    assert caught.value.chunk_id == ref.id


def test_warm_keeps_no_scratch_buffer_for_a_store_that_maps(tmp_path, keyring, aio, monkeypatch):
    """warm on a local store maps the probe key once per chunk in flight and keeps no
    scratch buffer (its reads lend none); it writes nothing."""
    objects = LocalDirStore(tmp_path)
    probed: list[str] = []
    real = objects.map

    def recording(key, limit):
        probed.append(key)
        return real(key, limit)

    monkeypatch.setattr(objects, "map", recording)
    store = ChunkStore(objects, keyring, namespace="test", max_concurrency=3)
    aio.run(store.warm(50_000, probe_key="ready/probe"))
    assert probed == ["ready/probe"] * 3 and store.scratch.held_bytes == 0
    assert aio.run(objects.list_keys("")) == []


def test_open_mapped_fills_destinations_from_the_callers_thread(tmp_path, keyring, aio):
    """open_mapped opens every chunk into its segments on the opener threads while
    `meanwhile` runs on the calling thread, and returns with every byte in place."""
    store = ChunkStore(LocalDirStore(tmp_path), keyring, namespace="test")
    blobs = [os.urandom(2 << 20), os.urandom(3000), os.urandom(70_000)]
    refs = aio.run(store.put_many(blobs))
    outs = [bytearray(len(b)) for b in blobs]
    segments = [[memoryview(o)[:100], memoryview(o)[100:]] for o in outs]
    ran_on: list[str] = []
    store.open_mapped(refs, segments, lambda: ran_on.append(threading.current_thread().name))
    assert outs == [bytearray(b) for b in blobs]
    assert ran_on == [threading.current_thread().name]


def test_open_mapped_raises_only_once_every_open_has_ended(tmp_path, keyring, aio):
    """Chunk A is being opened (its opener blocked) when chunk B's file turns out gone:
    open_mapped raises ChunkMissing only after A's opener has finished writing."""
    store = ChunkStore(LocalDirStore(tmp_path), keyring, namespace="test")
    ref_a, ref_b = aio.run(store.put_many([os.urandom(5000), os.urandom(5000)]))
    (tmp_path / store.key(ref_b.id)).unlink()
    a_opening, release = threading.Event(), threading.Event()
    events: list[str] = []
    real_open = store._seal.open_into

    def slow_open(chunk_id, sealed, out, **kw):
        if chunk_id == ref_a.id:
            a_opening.set()
            release.wait(10)
        real_open(chunk_id, sealed, out, **kw)
        if chunk_id == ref_a.id:
            events.append("A written")

    store._seal.open_into = slow_open
    outs = [memoryview(bytearray(r.size)) for r in (ref_a, ref_b)]

    def call() -> None:
        try:
            store.open_mapped([ref_a, ref_b], outs)
        except ChunkMissing:
            events.append("raised")

    caller = threading.Thread(target=call)
    caller.start()
    assert a_opening.wait(10)
    caller.join(0.2)
    events.append("still running" if caller.is_alive() else "returned early")
    release.set()
    caller.join(10)
    assert events == ["still running", "A written", "raised"]


def test_preload_reads_the_files_into_the_page_cache(tmp_path):
    """Each object's file, its pages dropped from the page cache, is all in it again after
    preload, and counted; a missing key is skipped, not an error; past its deadline it
    starts no file."""
    store = LocalDirStore(tmp_path)
    sizes = {"chunks/aa/one": 3 << 20, "chunks/bb/two": 5000}
    for key, size in sizes.items():
        asyncio.run(store.put_if_absent(key, os.urandom(size)))
    paths = evicted(tmp_path / key for key in sizes)
    assert store.preload(sizes, until=time.monotonic() - 1) == (0, 0)
    assert [resident(p) for p in paths] == [0, 0]
    assert store.preload([*sizes, "chunks/cc/missing"]) == (2, sum(sizes.values()))
    assert [resident(p) for p in paths] == [pages(p) for p in paths]
