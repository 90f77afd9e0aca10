"""Trail: a chunk opened right behind its read, while its bytes are still in the cache.

A chunk read whole into its scratch buffer and opened afterwards crosses the memory bus
twice more than it must: the read pushes 11 MiB out of the cache and the open reads it
back. A trail rides on the S3 GET instead (`landed`, cas/store.py; cas/s3_get.py): on the
reading thread, as the runs of at most PIECE bytes land, it decrypts them into a run
buffer, hashes them and copies them into the chunk's destinations, or decrypts and
hashes them in place where one destination holds a run whole (cas/seal.py
Opening; a run starts at a multiple of 64 KiB in the stream, so the last part of each
read waits for the next). That needs the destinations:
a read that lands before the engine has made them (the first chunks of a restore, read
while the engine allocates) opens them from the start as soon as they exist, and one
that ends first is opened whole after the read, as without a trail. Format 1 chunks,
and a chunk whose header does not open, are opened whole after the read (which raises).

- retries: a read retried from the start only moves the opening on once it has landed
  past it again; the object is immutable, and the tag and the digest check the very
  bytes that were opened.
- stop: once the reader gives up on the chunk (cancelled), `stop` returns only when no
  run is being opened, and none will be: no thread writes into a destination after
  ChunkStore.get_into has returned. The read itself ends at its next run (Stopped).
- ended: when the last bytes land and the open has kept up, the reading thread opens
  the last runs and checks the tag and the digest itself, before the read returns; what
  the check found is kept for `finish` to raise. The chunk is then done without a second
  trip through the event loop to a worker thread, at the end of the restore, when the
  cores are otherwise idle. Measured on SeaweedFS on loopback (a 256-token cut of the
  demo model restored in one process, this step on and off in turns, 200 restores each
  way, two runs): 17.33 and 17.86 ms against 17.66 and 18.08 ms at the median.
- finish: after the read, what `ended` left: the rest opened (hashed on a lane, if the
  store lends one: the scratch buffer no longer changes) and the tag and the digest
  checked, or what the reading thread's check found raised.

Measured (`benchmarks/restore_phases.py [--s3] --depth 2048 --rounds 11`, one 2,048-token cut of
the demo model, 2 cores; three runs each, alternating with the trail turned off): from
SeaweedFS on loopback the fill took 106.9-126.3 ms against 126.3-148.2 ms. From a local
directory it did not pay (five runs each: 50.0-70.4 ms against 49.8-69.4 ms, slower in
four pairs of five): a file read is one fast copy out of the page cache, and runs only
add system calls and thread hand-offs, so local chunks are read whole.
"""

from __future__ import annotations

import threading

from cas.errors import ChunkCorrupt, UnknownKey
from cas.ids import ChunkId
from cas.lanes import Lanes
from cas.seal import HEADER_MAX, ChunkSeal, Opening

Area = memoryview | list[memoryview]  # one destination, or its segments in order


class Stopped(Exception):
    """The reader gave up on the chunk; raised into its read to end it."""


class Trail:
    def __init__(
        self,
        seal: ChunkSeal,
        chunk_id: ChunkId,
        scratch: memoryview,
        digest_key: bytes,
        lanes: Lanes | None = None,
    ) -> None:
        self._seal, self._id, self._scratch, self._key = seal, chunk_id, scratch, digest_key
        self._lanes = lanes
        self._lock = threading.Lock()
        self._area: Area | None = None
        self._opening: Opening | None = None
        self._size = 0  # the object's size the opening was made for
        self._whole = False  # opened only after the read
        self._stopped = False
        self._ended = False  # opened and checked on the reading thread, for _size bytes
        self._failure: BaseException | None = None  # what that check raised

    def arrived(self, area: Area) -> None:
        """The chunk's destinations exist (on the loop's thread)."""
        self._area = area

    def landed(self, n: int, size: int) -> None:
        """The first `n` of the object's `size` bytes are in the scratch buffer (on the
        reading thread)."""
        with self._lock:
            if self._stopped:
                raise Stopped(f"chunk {self._id.short}: the reader stopped waiting")
            if self._opening is None or self._size != size:
                self._opening = self._open(n, size)
            if self._opening is not None:
                self._opening.advance(n)
                if n == size:
                    self._end_here()

    def _end_here(self) -> None:
        """Open the rest and check the chunk on the reading thread (under the lock), keeping
        what the check raised for `finish`: the read itself succeeded."""
        assert self._opening is not None
        try:
            self._opening.finish()
        except (ChunkCorrupt, UnknownKey) as e:
            self._failure = e
        self._ended = True

    def ended(self, n: int) -> bool:
        """Whether the chunk's `n` sealed bytes were opened and checked as they landed, so
        that `finish` only reports the outcome (no work left for a worker thread)."""
        return self._ended and self._size == n

    def _open(self, n: int, size: int) -> Opening | None:
        if self._whole or self._area is None or n < min(size, HEADER_MAX):
            return None
        try:
            opening = self._seal.opening(
                self._id,
                self._scratch[:size],
                _segments(self._area),
                digest_key=self._key,
                lanes=self._lanes,
            )
        except (ChunkCorrupt, UnknownKey):
            opening = None  # the open after the read raises it, as for any chunk
        self._whole, self._size = opening is None, size
        return opening

    def stop(self) -> None:
        """No run is opened after this returns (on the loop's thread)."""
        with self._lock:
            self._stopped = True

    def finish(self, n: int, area: Area) -> None:
        """The chunk's `n` sealed bytes have all landed: open what is left and check it
        (on a worker thread, the read over; or anywhere once `ended(n)`); ChunkCorrupt,
        UnknownKey."""
        if self.ended(n):
            if self._failure is not None:
                raise self._failure
            return
        opening = self._opening if self._size == n else None
        if opening is None:
            self._seal.open_into(
                self._id, self._scratch[:n], area, digest_key=self._key, lanes=self._lanes
            )
            return
        opening.finish()


def _segments(area: Area) -> list[memoryview]:
    return [area] if isinstance(area, memoryview) else area
