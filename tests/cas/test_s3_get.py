"""cas/s3_get.py's DirectGet against a scripted HTTP server on loopback (fault injection:
the answers a real S3 server gives rarely or never on purpose). Its reads against the
real S3 server are in test_s3.py and the contract suite."""

from __future__ import annotations

import socket
import threading
from collections import deque

import pytest
from botocore import exceptions as bx

from cas.errors import ObjectTooLarge
from cas.s3 import S3Config
from cas.s3_get import DirectGet

ERROR_DOC = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied.</Message><RequestId>req-7</RequestId></Error>"
)


def answer(status: str, body: bytes, *, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    return f"HTTP/1.1 {status}\r\nContent-Length: {size}\r\n\r\n".encode() + body


class Scripted:
    """Answers each request with the next scripted reply: (bytes to send, then close the
    connection?), or None for silence. Counts connections and requests."""

    def __init__(self, *replies: tuple[bytes, bool] | None) -> None:
        self.replies = deque(replies)
        self.connections = self.requests = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/bucket/key?X-Amz-Signature=x"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn: socket.socket) -> None:
        with conn:
            while True:
                request = b""
                while b"\r\n\r\n" not in request:
                    data = conn.recv(65536)
                    if not data:
                        return
                    request += data
                self.requests += 1
                reply = self.replies.popleft()
                if reply is None:
                    threading.Event().wait(10)  # silence
                    return
                data, close = reply
                conn.sendall(data)
                if close:
                    return

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def direct():
    reader = DirectGet(connect_timeout_s=2, read_timeout_s=2, keep=4)
    yield reader
    reader.close()


def test_a_body_is_read_into_the_buffer_and_the_connection_kept(direct):
    """Two 200s on one kept connection; each body lands in the caller's buffer."""
    server = Scripted((answer("200 OK", b"first body"), False), (answer("200 OK", b"two"), False))
    out = bytearray(16)
    assert direct.get_into(server.url, "k", memoryview(out)) == 10 and out[:10] == b"first body"
    assert direct.get_into(server.url, "k", memoryview(out)) == 3 and out[:3] == b"two"
    assert (server.connections, server.requests) == (1, 2)
    server.close()


def test_a_whole_body_is_read_at_its_announced_size_and_an_early_end_refused(direct):
    """get (a manifest's read): the body at the size its Content-Length announces, on the
    kept connection; a body that ends before that size is an incomplete read."""
    server = Scripted(
        (answer("200 OK", b"m" * 70_000), False),
        (answer("200 OK", b""), False),
        (answer("200 OK", b"short", length=9), True),
    )
    assert direct.get(server.url) == b"m" * 70_000
    assert direct.get(server.url) == b""
    with pytest.raises((bx.IncompleteReadError, ConnectionError)):
        direct.get(server.url)
    assert (server.connections, server.requests) == (1, 3)
    server.close()


def test_an_error_answer_is_the_client_error_botocore_raises(direct):
    """Branch: status != 200. An S3 error document gives its code, message and request
    id; a bare 404 gives the status as the code. The connection is kept after both."""
    server = Scripted(
        (answer("403 Forbidden", ERROR_DOC), False), (answer("404 Not Found", b""), False)
    )
    with pytest.raises(bx.ClientError) as e:
        direct.get_into(server.url, "k", memoryview(bytearray(8)))
    error, meta = e.value.response["Error"], e.value.response["ResponseMetadata"]
    assert (error["Code"], error["Message"]) == ("AccessDenied", "Access Denied.")
    assert (meta["HTTPStatusCode"], meta["RequestId"]) == (403, "req-7")
    with pytest.raises(bx.ClientError) as e:
        direct.get_into(server.url, "k", memoryview(bytearray(8)))
    assert e.value.response["Error"]["Code"] == "404"
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    assert server.connections == 1
    server.close()


def test_a_body_larger_than_the_buffer_is_refused_before_a_byte_lands(direct):
    """Branch: Content-Length past the buffer: ObjectTooLarge, the buffer untouched, and
    the connection (its body unread) dropped."""
    server = Scripted((answer("200 OK", b"x" * 100), False), (answer("200 OK", b"ok"), False))
    out = bytearray(b"-" * 99)
    with pytest.raises(ObjectTooLarge) as e:
        direct.get_into(server.url, "chunks/ab/cd", memoryview(out))
    assert (e.value.key, e.value.size, e.value.capacity) == ("chunks/ab/cd", 100, 99)
    assert out == b"-" * 99
    assert direct.get_into(server.url, "k", memoryview(out)) == 2
    assert server.connections == 2
    server.close()


def test_a_body_that_ends_early_is_an_incomplete_read(direct):
    """Branch: the server closes before Content-Length bytes came: IncompleteReadError
    (the door retries it) and the connection is not reused."""
    server = Scripted(
        (answer("200 OK", b"only4", length=10), True), (answer("200 OK", b"y"), False)
    )
    with pytest.raises((bx.IncompleteReadError, ConnectionError)):
        direct.get_into(server.url, "k", memoryview(bytearray(16)))
    assert direct.get_into(server.url, "k", memoryview(bytearray(16))) == 1
    assert server.connections == 2
    server.close()


def test_a_kept_connection_the_server_closed_is_retried_once_on_a_new_one(direct):
    """Branch: STALE. The server closes a connection after answering without saying so; the
    next read finds it dead before any answer and goes once more, on a new connection,
    without an error for the caller. If that one fails too, the error is raised."""
    server = Scripted(
        (answer("200 OK", b"a"), True), (answer("200 OK", b"b"), True), (b"", True)
    )  # fmt: skip
    out = bytearray(4)
    assert direct.get_into(server.url, "k", memoryview(out)) == 1
    assert direct.get_into(server.url, "k", memoryview(out)) == 1 and out[:1] == b"b"
    assert server.connections == 2
    with pytest.raises(ConnectionError):  # the kept one is dead, the new one answers nothing
        direct.get_into(server.url, "k", memoryview(out))
    assert server.connections == 3
    server.close()


def test_a_server_that_stops_answering_times_out(direct):
    """A request answered with silence fails after read_timeout_s (a TimeoutError, which
    the door retries), not never."""
    server = Scripted(None)
    quick = DirectGet(connect_timeout_s=1, read_timeout_s=0.3, keep=1)
    with pytest.raises(TimeoutError):
        quick.get_into(server.url, "k", memoryview(bytearray(4)))
    quick.close()
    server.close()


def test_a_proxy_for_the_endpoint_turns_the_direct_read_off(monkeypatch):
    """The direct GET does not speak to proxies: where the environment sets one for the
    endpoint's scheme (and no_proxy does not exempt its host), reads go through botocore,
    which honours it; direct_get=False turns it off everywhere."""
    for name in ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    config = S3Config(bucket="b", endpoint_url="http://10.1.2.3:9000")
    assert config.reads_direct()
    monkeypatch.setenv("https_proxy", "http://proxy:3128")
    assert config.reads_direct()  # a proxy for the other scheme
    monkeypatch.setenv("http_proxy", "http://proxy:3128")
    assert not config.reads_direct()
    monkeypatch.setenv("no_proxy", "10.1.2.3")
    assert config.reads_direct()
    monkeypatch.delenv("http_proxy")
    monkeypatch.delenv("no_proxy")
    assert not S3Config(
        bucket="b", endpoint_url="http://10.1.2.3:9000", direct_get=False
    ).reads_direct()
