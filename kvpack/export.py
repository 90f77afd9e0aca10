"""Export: a vault serving its own sealed cuts to trusted peers (read-only).

Routes (under /v1/peer/, peer or admin API keys only; kvpack/auth.py):
- GET  /v1/peer/keys: this producer's public bundle (catalog/signing.py).
- POST /v1/peer/find {identity, alignment, depth, links: [[depth, digest hex], ...],
  min_depth}: the deepest cut for that identity and token chain deeper than
  min_depth, as a signed statement (catalog/statement.py) — 404 when there is none.
  The peer sends chain links, never token ids.
- GET  /v1/peer/packs/{manifest id}/planes: the cut's planes, concatenated in the
  statement's order (application/octet-stream).

Only cuts this vault computed itself (provenance "local") whose stored envelope
carries a valid signature by one of this vault's keys are exported: an imported
cut is never re-exported under this vault's name. A key scoped to one namespace
sees only identities salted with that namespace; anything else is "not found".
Every cut is loaded through the durable tier, so its MAC and every chunk are
verified before a byte leaves.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from catalog.chain import TokenChain
from catalog.manifest import encode_body
from catalog.models import ManifestRow
from catalog.publish import LoadedCut, next_generation
from catalog.queries import Cut
from catalog.signing import EXPORT_DOMAIN, MANIFEST_DOMAIN, ProducerKeys, SignatureInvalid, verify
from catalog.statement import Statement, claims_for, encode
from kvpack.auth import PRINCIPAL
from kvpack.durable import DurableTier
from kvpack.openai_api import ApiError, parse_json

log = logging.getLogger(__name__)
MAX_LINKS = 1 << 16


@dataclass(frozen=True)
class Answer:
    statement: bytes
    signature: bytes
    manifest: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {
            "statement": base64.b64encode(self.statement).decode(),
            "signature": base64.b64encode(self.signature).decode(),
            "manifest": self.manifest,
            "size": self.size,
        }


class Exporter:
    def __init__(self, durable: DurableTier) -> None:
        self.durable = durable

    @property
    def keys(self) -> ProducerKeys:
        return self.durable.producer_keys  # rotation replaces it

    def find(
        self, *, identity: bytes, chain: TokenChain, min_depth: int, scope: str
    ) -> Answer | None:
        namespace = self._namespace(identity, scope)
        if namespace is None or chain.alignment != self.durable.alignment:
            return None
        cut = self.durable.deepest(identity=identity, chain=chain)
        if cut is None or cut.depth <= min_depth:
            return None
        row = self.durable.manifest_row(cut.manifest_id)
        loaded = self._load(row, namespace, cut)
        if loaded is None:
            return None
        m = loaded.manifest
        statement = Statement(
            identity=m.identity,
            depth=m.depth,
            alignment=m.alignment,
            chain=m.chain,
            logits_witnessed=m.logits_witnessed,
            layout=m.layout,
            planes=claims_for(loaded.planes),
            producer=self.keys.producer,
            generation=next_generation(),
            manifest=m.id,
        )
        body = encode(statement)
        return Answer(body, self.keys.sign(EXPORT_DOMAIN, body), m.id, statement.size)

    def planes(self, *, manifest_id: str, scope: str) -> bytes | None:
        row = self.durable.manifest_row(manifest_id)
        if row is None:
            return None
        namespace = self._namespace(bytes.fromhex(row.identity), scope)
        if namespace is None:
            return None
        cut = Cut(row.id, row.depth, row.aligned, True, row.logits_witnessed, row.bytes,
                  row.object_key)  # fmt: skip
        loaded = self._load(row, namespace, cut)
        return None if loaded is None else b"".join(data for _, data in loaded.planes)

    def _namespace(self, identity: bytes, scope: str) -> str | None:
        components = self.durable.identity_components(identity) or {}
        namespace = components.get("namespace")
        if namespace is None or scope not in ("*", namespace):
            return None
        return namespace

    def _load(self, row: ManifestRow | None, namespace: str, cut: Cut) -> LoadedCut | None:
        """The verified cut, only if this vault computed and signed it."""
        if row is None or row.provenance != "local":
            return None
        loaded = self.durable.load(namespace=namespace, identity=bytes.fromhex(row.identity),
                                   cut=cut)  # fmt: skip
        body = encode_body(loaded.manifest)
        try:
            verify(self.keys.public_keys(), MANIFEST_DOMAIN, body, loaded.signature)
        except SignatureInvalid as e:
            log.warning("not exporting %s: %s", row.id, e)
            return None
        return loaded


# -- routes ----------------------------------------------------------------------------

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
    _scope(request)
    bundle = request.app[EXPORTER].keys.bundle()
    return web.Response(text=bundle.to_json(), content_type="application/json")


async def find(request: web.Request) -> web.Response:
    scope = _scope(request)
    identity, chain, min_depth = parse_find(parse_json(await request.read()))
    exporter = request.app[EXPORTER]
    answer = await asyncio.to_thread(
        exporter.find, identity=identity, chain=chain, min_depth=min_depth, scope=scope
    )
    if answer is None:
        raise ApiError(404, "no exportable cut for that identity and chain", code="no_cut")
    return web.json_response(answer.to_json())


async def planes(request: web.Request) -> web.Response:
    scope = _scope(request)
    mid = request.match_info["manifest"]
    data = await asyncio.to_thread(request.app[EXPORTER].planes, manifest_id=mid, scope=scope)
    if data is None:
        raise ApiError(404, f"no exportable cut {mid!r}", code="no_cut")
    return web.Response(body=data, content_type="application/octet-stream")


def parse_find(doc: Any) -> tuple[bytes, TokenChain, int]:
    """(identity, chain, min_depth) from a find request; ApiError 400 naming the field."""
    if not isinstance(doc, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        identity = bytes.fromhex(doc["identity"])
        if len(identity) != 32:
            raise ValueError("identity must be 32 bytes of hex")
        alignment, depth, min_depth = (doc[k] for k in ("alignment", "depth", "min_depth"))
        if not all(type(v) is int and v >= 0 for v in (alignment, depth, min_depth)):
            raise ValueError("alignment, depth and min_depth must be integers >= 0")
        links = doc["links"]
        if not isinstance(links, list) or len(links) > MAX_LINKS:
            raise ValueError(f"links must be a list of at most {MAX_LINKS} [depth, digest]")
        parsed = tuple((d, bytes.fromhex(h)) for d, h in links if type(d) is int)
        if len(parsed) != len(links):
            raise ValueError("link depths must be integers")
    except (KeyError, TypeError, ValueError) as e:
        raise ApiError(400, f"malformed find request: {e}", param="links") from None
    if alignment < 1 or depth // alignment > MAX_LINKS:
        raise ApiError(400, f"alignment must be >= 1 and depth at most {MAX_LINKS} blocks")
    expected = [*range(alignment, depth + 1, alignment)]
    if depth > 0 and (not expected or expected[-1] != depth):
        expected.append(depth)
    if [d for d, _ in parsed] != expected or any(len(h) != 32 for _, h in parsed):
        raise ApiError(400, "links must name every aligned depth and the end", param="links")
    return identity, TokenChain(alignment=alignment, depth=depth, links=parsed), min_depth
