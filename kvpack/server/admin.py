"""Admin routes (admin API keys only; kvpack/server/auth.py): quarantine, GC, key rotation.

- GET    /v1/admin/quarantine[?state=refused]: recent imports, newest first.
- GET    /v1/admin/quarantine/{import id}: one import, with its reason.
- DELETE /v1/admin/quarantine/{import id}: drop it (bytes, then row).
- POST   /v1/admin/gc {"budget_bytes": int | null, "grace_s": number,
         "quarantine_retention_s": number}: evict and reclaim (catalog/gc.py), then
         drop quarantined imports older than the retention. Every field is checked
         before anything is deleted: an integer is an int (true is not 1), a number is
         finite and at most MAX_SECONDS, and an unknown field is refused.
- GET    /v1/admin/restores: what each restore cost inside this process (seconds,
         bytes, peak RSS added; kvpack/service/restores.py), oldest first; 404 unless
         the server measures them (`kvpack serve --measure-restores`).
- POST   /v1/admin/keys/rotate: a new producer signing key, endorsed by the current
         one (catalog/signing.py); returns the public bundle for peers.
Each runs off the event loop: they touch the catalog and the object store. Ids are
checked by shape (32 lowercase hex characters) before any lookup.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path
from typing import Any

from aiohttp import web

from catalog.trust import STATES
from kvpack.remote.quarantine import DEFAULT_RETENTION, BadImportId, check_import_id
from kvpack.server.bodies import json_body
from kvpack.server.errors import ApiError
from kvpack.server.fields import integer, known, number
from kvpack.service.service import Service

DEFAULT_GRACE = timedelta(hours=1)
MAX_SECONDS = 100 * 365 * 86400  # a century: any longer is a mistake, and overflows
MAX_BUDGET_BYTES = 2**63 - 1
GC_FIELDS = frozenset({"budget_bytes", "grace_s", "quarantine_retention_s"})
MAX_GC_BODY_BYTES = 4096
ADMIN = web.AppKey("admin", Service)
KEY_PATH = web.AppKey("producer_key_path", Path)


def add_routes(app: web.Application, service: Service, producer_key_path: Path | None) -> None:
    app[ADMIN] = service
    app.router.add_get("/v1/admin/quarantine", quarantine_list)
    app.router.add_get("/v1/admin/quarantine/{import_id}", quarantine_show)
    app.router.add_delete("/v1/admin/quarantine/{import_id}", quarantine_drop)
    app.router.add_post("/v1/admin/gc", gc)
    app.router.add_get("/v1/admin/restores", restores)
    if producer_key_path is not None:
        app[KEY_PATH] = producer_key_path
        app.router.add_post("/v1/admin/keys/rotate", rotate)


async def quarantine_list(request: web.Request) -> web.Response:
    known(request.query, {"state"})
    state = request.query.get("state")
    if state is not None and state not in STATES:
        raise ApiError(400, f"state must be one of {STATES}", param="state")
    records = await asyncio.to_thread(request.app[ADMIN].quarantine.list, state=state)
    return web.json_response({"imports": [r.to_json() for r in records]})


def _import_id(request: web.Request) -> str:
    import_id = request.match_info["import_id"]
    try:
        return check_import_id(import_id)
    except BadImportId as e:
        raise ApiError(400, str(e), param="import_id") from None


async def quarantine_show(request: web.Request) -> web.Response:
    import_id = _import_id(request)
    record = await asyncio.to_thread(request.app[ADMIN].quarantine.show, import_id)
    if record is None:
        raise ApiError(404, f"no quarantined import {import_id!r}", param="import_id",
                       code="not_found")  # fmt: skip
    return web.json_response(record.to_json())


async def quarantine_drop(request: web.Request) -> web.Response:
    import_id = _import_id(request)
    dropped = await asyncio.to_thread(request.app[ADMIN].quarantine.drop, import_id)
    if not dropped:
        raise ApiError(404, f"no quarantined import {import_id!r}", param="import_id",
                       code="not_found")  # fmt: skip
    return web.json_response({"dropped": import_id})


async def gc(request: web.Request) -> web.Response:
    doc = await json_body(request, limit=MAX_GC_BODY_BYTES, empty={})
    known(doc, GC_FIELDS)
    budget = doc.get("budget_bytes")
    if budget is not None:
        budget = integer(budget, "budget_bytes", lo=0, hi=MAX_BUDGET_BYTES)
    grace = _seconds(doc, "grace_s", DEFAULT_GRACE)
    retention = _seconds(doc, "quarantine_retention_s", DEFAULT_RETENTION)
    service = request.app[ADMIN]

    def run() -> dict[str, Any]:
        report = service.vault.collect(budget_bytes=budget, grace=grace)
        dropped = service.quarantine.collect(retention=retention)
        return {
            "footprint_before": report.footprint_before,
            "footprint_after": report.footprint_after,
            "evicted": [m.hex for m in report.evicted],
            "deleted_chunks": len(report.deleted_chunks),
            "quarantine_dropped": dropped,
        }

    return web.json_response(await asyncio.to_thread(run))


async def restores(request: web.Request) -> web.Response:
    known(request.query, set())
    meter = request.app[ADMIN].restores
    if meter is None:
        raise ApiError(404, "restores are not measured: start the server with "
                       "--measure-restores", code="not_found")  # fmt: skip
    return web.json_response({"restores": [r.to_json() for r in meter.records()]})


async def rotate(request: web.Request) -> web.Response:
    service, path = request.app[ADMIN], request.app[KEY_PATH]
    bundle = await asyncio.to_thread(service.vault.rotate_producer_key, path)
    return web.Response(text=bundle.to_json(), content_type="application/json")


def _seconds(doc: dict[str, Any], name: str, default: timedelta) -> timedelta:
    value = doc.get(name)
    if value is None:
        return default
    return timedelta(seconds=number(value, name, lo=0.0, hi=MAX_SECONDS))
