"""Hash lanes: a chunk's re-hash run on a thread of its own, behind its decryption.

Opening a chunk is a decryption (AES-256-GCM, ~10 GB/s a core here), a keyed BLAKE3 of
the plaintext (~4.6 GB/s) and a copy of it into the segments it belongs in, run after
run on the thread that opens it (cas/seal.py Opening). The decryption and the hash
release the GIL, and BLAKE3 is sequential within a chunk, so a chunk opened alone — a
short cut's one block, the last chunk of a long one — leaves the other core idle while
its hash holds the critical path.

- lane: a thread that hashes runs in the order they are handed to it, while the opening
  thread copies each run out and decrypts the next. A lane only reads the runs (in the
  opening thread's run buffers) and releases each once done with it; `drained()` waits
  until every run handed over is hashed and raises what hashing raised.
- Lanes: lends lanes, at most `size` at once (none free: the opener hashes inline, as
  without lanes), and keeps them between loans. A lane given back undrained (its chunk
  failed with runs still queued) is retired, not kept: its thread ends once it has
  hashed what it holds, and no later chunk waits behind it. What it still reads is
  garbage to everyone by then.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Protocol


class Hasher(Protocol):
    def update(self, data: memoryview, /) -> object: ...


class _Drained:
    """A marker in a lane's queue: set once every run before it is hashed."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None


_Run = tuple[Hasher, memoryview, Callable[[], object] | None]
_STOP = None


class Lane:
    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[_Run | _Drained | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def hash(
        self, hasher: Hasher, run: memoryview, *, release: Callable[[], object] | None = None
    ) -> None:
        """`hasher.update(run)` on the lane, after every run handed over before; then
        `release()`, also where an earlier error skips the hash: the lane is done with
        `run`'s buffer."""
        self._queue.put((hasher, run, release))

    def drained(self) -> None:
        """Wait until every run handed over so far is hashed; raise what hashing raised."""
        marker = _Drained()
        self._queue.put(marker)
        marker.done.wait()
        if marker.error is not None:
            raise marker.error

    def retire(self) -> None:
        """End the thread once it has hashed what it holds (never blocks)."""
        self._queue.put(_STOP)

    def _run(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            if isinstance(item, _Drained):
                item.error, self._error = self._error, None
                item.done.set()
            else:
                hasher, run, release = item
                if self._error is None:
                    try:
                        hasher.update(run)
                    except Exception as e:  # noqa: BLE001 - drained() raises it on the opener's thread
                        self._error = e
                if release is not None:
                    release()


class Lanes:
    def __init__(self, *, size: int, name: str = "kvpack-hash") -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self.size, self._name = size, name
        self._free: list[Lane] = []
        self._lent = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Lanes(size={self.size})"

    def warm(self) -> None:
        """Start every lane not started yet, so the first chunks do not wait for it."""
        with self._lock:
            while len(self._free) + self._lent < self.size:
                self._free.append(Lane(self._name))

    def take(self) -> Lane | None:
        """A lane, or None when `size` are lent already."""
        with self._lock:
            if self._lent >= self.size:
                return None
            self._lent += 1
            if self._free:
                return self._free.pop()
        try:
            return Lane(self._name)
        except BaseException:
            with self._lock:
                self._lent -= 1
            raise

    def give(self, lane: Lane, *, drained: bool) -> None:
        """Take a lane back: kept if drained, else retired."""
        with self._lock:
            self._lent -= 1
            if drained:
                self._free.append(lane)
                return
        lane.retire()
