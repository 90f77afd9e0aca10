"""cas/trail.py: a chunk opened behind its read, run by run as its bytes land — driven by
hand (the runs a store's read reports), then through ChunkStore on the real stores (the
direct S3 GET reports its runs; fault injection wraps the real S3 client)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading

import pytest

from cas.buffers import PIECE
from cas.chunks import ChunkStore
from cas.errors import ChunkCorrupt, UnknownKey
from cas.ids import ChunkId
from cas.keys import Keyring
from cas.s3 import S3Store
from cas.seal import ChunkSeal
from cas.trail import Stopped, Trail
from tests.cas.v1seal import seal_v1

SIZE = 3 * PIECE + 12_345  # four runs, the last one short
NAMESPACE = "test"


class Sealed:
    """One chunk sealed under `keyring`, as its object store holds it."""

    def __init__(self, keyring: Keyring, plaintext: bytes, *, v1: bool = False) -> None:
        self.keyring, self.plaintext = keyring, plaintext
        self.key = keyring.digest_key(NAMESPACE)
        self.id = ChunkId.of(plaintext, key=self.key)
        seal = ChunkSeal(keyring)
        self.bytes = bytearray(
            seal_v1(keyring, self.id, plaintext) if v1 else seal.seal(self.id, plaintext)
        )
        self.scratch = memoryview(bytearray(len(self.bytes) + 100))  # a pool's, larger
        self.scratch[: len(self.bytes)] = self.bytes

    def trail(self, keyring: Keyring | None = None, chunk_id: ChunkId | None = None) -> Trail:
        seal = ChunkSeal(keyring or self.keyring)
        return Trail(seal, chunk_id or self.id, self.scratch, self.key)

    def runs(self) -> list[int]:
        return runs(len(self.bytes))


def runs(size: int) -> list[int]:
    """The counts a store's read of `size` bytes reports: PIECE at a time, then the rest."""
    return [*range(PIECE, size, PIECE), size]


def segments(size: int) -> tuple[bytearray, list[memoryview]]:
    """A destination in uneven segments, so runs and segments split each other."""
    out = bytearray(b"\xaa" * size)
    view, cuts = memoryview(out), [0, 1000, 300_000, PIECE + 7, 2 * PIECE + 4096, size]
    return out, [view[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]


@pytest.fixture
def chunk() -> Sealed:
    return Sealed(Keyring.generate(), os.urandom(SIZE))


def test_runs_are_opened_as_they_land(chunk):
    """With the destinations made first, each run is decrypted into them while the read
    goes on: after the first run, the plaintext's first bytes are already in place."""
    out, segs = segments(SIZE)
    trail = chunk.trail()
    trail.arrived(segs)
    first, *rest = chunk.runs()
    trail.landed(first, len(chunk.bytes))
    assert out[: PIECE // 2] == chunk.plaintext[: PIECE // 2]
    assert out[-100:] == b"\xaa" * 100  # not landed yet, not written
    for n in rest:
        trail.landed(n, len(chunk.bytes))
    trail.finish(len(chunk.bytes), segs)
    assert out == chunk.plaintext


def test_the_last_run_ends_the_chunk_on_the_reading_thread(chunk):
    """The landing of the last bytes opens the rest and checks the tag and the digest
    there: the destination is whole before `finish`, which has nothing left to do."""
    out, segs = segments(SIZE)
    trail = chunk.trail()
    trail.arrived(segs)
    *most, last = chunk.runs()
    for n in most:
        trail.landed(n, len(chunk.bytes))
    assert not trail.ended(len(chunk.bytes))
    trail.landed(last, len(chunk.bytes))
    assert trail.ended(len(chunk.bytes)) and out == chunk.plaintext
    trail.finish(len(chunk.bytes), segs)
    assert out == chunk.plaintext


def test_a_failed_check_on_the_reading_thread_is_raised_by_finish(chunk):
    """A chunk that fails its tag as its last bytes land does not fail the read (its
    bytes all arrived): the failure is kept, and `finish` raises it."""
    _, segs = segments(SIZE)
    trail, size = _tampered(chunk, "tag")
    trail.arrived(segs)
    for n in runs(size):
        trail.landed(n, size)  # no raise: the read succeeded
    assert trail.ended(size)
    with pytest.raises(ChunkCorrupt, match="tag"):
        trail.finish(size, segs)


def test_destinations_made_mid_read_are_opened_from_the_start(chunk):
    """Runs that land before the destinations exist wait in the scratch buffer; the next
    run opens them all, from the first byte."""
    out, segs = segments(SIZE)
    trail = chunk.trail()
    runs = chunk.runs()
    for n in runs[:2]:
        trail.landed(n, len(chunk.bytes))
    assert out == b"\xaa" * SIZE
    trail.arrived(segs)
    trail.landed(runs[2], len(chunk.bytes))
    assert out[: 2 * PIECE] == chunk.plaintext[: 2 * PIECE]
    trail.landed(runs[3], len(chunk.bytes))
    trail.finish(len(chunk.bytes), segs)
    assert out == chunk.plaintext


def test_destinations_made_after_the_read_open_whole(chunk):
    out = bytearray(SIZE)
    trail = chunk.trail()
    for n in chunk.runs():
        trail.landed(n, len(chunk.bytes))
    trail.finish(len(chunk.bytes), memoryview(out))
    assert out == chunk.plaintext


def test_a_format_1_chunk_opens_whole_after_the_read():
    """GCM-SIV cannot stream: nothing is written while it lands, all of it after."""
    chunk = Sealed(Keyring.generate(), os.urandom(SIZE), v1=True)
    out, segs = segments(SIZE)
    trail = chunk.trail()
    trail.arrived(segs)
    for n in chunk.runs():
        trail.landed(n, len(chunk.bytes))
    assert out == b"\xaa" * SIZE
    trail.finish(len(chunk.bytes), segs)
    assert out == chunk.plaintext


def test_a_retried_read_moves_on_only_past_what_was_opened(chunk):
    """A read retried from the start reports small counts again: nothing is opened twice
    or skipped, and the chunk opens whole and intact."""
    out, segs = segments(SIZE)
    trail = chunk.trail()
    trail.arrived(segs)
    runs = chunk.runs()
    for n in runs[:3]:
        trail.landed(n, len(chunk.bytes))
    for n in runs:  # the second attempt
        trail.landed(n, len(chunk.bytes))
    trail.finish(len(chunk.bytes), segs)
    assert out == chunk.plaintext


def _tampered(chunk: Sealed, how: str) -> tuple[Trail, int]:
    """A trail over a damaged copy of the chunk, and the object's size."""
    sealed = chunk.bytes
    if how == "ciphertext":  # in the third run, after two were opened
        sealed[2 * PIECE + 5] ^= 0x01
    elif how == "tag":
        sealed[-1] ^= 0x80
    elif how == "key id":
        sealed[7] ^= 0x01
    elif how == "truncated":
        sealed = sealed[:-1]
    chunk.scratch[: len(sealed)] = sealed
    if how == "relabelled":
        other = ChunkId.of(b"another chunk", key=chunk.key)
        return chunk.trail(chunk_id=other), len(sealed)
    if how == "another vault":
        return chunk.trail(keyring=Keyring.generate()), len(sealed)
    return chunk.trail(), len(sealed)


@pytest.mark.parametrize(
    "how", ["ciphertext", "tag", "key id", "truncated", "relabelled", "another vault"]
)
def test_tampering_is_refused_on_the_trail(chunk, how):
    """Every tampering class still fails the chunk when it is opened behind its read: a
    flipped byte (ciphertext, tag, key id), truncation, a chunk read under another id,
    one sealed under another vault's key."""
    _, segs = segments(SIZE)
    trail, size = _tampered(chunk, how)
    trail.arrived(segs)
    for n in runs(size):
        trail.landed(n, size)
    with pytest.raises((ChunkCorrupt, UnknownKey)):
        trail.finish(size, segs)


def test_stop_ends_the_read_and_nothing_is_written_after(chunk):
    out, segs = segments(SIZE)
    trail = chunk.trail()
    trail.arrived(segs)
    first, second, *_ = chunk.runs()
    trail.landed(first, len(chunk.bytes))
    before = bytes(out)
    trail.stop()
    with pytest.raises(Stopped):
        trail.landed(second, len(chunk.bytes))
    assert out == before


# -- through ChunkStore, on the real stores ----------------------------------------------


def test_chunk_reads_open_behind_the_direct_s3_get(object_store, keyring, aio, monkeypatch):
    """With its destinations given, a chunk read through the direct S3 GET is opened run
    by run during the read; from a local directory or through the S3 client no run is
    reported and it opens after. Either way the bytes are the chunk's."""
    store = ChunkStore(object_store, keyring, namespace=NAMESPACE)
    data = os.urandom(SIZE)
    ref = aio.run(store.put(data))
    opened_during: list[int] = []
    real = Trail.landed

    def recording(self, n, size):
        real(self, n, size)
        opened_during.append(self._opening.pos if self._opening else 0)

    ended: list[bool] = []
    real_finish = Trail.finish

    def finishing(self, n, area):
        ended.append(self.ended(n))
        real_finish(self, n, area)

    monkeypatch.setattr(Trail, "landed", recording)
    monkeypatch.setattr(Trail, "finish", finishing)
    out = bytearray(SIZE)
    aio.run(store.get_into([ref], [memoryview(out)]))
    assert out == data
    if isinstance(object_store, S3Store) and object_store.config.reads_direct():
        assert len(opened_during) == 4 and 0 < opened_during[0] < opened_during[-1]
        assert ended == [True]  # checked on the reading thread as the last bytes landed
    else:
        assert opened_during == []


class Landing:
    """The real S3 client, with each run the direct GET reports passed through
    `around(landed, out, key)` first (fault injection on the reading thread)."""

    def __init__(self, real, around) -> None:
        self.real, self.around = real, around

    def __getattr__(self, name):
        return getattr(self.real, name)

    async def get_object_into(self, **kw):
        if kw.get("Landed") is not None:
            kw["Landed"] = self.around(kw["Landed"], kw["Out"], kw["Key"])
        return await self.real.get_object_into(**kw)


def landing_store(s3_config, around) -> S3Store:
    config = dataclasses.replace(s3_config, direct_get=True)
    return S3Store(config, wrap_client=lambda real: Landing(real, around))


@pytest.mark.s3
def test_a_byte_flipped_on_the_wire_is_refused_behind_the_read(s3_config, keyring, aio):
    """A bit flipped in the third run of a chunk as it lands (after two runs were opened)
    fails that chunk (its tag); the chunk beside it, read intact, opens."""
    flipped: list[str] = []

    def around(landed, out, key):
        def flip(n, size):
            if key.endswith(bad.id.hex) and n > 2 * PIECE and not flipped:
                out[2 * PIECE] ^= 0x01
                flipped.append(key)
            landed(n, size)

        return flip

    objects = landing_store(s3_config, around)
    store = ChunkStore(objects, keyring, namespace=NAMESPACE)
    try:
        good, bad = aio.run(store.put_many([os.urandom(SIZE), os.urandom(SIZE)]))
        # One destination each: chunks open concurrently, and one sharing the other's
        # would see its plaintext overwritten before it is hashed.
        areas = [memoryview(bytearray(SIZE)) for _ in range(2)]
        with pytest.raises(ChunkCorrupt, match=f"{bad.id.short}.*tag"):
            aio.run(store.get_into([good, bad], areas))
        assert len(flipped) == 1
        out = bytearray(SIZE)
        aio.run(store.get_into([good], [memoryview(out)]))
        assert ChunkId.of(out, key=keyring.digest_key(NAMESPACE)) == good.id
    finally:
        aio.run(objects.aclose())


@pytest.mark.s3
def test_a_cancelled_read_writes_no_destination_after_it_returns(s3_config, keyring, aio):
    """A restore that gives up on a chunk mid-read (cancelled): once get_into has
    returned, the reading thread opens no further run into the destination, and its
    read ends (Stopped)."""
    first_run, stopped = threading.Event(), threading.Event()

    def around(landed, out, key):
        def slowly(n, size):
            threading.Event().wait(0.05)  # each run reported 50 ms late
            try:
                landed(n, size)
            except Stopped:
                stopped.set()
                raise
            first_run.set()

        return slowly

    objects = landing_store(s3_config, around)
    store = ChunkStore(objects, keyring, namespace=NAMESPACE)
    out = bytearray(SIZE)

    async def cancel_mid_read() -> bytes:
        ref = await store.put(os.urandom(SIZE))
        task = asyncio.ensure_future(store.get_into([ref], [memoryview(out)]))
        await asyncio.to_thread(first_run.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return bytes(out)

    try:
        after = aio.run(cancel_mid_read())
        assert after[: PIECE // 2] != bytes(PIECE // 2)  # the first run was opened
        assert stopped.wait(10)
        assert out == after
    finally:
        aio.run(objects.aclose())
