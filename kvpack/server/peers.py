"""The peer routes: another vault asking this one for its cuts (kvpack/remote/exporter.py).

Peer or admin API keys only (kvpack/server/auth.py):
- GET  /v1/peer/keys: this producer's public bundle (catalog/signing.py).
- POST /v1/peer/find {identity, alignment, depth, links: [[depth, digest hex], ...],
  min_depth}: the deepest exportable cut deeper than min_depth as a signed statement,
  or 404. The links must form a token chain: every aligned depth, then the end; at most
  MAX_LINKS of them (each becomes query parameters, and databases cap those: PostgreSQL
  at 65,535 per statement, SQLite at 32,766).
- GET  /v1/peer/packs/{manifest id}/planes: the cut's parts (application/octet-stream).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from catalog.chain import TokenChain
from catalog.ids import ChainDigest, IdentityDigest, ManifestId
from kvpack.remote.exporter import Exporter
from kvpack.server.auth import PRINCIPAL
from kvpack.server.bodies import json_body
from kvpack.server.errors import ApiError
from kvpack.server.fields import hex_id, integer, known

MAX_LINKS = 8192  # find_deepest binds 3 parameters per link
MAX_ALIGNMENT = 1 << 20
MAX_FIND_BODY_BYTES = MAX_LINKS * 100 + 4096  # a link is [depth, 64 hex] in ~80 bytes
FIND_FIELDS = frozenset({"identity", "alignment", "depth", "links", "min_depth"})
EXPORTER = web.AppKey("exporter", Exporter)


def add_routes(app: web.Application, exporter: Exporter) -> None:
    app[EXPORTER] = exporter
    app.router.add_get("/v1/peer/keys", keys)
    app.router.add_post("/v1/peer/find", find)
    app.router.add_get("/v1/peer/packs/{manifest}/planes", planes)


def _scope(request: web.Request) -> str:
    """The namespaces the caller's key may export ("*": all)."""
    return request[PRINCIPAL].namespace


async def keys(request: web.Request) -> web.Response:
    bundle = request.app[EXPORTER].keys.bundle()
    return web.Response(text=bundle.to_json(), content_type="application/json")


async def find(request: web.Request) -> web.Response:
    scope = _scope(request)
    identity, chain, min_depth = parse_find(await json_body(request, limit=MAX_FIND_BODY_BYTES))
    exporter = request.app[EXPORTER]
    answer = await asyncio.to_thread(
        exporter.find, identity=identity, chain=chain, min_depth=min_depth, scope=scope
    )
    if answer is None:
        raise ApiError(404, "no exportable cut for that identity and chain", code="no_cut")
    return web.json_response(answer.to_json())


async def planes(request: web.Request) -> web.Response:
    scope = _scope(request)
    raw = request.match_info["manifest"]
    manifest_id = ManifestId.from_hex(hex_id(raw, "manifest", chars=2 * ManifestId.SIZE))
    data = await asyncio.to_thread(
        request.app[EXPORTER].planes, manifest_id=manifest_id, scope=scope
    )
    if data is None:
        raise ApiError(404, f"no exportable cut {manifest_id.hex}", param="manifest",
                       code="no_cut")  # fmt: skip
    return web.Response(body=data, content_type="application/octet-stream")


def parse_find(doc: Any) -> tuple[IdentityDigest, TokenChain, int]:
    """(identity, chain, min_depth) from a find request; ApiError 400 naming the field."""
    if not isinstance(doc, dict):
        raise ApiError(400, "the body must be a JSON object")
    known(doc, FIND_FIELDS)
    for name in FIND_FIELDS:
        if doc.get(name) is None:
            raise ApiError(400, f"{name} is required", param=name, code="missing_field")
    identity = IdentityDigest.from_hex(hex_id(doc["identity"], "identity", chars=64))
    alignment = integer(doc["alignment"], "alignment", lo=1, hi=MAX_ALIGNMENT)
    depth = integer(doc["depth"], "depth", lo=0, hi=MAX_LINKS * alignment)
    min_depth = integer(doc["min_depth"], "min_depth", lo=0, hi=depth)
    links = doc["links"]
    if not isinstance(links, list) or len(links) > MAX_LINKS:
        raise ApiError(400, f"links must be a list of at most {MAX_LINKS} [depth, digest hex]",
                       param="links")  # fmt: skip
    parsed = []
    for link in links:
        if not isinstance(link, list) or len(link) != 2:
            raise ApiError(400, "each link is [depth, digest hex]", param="links")
        d = integer(link[0], "links", lo=1, hi=depth)
        parsed.append((d, ChainDigest.from_hex(hex_id(link[1], "links", chars=64))))
    expected = [*range(alignment, depth + 1, alignment)]
    if depth > 0 and (not expected or expected[-1] != depth):
        expected.append(depth)
    if [d for d, _ in parsed] != expected:
        raise ApiError(400, "links must name every aligned depth and the end", param="links")
    return identity, TokenChain(alignment=alignment, depth=depth, links=tuple(parsed)), min_depth
