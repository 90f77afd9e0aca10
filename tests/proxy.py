"""A TCP proxy for fault injection around a real server (PostgreSQL, SeaweedFS).

- forward: bytes pass both ways unchanged.
- stall: the proxy stops answering: connections are accepted (and kept), nothing is
  forwarded either way, as with a server that hangs or a path that drops packets.
- drop: every connection is closed as soon as it is accepted, and the open ones are
  cut; as with a server that is down or a load balancer that resets.
`heal()` goes back to forward; stalled connections are cut then, so their waiting
clients see an error instead of a late answer. `connections` counts accepted ones,
`requests` the reads forwarded from clients to the server (on loopback, one per round
trip a client starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

Mode = Literal["forward", "stall", "drop"]


class Proxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.mode: Mode = "forward"
        self.connections = 0
        self.requests = 0
        self.port = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> Proxy:
        self._thread.start()
        self._server = self._run(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def set_mode(self, mode: Mode) -> None:
        async def change() -> None:
            self.mode = mode
            if mode != "stall":
                for writer in list(self._writers):
                    writer.transport.abort()

        self._run(change())

    def stall(self) -> None:
        self.set_mode("stall")

    def drop(self) -> None:
        self.set_mode("drop")

    def heal(self) -> None:
        self.set_mode("forward")

    def close(self) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()

        self._run(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.mode == "drop":
            writer.transport.abort()
            return
        self._writers.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            self._writers.discard(writer)
            return
        self._writers.add(up_writer)
        await asyncio.gather(
            self._pipe(reader, up_writer, upstream=True),
            self._pipe(up_reader, writer),
            return_exceptions=True,
        )
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.transport.abort()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool = False
    ) -> None:
        with contextlib.suppress(OSError):  # either side went away (or was cut): done
            while data := await reader.read(65536):
                self.requests += upstream
                while self.mode == "stall":  # hold the bytes: the peer sees silence
                    await asyncio.sleep(0.01)
                if self.mode == "drop":
                    return
                writer.write(data)
                await writer.drain()
            writer.write_eof()


@contextmanager
def proxy(host: str, port: int) -> Iterator[Proxy]:
    running = Proxy(host, port).start()
    try:
        yield running
    finally:
        running.close()
