"""A real kvpack server in the test process: the real Service on the tiny model, the
aiohttp app on a loopback port, its event loop on a background thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvpack.config import Settings
from kvpack.server import make_app, start
from kvpack.service import CompletionRequest, CompletionResult, Service

TINY_A = 64


def open_tiny_service(data_dir: Path) -> Service:
    settings = Settings.load(data_dir=data_dir, alignment=TINY_A, env={})
    return Service.open(settings, model="tiny")


@contextmanager
def running(service: Any, **front_options: Any) -> Iterator[str]:
    """Serve `service` on 127.0.0.1:<free port>; yields the base URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    app = make_app(service, **front_options)
    runner, url = asyncio.run_coroutine_threadsafe(
        start(app, host="127.0.0.1", port=0), loop
    ).result(30)
    try:
        yield url
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


class SlowService:
    """Fault injection around the real Service: each generated token arrives `delay_s`
    late (the engine keeps computing the real thing)."""

    def __init__(self, inner: Service, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.loaded, self.accounting = inner.loaded, inner.accounting

    def complete(
        self,
        req: CompletionRequest,
        *,
        on_token: Callable[[int], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> CompletionResult:
        def slow(token: int) -> None:
            time.sleep(self.delay_s)
            if on_token is not None:
                on_token(token)

        return self.inner.complete(req, on_token=slow, cancel=cancel)

    def economics(self) -> dict[str, Any]:
        return self.inner.economics()
