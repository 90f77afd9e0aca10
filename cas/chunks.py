"""ChunkStore: sealed, content-addressed chunks on an ObjectStore.

- chunk ref: (chunk id, plaintext size): what a manifest lists and a reader asks for.
- put: digest (or take the id the caller already computed with `chunk_id`, so a
  publish digests each chunk once), seal, open the sealed bytes again and compare
  them with the plaintext (verify before trusting our own output), then put-if-absent
  under object_key("chunk", id). "Existed" is success once the stored object has a
  plausible sealed size (any key id, any format that still opens); one that does not (a
  truncated leftover) is replaced.
- get_into: every chunk fetched into a scratch buffer (cas/buffers.py) — or, from a
  store that maps its objects (a local directory, cas/local.py), mapped where its file
  lies — and opened: tag-verified, decrypted into the caller's destination (into a run
  buffer in the cache and copied out, for a destination in segments: cas/seal.py
  Opening) and hashed once against its id. Where the store reports its bytes as they
  land (the direct S3 GET) and the destination exists, the open follows the read run by
  run on the reading thread (cas/trail.py), else it opens the chunk after its read. Up
  to max_concurrency chunks are in flight, each read and opened in worker threads. A
  chunk that fails raises ChunkCorrupt / ChunkMissing and the whole call fails; no
  worker writes into a destination after the call has returned or raised. get /
  get_many are get_into over buffers they allocate. open_mapped is get_into for a
  store that maps, from the caller's thread.
- warm: a first read's setup paid ahead (a server's warm start): max_concurrency scratch
  buffers of a given size (none for a store that maps), the worker threads that open
  chunks, a store connection per chunk in flight, the seal's open path once on each
  worker, and the hash lanes' threads. Measured (`kvpack bench --depths 256`, demo
  model, local directory): without it the first restore after a restart took 21 and 17
  ms against 11 ms for the next; with it 14 ms and 13 ms.

Copies per byte on the read path (store to destination): from a local directory 1 —
the decryption reads the file's pages in the page cache, mapped, and into a destination
in segments each run is copied out after it is decrypted into a run buffer and hashed
there (cas/seal.py Opening; a run that one segment holds whole, and a destination of
one buffer, the decryption writes in place: 0). From S3 2 (1 for such runs): the
kernel's read of the socket (cas/s3_get.py) into the scratch buffer, then the copy out;
the runs are opened while still in the cache: the open trails the read. On S3 through
aiobotocore (where a proxy is set for the endpoint), 4: the kernel's socket read into a
bytes object, aiohttp's HTTP parser copying the body out of it, aiobotocore's `readinto`
copying that into the scratch buffer (5 where aiohttp first joins several buffered
pieces), the copy out. The re-hash reads each byte once, in the run buffer or where it
was decrypted in place; a chunk opened after its read hashes on a lane (cas/lanes.py)
while its next runs are decrypted.
The engine's own count continues in engine/state.py.

Memory: get_into holds up to max_concurrency scratch buffers of the largest sealed chunk
in flight, and the pool keeps that many between calls: 4 × 11.25 MiB ≈ 45 MiB for the
demo model's blocks at the default (pass one ScratchPool to share it between stores).
From a store that maps, none: up to max_concurrency chunks' files are mapped instead,
pages the page cache holds anyway.
get_many adds one output buffer, the sum of the ref sizes (a fresh buffer,
cas/buffers.py). put_many holds max_concurrency sealed copies of its inputs the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from cas.buffers import ScratchPool, fresh_buffer
from cas.errors import ChunkCorrupt, ChunkMissing, ObjectMissing, ObjectTooLarge
from cas.ids import ChunkId
from cas.keys import Keyring
from cas.lanes import Lanes
from cas.layout import object_key
from cas.seal import ChunkSeal, max_sealed_size, plausible_sizes
from cas.store import ObjectInfo, ObjectStore
from cas.trail import Area, Trail

T = TypeVar("T")
# Chunks in flight. Measured on the demo model's blocks (2 cores, local directory and
# SeaweedFS on loopback): 4 reads as fast as 8 or faster and holds half the scratch; 2 and
# 1 leave S3 latency unhidden.
DEFAULT_CONCURRENCY = 4
# Hash lanes (cas/lanes.py) lent to chunks opened after their read. Measured on the demo
# model (2 cores, local directory, benchmarks/restore_phases.py --rounds 15): a 256-token
# cut's fill 8.0 -> 6.9 ms at the median, its one block opened in 2.7-3.4 ms in 11 of 16
# restores against 4.2-5.8 ms; at 2,048 tokens, where chunks in flight keep both cores
# busy, in the noise.
DEFAULT_LANES = 2
Blob = bytes | bytearray | memoryview
Destination = Blob | Sequence[Blob]  # one writable buffer, or segments filled in order
WARM_SAMPLE = 4096  # bytes of the chunk warm() seals and opens in memory, in two segments
WARM_TIMEOUT_S = 10.0  # for warm()'s opener threads to all start


@dataclass(frozen=True, slots=True)
class ChunkRef:
    id: ChunkId
    size: int  # plaintext bytes


class ChunkStore:
    def __init__(
        self,
        objects: ObjectStore,
        keyring: Keyring,
        *,
        namespace: str = "default",
        max_concurrency: int = DEFAULT_CONCURRENCY,
        scratch: ScratchPool | None = None,
        lanes: Lanes | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if not namespace:
            raise ValueError("namespace must not be empty")
        self.objects = objects
        self.keyring = keyring
        self.namespace = namespace
        self.max_concurrency = max_concurrency
        self.scratch = scratch if scratch is not None else ScratchPool(keep=max_concurrency)
        self.lanes = lanes if lanes is not None else Lanes(size=DEFAULT_LANES)
        # Where a store that maps has its chunks opened (open_mapped); threads start on use.
        self.openers = ThreadPoolExecutor(max_concurrency, thread_name_prefix="kvpack-open")
        self._seal = ChunkSeal(keyring)
        self._digest_key = keyring.digest_key(namespace)

    def __repr__(self) -> str:
        return f"ChunkStore({self.objects!r}, namespace={self.namespace!r})"

    def chunk_id(self, data: Blob) -> ChunkId:
        return ChunkId.of(data, key=self._digest_key)

    @staticmethod
    def key(chunk_id: ChunkId) -> str:
        """The object key of a chunk (the same in every namespace)."""
        return object_key("chunk", chunk_id.hex)

    # -- writing ----------------------------------------------------------------------

    async def put(self, data: Blob, *, chunk_id: ChunkId | None = None) -> ChunkRef:
        """Store `data`; `chunk_id`, when given, must be what chunk_id(data) returns."""
        sealed_id, sealed = await asyncio.to_thread(self._seal_verified, data, chunk_id)
        ref = ChunkRef(sealed_id, len(data))
        key = self.key(sealed_id)
        if await self.objects.put_if_absent(key, sealed):
            return ref
        # Existed: equal ids carry equal plaintext, so the object is ours unless damaged.
        info = await self._stat_or_none(key)
        if info is not None and info.size in plausible_sizes(ref.size, tuple(self.keyring.keys)):
            return ref
        if info is not None:  # a damaged object would poison every later dedup: replace it
            await self.objects.delete(key)
        await self.objects.put_if_absent(key, sealed)
        return ref

    def _seal_verified(self, data: Blob, chunk_id: ChunkId | None) -> tuple[ChunkId, bytearray]:
        chunk_id = chunk_id or self.chunk_id(data)
        sealed = self._seal.seal(chunk_id, data)
        self._seal.verify(chunk_id, sealed, data)
        return chunk_id, sealed

    async def put_many(
        self, blobs: Sequence[Blob], *, ids: Sequence[ChunkId] | None = None
    ) -> list[ChunkRef]:
        """Store every blob (bounded concurrency); refs in input order. `ids`, when given,
        are the blobs' chunk ids, already computed."""
        named = ids if ids is not None else [None] * len(blobs)
        jobs = [lambda b=b, i=i: self.put(b, chunk_id=i) for b, i in zip(blobs, named, strict=True)]
        return await self._bounded(jobs)

    # -- reading ----------------------------------------------------------------------

    async def get(self, ref: ChunkRef) -> bytes:
        out = bytearray(ref.size)
        await self.get_into([ref], [memoryview(out)])
        return bytes(out)

    async def get_many(self, refs: Sequence[ChunkRef]) -> memoryview:
        """Every chunk, verified, laid end to end in one preallocated buffer in ref order."""
        out = fresh_buffer(sum(r.size for r in refs))
        areas, offset = [], 0
        for ref in refs:
            areas.append(out[offset : offset + ref.size])
            offset += ref.size
        await self.get_into(refs, areas)
        return out

    async def get_into(
        self,
        refs: Sequence[ChunkRef],
        outs: Sequence[Destination] | Awaitable[Sequence[Destination]],
    ) -> None:
        """Every chunk verified and decrypted into its destination `outs[i]`: a
        writable buffer of exactly refs[i].size bytes, or segments — writable buffers whose
        sizes add up to it, filled in order (the chunk's pieces land where each belongs).
        `outs` may also be an awaitable of them, for destinations still being made: the
        chunks are fetched meanwhile and opened once it has them (the fetch overlaps the
        making). On an error the destinations hold garbage and must not be used."""
        if isinstance(outs, Sequence):
            areas: asyncio.Future[list[Area]] = _done(_areas(refs, outs))
        else:
            areas = asyncio.ensure_future(_arrived(refs, outs))
        jobs = [lambda ref=ref, i=i: self._fetch_into(ref, areas, i) for i, ref in enumerate(refs)]
        try:
            await self._bounded(jobs)
        finally:
            areas.cancel()  # the caller's destinations, if still being made, are not used

    async def _fetch_into(self, ref: ChunkRef, areas: asyncio.Future[list[Area]], i: int) -> None:
        if self.maps:  # mapped and opened in one worker job, once the destination exists
            area = (await asyncio.shield(areas))[i]
            return await _finished(self._open_mapped, ref, area)
        with self.scratch.lend(max_sealed_size(ref.size)) as scratch:
            trail = Trail(self._seal, ref.id, scratch, self._digest_key, self.lanes)
            if areas.done():  # a callback would wait a loop turn, maybe past the first runs
                _arrived_at(areas, i, trail)
            else:
                areas.add_done_callback(lambda made: _arrived_at(made, i, trail))
            with _as_chunk_errors(ref):
                n = await self._read(self.key(ref.id), scratch, trail)
            area = (await asyncio.shield(areas))[i]
            if trail.ended(n):  # opened and checked on the reading thread already
                trail.finish(n, area)
            else:
                await _finished(trail.finish, n, area)

    @property
    def maps(self) -> bool:
        """Whether the store maps its objects (cas/local.py): its chunks are opened where
        they lie, and `open_mapped` opens them from the caller's thread."""
        return bool(getattr(self.objects, "maps", False))

    def open_mapped(
        self,
        refs: Sequence[ChunkRef],
        outs: Sequence[Destination],
        meanwhile: Callable[[], object] | None = None,
    ) -> None:
        """get_into from a store that maps, called from the caller's thread (not the event
        loop's): each chunk mapped and opened into its destination on this store's opener
        threads, at most max_concurrency at once, handed to them straight from here — no
        trip through the loop between the caller's allocation and the opens. `meanwhile()`
        runs on the calling thread as they go. Returns once every open has ended; raises
        the first failure (get_into's errors), the opens not started by then dropped."""
        areas = _areas(refs, outs)
        jobs = [self.openers.submit(self._open_mapped, ref, area)
                for ref, area in zip(refs, areas, strict=True)]  # fmt: skip
        try:
            if meanwhile is not None:
                meanwhile()
        finally:
            _, pending = futures.wait(jobs, return_when=futures.FIRST_EXCEPTION)
            for job in pending:
                job.cancel()
            futures.wait(jobs)  # no opener writes into a destination after this
        for job in jobs:
            error = None if job.cancelled() else job.exception()
            if error is not None:
                raise error

    def _open_mapped(self, ref: ChunkRef, area: Area) -> None:
        with _as_chunk_errors(ref):
            mapped = self.objects.map(self.key(ref.id), max_sealed_size(ref.size))  # type: ignore[attr-defined]
        with mapped:  # a view a failed open's traceback holds keeps it mapped until it goes
            self._seal.open_into(
                ref.id, mapped.view, area, digest_key=self._digest_key, lanes=self.lanes
            )

    async def _read(self, key: str, scratch: memoryview, trail: Trail) -> int:
        """The object read into `scratch`, opened behind the read where the store lets it
        (cas/trail.py); its size."""
        if not getattr(self.objects, "lands", False):
            return await self.objects.get_into(key, scratch)
        try:
            return await self.objects.get_into(key, scratch, trail.landed)  # type: ignore[call-arg]
        except asyncio.CancelledError:
            trail.stop()  # the reading thread writes into no destination after this
            raise

    async def warm(self, size: int, *, probe_key: str) -> None:
        """Make the next reads of chunks of up to `size` plaintext bytes find their setup
        done (see the module words). `probe_key` names an object that is never written:
        each chunk in flight fetches it once and is answered "missing". Writes nothing."""
        sample = os.urandom(WARM_SAMPLE)
        ref = ChunkRef(self.chunk_id(sample), len(sample))
        sealed = bytes(self._seal.seal(ref.id, sample))  # read-only: each open copies it
        open_sample = partial(self._seal.open_into, ref.id, sealed, digest_key=self._digest_key)
        if self.maps:
            await self._warm_openers(probe_key, size, open_sample)
        else:

            async def one() -> None:
                with self.scratch.lend(max_sealed_size(size)) as scratch:
                    with contextlib.suppress(ObjectMissing):
                        await self.objects.get_into(probe_key, scratch)
                    await _finished(open_sample, halves(scratch[:WARM_SAMPLE]))

            await self._bounded([one] * self.max_concurrency)
        self.lanes.warm()

    async def _warm_openers(
        self, probe_key: str, size: int, open_sample: Callable[[list[memoryview]], None]
    ) -> None:
        """Start every opener thread (each job waits for the others, so that each runs on
        a thread of its own) and run a map and an open on each."""
        n = self.max_concurrency
        gathered = threading.Barrier(n)

        def one() -> None:
            gathered.wait(WARM_TIMEOUT_S)
            with contextlib.suppress(ObjectMissing):
                self.objects.map(probe_key, max_sealed_size(size)).close()  # type: ignore[attr-defined]
            open_sample(halves(memoryview(bytearray(WARM_SAMPLE))))

        await asyncio.gather(*(asyncio.wrap_future(self.openers.submit(one)) for _ in range(n)))

    async def contains(self, chunk_id: ChunkId) -> bool:
        return await self._stat_or_none(self.key(chunk_id)) is not None

    async def delete(self, chunk_id: ChunkId) -> None:
        await self.objects.delete(self.key(chunk_id))

    # -- helpers ----------------------------------------------------------------------

    async def _stat_or_none(self, key: str) -> ObjectInfo | None:
        try:
            return await self.objects.stat(key)
        except ObjectMissing:
            return None

    async def _bounded(self, jobs: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
        return await bounded(jobs, self.max_concurrency)


@contextlib.contextmanager
def _as_chunk_errors(ref: ChunkRef) -> Iterator[None]:
    """A read's store errors as the chunk's: ChunkMissing, ChunkCorrupt (too large)."""
    try:
        yield
    except ObjectMissing as e:
        raise ChunkMissing(ref.id) from e
    except ObjectTooLarge as e:
        raise ChunkCorrupt(ref.id, f"object has {e.size} bytes, too many for its size") from e


def halves(area: memoryview) -> list[memoryview]:
    """`area` as two segments: a destination that exercises the segmented open path."""
    half = area.nbytes // 2
    return [area[:half], area[half:]]


def _arrived_at(made: asyncio.Future[list[Area]], i: int, trail: Trail) -> None:
    if not made.cancelled() and made.exception() is None:
        trail.arrived(made.result()[i])


def _areas(refs: Sequence[ChunkRef], outs: Sequence[Destination]) -> list[Area]:
    if len(refs) != len(outs):
        raise ValueError(f"{len(refs)} refs for {len(outs)} destinations")
    return [_destination(ref, out) for ref, out in zip(refs, outs, strict=True)]


async def _arrived(refs: Sequence[ChunkRef], outs: Awaitable[Sequence[Destination]]) -> list[Area]:
    return _areas(refs, await outs)


def _done(value: T) -> asyncio.Future[T]:
    future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


def _destination(ref: ChunkRef, out: Destination) -> Area:
    """`out` as byte views; ValueError unless writable and exactly the chunk's size."""
    one = isinstance(out, bytes | bytearray | memoryview)
    if isinstance(out, bytes | bytearray | memoryview):
        views = [memoryview(out).cast("B")]
    else:
        views = [memoryview(b).cast("B") for b in out]
    size = sum(v.nbytes for v in views)
    if size != ref.size or any(v.readonly for v in views):
        ro = " (read-only)" if any(v.readonly for v in views) else ""
        raise ValueError(
            f"destination of chunk {ref.id.short} must be {ref.size} writable bytes, got {size}{ro}"
        )
    return views[0] if one else views


async def _finished(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) in a worker thread. A cancelled caller still waits for it to end, so no
    thread writes into a buffer after the call that lent it has returned."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        raise


async def bounded(jobs: Sequence[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    """Run jobs at most `limit` at a time; results in order. The first failure cancels
    the rest and is raised as itself (not an ExceptionGroup)."""
    slots = asyncio.Semaphore(limit)

    async def one(job: Callable[[], Awaitable[T]]) -> T:
        async with slots:
            return await job()

    tasks = [asyncio.ensure_future(one(job)) for job in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
