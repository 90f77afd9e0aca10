"""Two vaults on loopback: a producer A serving its packs to peers, an importer B, and a
tampering proxy between them for fault injection (the real A stays behind it).

- vault(): a real Service on the tiny model, its own data dir and catalog.
- serve(): a real server over a service, with the catalog authenticator (API keys).
- Proxy: forwards /v1/peer/... to A. Hooks rewrite the find request, the answer or
  the planes, replay a recorded answer, or stall; everything else passes unchanged.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from catalog import access, trust
from catalog.signing import Bundle
from kvpack.config import Settings
from kvpack.server.auth import catalog_authenticator
from kvpack.service.service import Completion, CompletionRequest, Service
from tests.engine.slotkit import TINY_A
from tests.kvpack.serverkit import running


def vault(path: Path, **settings: Any) -> Service:
    """A vault of its own: embedded by default, or the catalog and store `settings` name."""
    config = Settings.load(data_dir=path, alignment=TINY_A, env={}, **settings)
    return Service.open(config, model="tiny")


def api_key(service: Service, *, role: str, namespace: str) -> str:
    with service.vault.transaction() as s:
        return access.create_key(session=s, role=role, namespace=namespace)


def trust_producer(importer: Service, bundle: Bundle) -> None:
    with importer.vault.transaction() as s:
        trust.trust_bundle(session=s, bundle=bundle, now=datetime.now(UTC))


def complete(service: Service, tokens: list[int], namespace: str = "default") -> Completion:
    return service.complete(CompletionRequest(tokens=tokens, max_tokens=8, namespace=namespace))


@contextmanager
def serve(service: Service, **options: Any) -> Iterator[str]:
    """A real server over `service` that asks for API keys (the catalog authenticator)."""
    with running(service, authenticate=catalog_authenticator(service.vault.db), **options) as url:
        yield url


class Proxy:
    """A man in the middle on the peer routes; hooks are set by the test."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.on_find: Callable[[dict], dict] | None = None
        self.on_answer: Callable[[bytes], bytes] | None = None
        self.on_planes: Callable[[bytes], bytes] | None = None
        self.stall_planes_s = 0.0
        self.recorded: bytes | None = None  # the last genuine answer
        self.replay = False
        self.paths: list[str] = []  # every request that reached the proxy

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        self.paths.append(request.path)
        body = await request.read()
        if request.path == "/v1/peer/find" and self.on_find is not None:
            body = json.dumps(self.on_find(json.loads(body))).encode()
        if request.path == "/v1/peer/find" and self.replay and self.recorded is not None:
            return web.Response(body=self.recorded, content_type="application/json")
        headers = {"Authorization": request.headers.get("Authorization", "")}
        if body:
            headers["Content-Type"] = "application/json"
        url = self.upstream + request.path_qs
        async with (
            aiohttp.ClientSession() as client,
            client.request(request.method, url, data=body, headers=headers) as up,
        ):
            status, data, content_type = up.status, await up.read(), up.content_type
        if request.path == "/v1/peer/find" and status == 200:
            self.recorded = data
            if self.on_answer is not None:
                data = self.on_answer(data)
        if request.path.endswith("/planes") and status == 200:
            if self.stall_planes_s:
                await asyncio.sleep(self.stall_planes_s)
            if self.on_planes is not None:
                data = self.on_planes(data)
        return web.Response(status=status, body=data, content_type=content_type)


def edit_statement(answer: bytes, edit: Callable[[bytes], bytes], *, signature=None) -> bytes:
    """The answer with its statement bytes edited (and, optionally, a new signature)."""
    doc = json.loads(answer)
    raw = edit(base64.b64decode(doc["statement"]))
    doc["statement"] = base64.b64encode(raw).decode()
    if signature is not None:
        doc["signature"] = base64.b64encode(signature(raw)).decode()
    return json.dumps(doc).encode()


def flip(data: bytes, at: int | None = None) -> bytes:
    """One byte changed (the middle one unless `at` is given)."""
    i = len(data) // 2 if at is None else at
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]
