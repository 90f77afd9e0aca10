"""Buffers on the read path: reused scratch buffers, and fresh buffers without a fill pass.

- scratch buffer: one sealed chunk's landing place between the object store and the
  seal. Reusing it spares a fresh zero-filled allocation, and its page faults, per chunk.
- ScratchPool: lends buffers of at least a size and keeps at most `keep` of them between
  loans (the largest); its memory cost is about keep × the largest sealed chunk read
  through it. Thread-safe, so ChunkStores of several namespaces may share one.
- scatter: bytes copied across segments in order (a destination in pieces, cas/chunks.py).
- read_into: a stream's next `size` bytes read into the front of a buffer, until they
  are in or the stream ends (a file, cas/local.py; an HTTP body, cas/s3_get.py); with
  `landed`, in runs of at most PIECE, each reported as it lands (the reader opens a
  chunk behind its S3 read while the bytes are still in the cache: cas/trail.py).
- fresh buffer (`fresh_buffer`): writable memory for bytes about to be written in full.
  bytearray(n) fills n zeros first, a pass over memory that is then overwritten (and a
  page fault per 4 KiB); a large fresh buffer is a private anonymous mapping the kernel
  zeroes as it is first touched, in huge pages where it offers them (Linux THP).

A buffer whose loan ends by cancellation is not taken back: a worker thread of the
object store may still be writing into it, and the next chunk read into it would then
fail its tag for no fault of its own.
"""

from __future__ import annotations

import asyncio
import mmap
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager


class ScratchPool:
    def __init__(self, *, keep: int) -> None:
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.keep = keep
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ScratchPool(keep={self.keep}, held={self.held_bytes})"

    @property
    def held_bytes(self) -> int:
        """Bytes kept between loans."""
        with self._lock:
            return sum(len(b) for b in self._free)

    @contextmanager
    def lend(self, size: int) -> Iterator[memoryview]:
        """A writable view of exactly `size` bytes, contents undefined."""
        with self._lock:
            buf = self._free.pop() if self._free else bytearray()
        if len(buf) < size:
            buf = bytearray(size)  # the smaller one is dropped: sizes only grow
        try:
            yield memoryview(buf)[:size]
        except asyncio.CancelledError:
            raise  # not taken back (see the module docstring)
        except BaseException:
            self._give_back(buf)
            raise
        else:
            self._give_back(buf)

    def _give_back(self, buf: bytearray) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=len)  # pop() lends the largest
            del self._free[: max(0, len(self._free) - self.keep)]  # keep the largest


HUGE_PAGE = 2 << 20  # below this, a bytearray's fill costs less than a mapping


def fresh_buffer(size: int) -> memoryview:
    """`size` writable bytes (zeros); see the module docstring."""
    if size < HUGE_PAGE:
        return memoryview(bytearray(size))
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        area.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(area)


def scatter(source: bytes | bytearray | memoryview, segments: Sequence[memoryview]) -> None:
    """Copy `source` across `segments` in order; ValueError unless their sizes add up to it."""
    view = memoryview(source).cast("B")
    if sum(s.nbytes for s in segments) != view.nbytes:
        raise ValueError(f"segments of {[s.nbytes for s in segments]} bytes for {view.nbytes}")
    pos = 0
    for seg in segments:
        seg[:] = view[pos : pos + seg.nbytes]
        pos += seg.nbytes


# The most a read hands over at once when someone opens the bytes behind it. Measured on
# 8 chunks of 11.25 MiB from files (read, opened and hashed, 2 or 4 threads on 2 cores,
# alone): 1 MiB runs took 29-32 ms against 37-39 ms for whole chunks; 256 KiB runs
# gained 1 ms or less, 2 MiB runs a little less than 1 MiB ones.
PIECE = 1 << 20
Landed = Callable[[int, int], None]  # (bytes in the buffer so far, the object's size)


def read_into(
    readinto: Callable[[memoryview], int | None],
    out: memoryview,
    size: int,
    landed: Landed | None = None,
) -> int:
    """Call `readinto` until `size` bytes are in out[:size] or it returns nothing (the end
    of the stream); the bytes read, which the caller checks against `size`. With
    `landed`, reads are at most PIECE bytes and each is reported as it lands."""
    n, most = 0, size if landed is None else PIECE
    while n < size:
        got = readinto(out[n : min(size, n + most)])
        if not got:
            break
        n += got
        if landed is not None:
            landed(n, size)
    return n
