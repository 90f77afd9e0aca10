"""The read path: get_into straight into the caller's buffers, scratch buffers reused
across chunks, and no worker writing into a destination after a failed call returns."""

from __future__ import annotations

import asyncio
import os
import threading
from contextlib import contextmanager

import pytest

from cas.buffers import HUGE_PAGE, ScratchPool, fresh_buffer, scatter
from cas.chunks import ChunkStore
from cas.errors import ChunkMissing, ObjectMissing
from cas.seal import max_sealed_size
from tests.cas.faults import Wrapper


def test_get_into_fills_each_destination_in_ref_order(chunk_store, aio):
    """Each chunk lands in its own destination (repeats included); the caller's buffer
    objects are the ones written, no other buffer is returned."""
    blobs = [os.urandom(1000 + 13 * i) for i in range(4)] + [b""]
    refs = aio.run(chunk_store.put_many(blobs))
    order = [refs[2], refs[0], refs[2], refs[4], refs[3]]
    outs = [bytearray(r.size) for r in order]
    assert aio.run(chunk_store.get_into(order, [memoryview(o) for o in outs])) is None
    assert outs == [bytearray(blobs[i]) for i in (2, 0, 2, 4, 3)]


def test_get_into_refuses_unfit_destinations(chunk_store, aio):
    """A destination of the wrong size, a read-only one or a count mismatch: ValueError
    before anything is fetched."""
    ref = aio.run(chunk_store.put(b"x" * 100))
    for outs in ([memoryview(bytearray(99))], [memoryview(bytes(100))], []):
        with pytest.raises(ValueError):
            aio.run(chunk_store.get_into([ref], outs))


def recorded_lends(store: ChunkStore, monkeypatch) -> list[int]:
    """The ids of the buffers the store's scratch pool lends from now on, in order."""
    seen: list[int] = []
    lend = store.scratch.lend

    @contextmanager
    def recording(size):
        with lend(size) as view:
            seen.append(id(view.obj))
            yield view

    monkeypatch.setattr(store.scratch, "lend", recording)
    return seen


def test_scratch_buffers_are_reused_across_chunks(object_store, keyring, aio, monkeypatch):
    """Six chunks read with max_concurrency=2 land in at most two scratch buffers, and a
    second call reuses them (no fresh buffer per chunk). Through a wrapper, which reads
    a local store's objects rather than map them."""
    store = ChunkStore(Wrapper(object_store), keyring, namespace="test", max_concurrency=2)
    blobs = [os.urandom(20_000) for _ in range(6)]
    refs = aio.run(store.put_many(blobs))
    seen = recorded_lends(store, monkeypatch)
    assert aio.run(store.get_many(refs)).tobytes() == b"".join(blobs)
    first = set(seen)
    assert len(seen) == 6 and len(first) <= 2
    aio.run(store.get_many(refs))
    assert set(seen) == first


class _FailAfter(Wrapper):
    """get_into of `key` waits for `event`, then says the object is gone."""

    def __init__(self, inner, key: str, event: asyncio.Event) -> None:
        super().__init__(inner)
        self.key, self.event = key, event

    async def get_into(self, key: str, out: memoryview) -> int:
        if key == self.key:
            await self.event.wait()
            raise ObjectMissing(key)
        return await self.inner.get_into(key, out)


def test_failed_call_returns_only_after_every_open_has_ended(object_store, keyring, aio):
    """Chunk A is being opened (its worker blocked) when chunk B turns out missing: get_into
    raises ChunkMissing only once A's worker has finished writing into A's destination."""

    async def scenario():
        plain = ChunkStore(object_store, keyring, namespace="test")
        ref_a, ref_b = await plain.put_many([os.urandom(5000), os.urandom(5000)])
        a_opening, release = asyncio.Event(), threading.Event()
        events: list[str] = []
        loop = asyncio.get_running_loop()
        store = ChunkStore(
            _FailAfter(object_store, plain.key(ref_b.id), a_opening), keyring, namespace="test"
        )
        real_open = store._seal.open_into

        def slow_open(chunk_id, sealed, out, *, digest_key, **kw):
            loop.call_soon_threadsafe(a_opening.set)
            release.wait(10)
            real_open(chunk_id, sealed, out, digest_key=digest_key, **kw)
            events.append("A written")

        store._seal.open_into = slow_open
        outs = [memoryview(bytearray(r.size)) for r in (ref_a, ref_b)]
        task = asyncio.ensure_future(store.get_into([ref_a, ref_b], outs))
        await a_opening.wait()
        done, _ = await asyncio.wait([task], timeout=0.2)
        events.append("still running" if not done else "returned early")
        release.set()
        with pytest.raises(ChunkMissing):
            await task
        events.append("raised")
        return events

    assert aio.run(scenario()) == ["still running", "A written", "raised"]


class _Recorded(Wrapper):
    """Records the keys read and the greatest number of reads in flight at once."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.keys: list[str] = []
        self.flying = self.most = 0

    async def get_into(self, key: str, out: memoryview) -> int:
        self.keys.append(key)
        self.flying += 1
        self.most = max(self.most, self.flying)
        try:
            await asyncio.sleep(0.01)  # the others start meanwhile
            return await self.inner.get_into(key, out)
        finally:
            self.flying -= 1


def test_warm_sets_up_a_read_per_chunk_in_flight_and_writes_nothing(object_store, keyring, aio,
                                                                    monkeypatch):  # fmt: skip
    """warm(size): the probe key is read once per chunk in flight, all at once (a
    connection each), the pool then holds that many scratch buffers for chunks of `size`
    bytes, the next read of such a chunk takes one of them, and no object was written."""
    recorded = _Recorded(object_store)
    store = ChunkStore(recorded, keyring, namespace="test", max_concurrency=3)
    lent = recorded_lends(store, monkeypatch)
    aio.run(store.warm(50_000, probe_key="ready/probe"))
    assert recorded.keys == ["ready/probe"] * 3 and recorded.most == 3
    assert store.scratch.held_bytes == 3 * max_sealed_size(50_000)
    assert aio.run(object_store.list_keys("")) == []
    warmed = set(lent)
    ref = aio.run(store.put(os.urandom(50_000)))
    aio.run(store.get(ref))
    assert len(warmed) == 3 and len(lent) == 4 and lent[3] in warmed


def test_scratch_pool_lends_and_keeps():
    """lend gives exactly `size` bytes of a buffer it takes back (the same buffer next
    time, grown when too small); it keeps at most `keep`; a loan ended by an error is taken
    back, one ended by cancellation is not."""
    pool = ScratchPool(keep=1)
    with pool.lend(100) as a:
        assert a.nbytes == 100 and not a.readonly
        first = a.obj
    with pool.lend(50) as b:
        assert b.obj is first
        with pool.lend(10) as c:  # the only kept buffer is out: a new one
            assert c.obj is not first
    assert pool.held_bytes == 100  # keep=1: the second is dropped
    with pool.lend(200) as d:
        assert d.obj is not first and d.nbytes == 200
    assert pool.held_bytes == 200
    with pytest.raises(KeyError), pool.lend(10):
        raise KeyError("a typed failure after the read")
    assert pool.held_bytes == 200
    with pytest.raises(asyncio.CancelledError), pool.lend(10):
        raise asyncio.CancelledError
    assert pool.held_bytes == 0
    with pytest.raises(ValueError):
        ScratchPool(keep=-1)


def test_fresh_buffers_are_writable_zeros_of_the_size_asked():
    """fresh_buffer: small (a bytearray) and large (a mapping) alike, exactly `size`
    writable zero bytes that keep what is written, independent of each other."""
    for size in (0, 10, HUGE_PAGE - 1, HUGE_PAGE, 3 * HUGE_PAGE + 5):
        a, b = fresh_buffer(size), fresh_buffer(size)
        assert a.nbytes == size and not a.readonly and a.tobytes() == bytes(size)
        if size:
            a[size - 1] = 7
            assert a[size - 1] == 7 and b[size - 1] == 0


def test_scatter_copies_across_segments_in_order_and_refuses_another_total():
    """scatter: every byte lands in its segment in order (a strided layout, nothing
    between the segments touched); segments of another total are a ValueError naming the
    sizes, with nothing written."""
    data = os.urandom(500)
    target = memoryview(bytearray(1000))
    strided = [target[i : i + 100] for i in range(0, 1000, 200)]
    scatter(data, strided)
    assert b"".join(s.tobytes() for s in strided) == data
    assert all(target[i + 100 : i + 200].tobytes() == bytes(100) for i in range(0, 1000, 200))
    short = [memoryview(bytearray(100)) for _ in range(4)]
    with pytest.raises(ValueError, match="for 500"):
        scatter(data, short)
    assert all(s.tobytes() == bytes(100) for s in short)


def test_get_into_segments(chunk_store, aio):
    """A destination may be segments: each chunk fills its pieces in order (a strided
    layout: every other 100 bytes of one buffer); segments of the wrong total are a
    ValueError before anything is fetched."""
    data = [os.urandom(1000), os.urandom(300)]
    refs = aio.run(chunk_store.put_many(data))
    target = memoryview(bytearray(2000))
    strided = [target[i : i + 100] for i in range(0, 2000, 200)]
    plain = memoryview(bytearray(300))
    aio.run(chunk_store.get_into(refs, [strided, [plain[:10], plain[10:]]]))
    assert b"".join(s.tobytes() for s in strided) == data[0] and plain.tobytes() == data[1]
    assert all(target[i + 100 : i + 200].tobytes() == bytes(100) for i in range(0, 2000, 200))
    with pytest.raises(ValueError):
        aio.run(chunk_store.get_into(refs[:1], [strided[:-1]]))
