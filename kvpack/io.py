"""IoLoop: one asyncio loop on a background thread, for everything that talks to storage.

aiobotocore clients are bound to the loop that made them, and cas/ and catalog/ publish
and load are coroutines, while the engine and its callers are synchronous threads. Every
storage coroutine of one vault runs on its IoLoop; a caller blocks on
`IoLoop.run(coro, timeout)`, which cancels the coroutine when the timeout passes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class IoLoop:
    """An asyncio loop running on its own daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvpack-io", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run `coro` on the loop; TimeoutError (and cancellation) past `timeout` seconds."""
        return self.wait(self.start(coro), timeout)

    def start(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Start `coro` on the loop; the caller goes on and `wait`s for it later."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def wait(self, future: Future[T], timeout: float | None) -> T:
        """What a started coroutine returns; TimeoutError (and cancellation) past
        `timeout` seconds."""
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
