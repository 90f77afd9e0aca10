"""Background: work that must never sit on a response's path, on one worker thread.

- job: a named callable: publish a cut, promote a hit into the resident tier, stamp a
  catalog hit, persist a paired timing. Jobs run one at a time, in submission order.
- submit never blocks: when the bounded queue is full the job is dropped and counted
  (a lost publication costs a future hit, never a response). A failing job is logged
  and counted, never raised. close() stops taking jobs and drains the queue (bounded).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from engine import streams

log = logging.getLogger(__name__)
DEFAULT_CAPACITY = 64


class Background:
    def __init__(self, *, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"background queue capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.done = self.failed = self.dropped = 0
        self._jobs: deque[tuple[str, Callable[[], object]]] = deque()
        self._pending = 0  # queued + running
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvpack-background", daemon=True)
        self._thread.start()

    def submit(self, name: str, job: Callable[[], object]) -> bool:
        """Queue `job`; False (and counted as dropped) when the queue is full or closing."""
        with self._cond:
            if self._closing or len(self._jobs) >= self.capacity:
                self.dropped += 1
                return False
            self._jobs.append((name, job))
            self._pending += 1
            self._cond.notify_all()
            return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job has run; False if `timeout` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Stop taking jobs, run the queued ones (bounded wait); True if all ran."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "queued": self._pending,
                "done": self.done,
                "failed": self.failed,
                "dropped": self.dropped,
            }

    def _run(self) -> None:
        try:
            self._work()
        finally:
            streams.release()  # its jobs copy MLX arrays (the resident tier's form)

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closing)
                if not self._jobs:
                    return
                name, job = self._jobs.popleft()
            failed = False
            try:
                job()
            except Exception:  # noqa: BLE001 - background work never reaches a response
                log.exception("background job %s failed", name)
                failed = True
            with self._cond:
                self._pending -= 1
                if failed:
                    self.failed += 1
                else:
                    self.done += 1
                self._cond.notify_all()
