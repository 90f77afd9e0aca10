"""DirectGet: an S3 object's body read from the socket straight into the caller's buffer.

A chunk read through aiobotocore copies every byte three times before the seal sees it:
the socket's bytes into a new object, aiohttp's parser copying the body out of them, and
`readinto` copying that into the scratch buffer — all on the event loop's thread, under
the GIL. Here a presigned GET (signed by the aiobotocore client, cas/s3.py) is sent on a
plain `http.client` connection in a worker thread, and the body is read with
`readinto`, which for a body larger than its buffer lets the kernel write into the
caller's memory directly: one copy, with the GIL released while it waits. Measured on
SeaweedFS on loopback (31 objects of 11.25 MiB, four in flight, nine rounds): 344 ms
and 153 ms of client CPU against 412 ms and 267 ms through aiobotocore.

`get` reads a whole object (a manifest) the same way, into a buffer of the size the
answer announces: off the loop, where aiobotocore's parser would hold it while the
chunks' reads wait to start, and on the path the warm start has already run. Measured
(`benchmarks/manifest_get.py`, run twice: SeaweedFS on loopback, 3 kB objects, six fresh
processes a path, each warmed as a server is): the first read after the start 1.64-2.87
ms and the next ones 1.24-2.28 ms, against 2.26-3.87 ms and 1.78-3.54 ms through
aiobotocore.

- connections: kept per (scheme, host, port) between reads, at most `keep` idle; one
  that failed or that the server will close is dropped, never reused. A kept one the
  server closed meanwhile is retried once on a new connection, as urllib3 does, so an
  idle timeout is not an outage.
- answers: 200 is read into the buffer; any other status is turned into the
  botocore.exceptions.ClientError botocore would have raised (the code, message and
  request id of the S3 error body, else the status), so cas/s3.py's one table
  translates both paths alike. A body that ends early raises IncompleteReadError.
- timeouts: `connect_timeout_s` to connect, `read_timeout_s` for each read after it.

Not for reads through a proxy: S3Config.direct_get is off where the environment names one
for the endpoint, and then the aiobotocore path reads.
"""

from __future__ import annotations

import http.client
import ssl
import threading
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Callable
from urllib.parse import urlsplit

from botocore import exceptions as bx
from botocore.httpsession import get_cert_path

from cas.buffers import Landed, read_into
from cas.errors import ObjectTooLarge

MAX_ERROR_BODY = 64 << 10  # an S3 error document is a few hundred bytes
Origin = tuple[str, str, int]  # scheme, host, port
# How a kept connection the server has closed meets the next request, before any answer.
STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class DirectGet:
    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        keep: int,
        ca_bundle: str | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keep = keep
        self._ca_bundle = ca_bundle
        self._tls: ssl.SSLContext | None = None
        self._idle: defaultdict[Origin, list[http.client.HTTPConnection]] = defaultdict(list)
        self._lock = threading.Lock()

    def get_into(self, url: str, key: str, out: memoryview, landed: Landed | None = None) -> int:
        """GET `url` (presigned) into `out`; the body's size. Blocks: call it off the loop.
        ObjectTooLarge (named `key`) when the body does not fit. `landed`: as read_into's
        (cas/buffers.py), called on this thread."""

        def body(resp: http.client.HTTPResponse, size: int) -> int:
            if size > len(out):
                raise ObjectTooLarge(key, size, len(out))
            return read_into(resp.readinto, out, size, landed)

        return self._get(url, body)

    def get(self, url: str) -> bytes:
        """GET `url` (presigned): the whole body, in a buffer of the size it announces (a
        manifest's read, off the loop and without aiobotocore's parser). Blocks."""
        held: list[bytearray] = []

        def body(resp: http.client.HTTPResponse, size: int) -> int:
            held.append(bytearray(size))
            return read_into(resp.readinto, memoryview(held[0]), size)

        self._get(url, body)
        return bytes(held[0])

    def _get(self, url: str, body: Callable[[http.client.HTTPResponse, int], int]) -> int:
        """GET `url`; `body(resp, size)` reads an answered 200's body and returns the bytes
        it read; the body's size."""
        parts = urlsplit(url)
        origin = (parts.scheme, parts.hostname or "", parts.port or _default_port(parts.scheme))
        target = f"{parts.path}?{parts.query}" if parts.query else parts.path
        conn, reused = self._take(origin)
        reusable = False
        try:
            try:
                resp = _ask(conn, target)
            except STALE:
                if not reused:
                    raise
                conn.close()  # the server closed it while idle: once more, on a new one
                conn, _ = self._take(origin, fresh=True)
                resp = _ask(conn, target)
            if resp.status != 200:
                error = _client_error(resp)
                reusable = not resp.will_close
                raise error
            size = resp.length
            if size is None:  # no Content-Length: S3 always sends one for a GET
                raise http.client.HTTPException("GET answered without a Content-Length")
            n = body(resp, size)
            if not size:  # read() ends an empty body: a response left open blocks the connection
                resp.read()
            if n < size:
                raise bx.IncompleteReadError(actual_bytes=n, expected_bytes=size)
            reusable = not resp.will_close
            return n
        finally:
            if reusable:
                self._give_back(origin, conn)
            else:
                conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, defaultdict(list)
        for conns in idle.values():
            for conn in conns:
                conn.close()

    def _take(
        self, origin: Origin, *, fresh: bool = False
    ) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection to `origin` (reused: True), else a new, connected one."""
        if not fresh:
            with self._lock:
                pool = self._idle[origin]
                if pool:
                    return pool.pop(), True
        scheme, host, port = origin
        conn: http.client.HTTPConnection
        if scheme == "https":
            conn = http.client.HTTPSConnection(
                host, port, timeout=self.connect_timeout_s, context=self._context()
            )
        else:
            conn = http.client.HTTPConnection(host, port, timeout=self.connect_timeout_s)
        conn.connect()
        conn.sock.settimeout(self.read_timeout_s)
        return conn, False

    def _give_back(self, origin: Origin, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            pool = self._idle[origin]
            if len(pool) < self.keep:
                pool.append(conn)
                return
        conn.close()

    def _context(self) -> ssl.SSLContext:
        # botocore's trust store (certifi's bundle unless AWS_CA_BUNDLE names one), so both
        # paths trust the same servers.
        if self._tls is None:
            self._tls = ssl.create_default_context(cafile=self._ca_bundle or get_cert_path(True))
        return self._tls


def _ask(conn: http.client.HTTPConnection, target: str) -> http.client.HTTPResponse:
    conn.request("GET", target)
    return conn.getresponse()


def _client_error(resp: http.client.HTTPResponse) -> bx.ClientError:
    """The ClientError botocore raises for this answer: the S3 error document's code,
    message and request id, or the bare status where there is none."""
    body = resp.read(MAX_ERROR_BODY)
    code, message = str(resp.status), resp.reason
    request_id = resp.getheader("x-amz-request-id", "")
    try:
        doc = ET.fromstring(body) if body else None
    except ET.ParseError:
        doc = None
    if doc is not None:
        code = doc.findtext("Code") or code
        message = doc.findtext("Message") or message
        request_id = doc.findtext("RequestId") or request_id
    meta = {"HTTPStatusCode": resp.status, "RequestId": request_id}
    return bx.ClientError({"Error": {"Code": code, "Message": message}, "ResponseMetadata": meta},
                          "GetObject")  # fmt: skip


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80
