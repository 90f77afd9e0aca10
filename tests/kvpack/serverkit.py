"""A real kvpack server in the test process: the real Service on the tiny model, the
aiohttp app on a loopback port, its event loop on a background thread."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from kvpack.config import Settings
from kvpack.server.app import make_app, start
from kvpack.server.auth import Authenticator
from kvpack.service.service import Completion, CompletionRequest, Service

TINY_A = 64


def open_tiny_service(data_dir: Path) -> Service:
    settings = Settings.load(data_dir=data_dir, alignment=TINY_A, env={})
    return Service.open(settings, model="tiny")


@contextmanager
def serving(app: web.Application) -> Iterator[str]:
    """Serve an aiohttp app on 127.0.0.1:<free port> from a loop on its own thread;
    yields the base URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
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


@contextmanager
def running(
    service: Any, *, authenticate: Authenticator | None = None, **front_options: Any
) -> Iterator[str]:
    """Serve `service` (anonymous unless `authenticate` is given); yields the base URL."""
    with serving(make_app(service, authenticate=authenticate, **front_options)) as url:
        yield url


def call(
    url: str, method: str, path: str, *, token=None, body=None, authorization=None, timeout=60
):
    """(status, headers, parsed JSON body or raw bytes)."""
    parts = urlsplit(url)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if authorization is not None:
        headers["Authorization"] = authorization
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    is_json = resp.getheader("Content-Type", "").startswith("application/json")
    return resp.status, resp.headers, json.loads(raw) if is_json else raw


class SlowService:
    """Fault injection around the real Service: each piece of generated text arrives
    `delay_s` late (the engine keeps computing the real thing). `generating` is set once
    the first text is out; `completions` holds what each request returned."""

    def __init__(self, inner: Service, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.generating = threading.Event()
        self.completions: list[Completion] = []

    def __getattr__(self, name: str) -> Any:  # the rest of the Service, unchanged
        return getattr(self.inner, name)

    def steps(
        self,
        req: CompletionRequest,
        *,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
        **kw: Any,
    ) -> Generator[Any, None, Completion]:
        def slow(text: str) -> None:
            self.generating.set()
            time.sleep(self.delay_s)
            if on_text is not None:
                on_text(text)

        inner = self.inner.steps(req, on_text=slow, cancel=cancel, **kw)

        def recorded() -> Generator[Any, None, Completion]:
            completion = yield from inner
            self.completions.append(completion)
            return completion

        return recorded()
