"""Reading a request body without blocking the event loop.

- read_body: the raw bytes, refused (413) past a limit: by the Content-Length header
  before a byte is read, or as soon as a chunked body passes it.
- json_body: read_body, then kvpack/server/fields.py parse_json on a worker thread (a
  large body's parse and depth check would otherwise hold the loop).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from kvpack.server.errors import ApiError
from kvpack.server.fields import parse_json

READ_CHUNK = 65536


async def read_body(request: web.Request, *, limit: int) -> bytes:
    too_large = ApiError(413, f"the request body is larger than {limit} bytes",
                         code="body_too_large")  # fmt: skip
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    chunks, size = [], 0
    while chunk := await request.content.read(READ_CHUNK):
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def json_body(request: web.Request, *, limit: int, empty: Any = None) -> Any:
    """The body as one JSON object; `empty` (when not None) stands for an empty body."""
    raw = await read_body(request, limit=limit)
    if empty is not None and not raw.strip():
        return empty
    return await asyncio.to_thread(parse_json, raw)
