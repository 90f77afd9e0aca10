"""The catalog database: its URL and the SQLAlchemy engine every caller opens it with.

- database URL: an SQLAlchemy URL; postgresql:// and postgres:// are pinned to psycopg 3
  (the installed driver). `redacted` is the form fit for logs.
- make_engine: SQLite (the embedded, single-writer default) gets WAL, a busy timeout,
  foreign keys on, and every transaction opened with BEGIN IMMEDIATE, so a
  read-then-write transaction queues for the write lock up front instead of failing on
  a stale snapshot; a new database file is created 0600 in a 0700 directory.
  PostgreSQL gets a pool that pre-pings connections.
- timeout (`timeout_s`): how long any one catalog call may wait. SQLite: the busy
  timeout. PostgreSQL: `connect_timeout`, a server-side `statement_timeout`, and a
  client-side deadline on every wait for the server (the statement timeout and a little
  grace), because a server or network that stops answering never cancels anything
  itself; a connection whose deadline passed is closed, so the pool drops it, and for
  one timeout after that new connections fail at once instead of waiting out the
  connect timeout too (the pool's pre-ping would otherwise reconnect, doubling the wait).
  Past any of them the call raises an OperationalError (one of UNREACHABLE): callers
  decide whether that is an outage (recompute) or a refusal (auth fails closed).
  None: no timeouts (migrations, which may legitimately run long statements).

Used by kvpack (the service, the CLI) and by migrations/env.py alike, so Alembic runs on
the same engine settings without importing anything above catalog/.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url

DEFAULT_TIMEOUT_S = 10.0
SQLITE_BUSY_TIMEOUT_MS = 30_000  # without a timeout (timeout_s=None)
DEADLINE_GRACE_S = 1.0  # at most: the server's own statement timeout answers first
MIN_CONNECT_TIMEOUT_S = 2  # libpq and psycopg treat anything lower as 2 seconds
# The errors that mean the catalog did not answer (unreachable, timed out, busy), as
# opposed to a verdict on the statement (an integrity or programming error).
UNREACHABLE: tuple[type[Exception], ...] = (
    sa_exc.OperationalError,
    sa_exc.InterfaceError,
    sa_exc.TimeoutError,  # no pooled connection came free in time
    sa_exc.DisconnectionError,
)


def normalize_database_url(url: str) -> str:
    """Pin PostgreSQL URLs to psycopg 3; ValueError for an unparseable URL."""
    try:
        parsed = make_url(url)
    except Exception as e:  # SQLAlchemy raises ArgumentError; callers want one type
        raise ValueError(f"not a database URL: {url!r}") from e
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def redacted(url: str) -> str:
    """The URL with its password hidden."""
    return make_url(url).render_as_string(hide_password=True)


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def make_engine(url: str, *, timeout_s: float | None = DEFAULT_TIMEOUT_S, **kwargs: Any) -> Engine:
    """An Engine with the catalog's settings (see the module docstring)."""
    if timeout_s is not None and not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    parsed = make_url(normalize_database_url(url))
    if parsed.get_backend_name() != "sqlite":
        return _postgres_engine(parsed, timeout_s, **kwargs)
    if parsed.database and parsed.database != ":memory:":
        _private_file(Path(parsed.database).expanduser())
    engine = create_engine(parsed, **kwargs)
    busy_ms = SQLITE_BUSY_TIMEOUT_MS if timeout_s is None else math.ceil(timeout_s * 1000)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from pysqlite; SQLAlchemy's "begin" emits ours.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def _private_file(path: Path) -> None:
    """The database file 0600 (its -wal and -shm files copy its mode) in a directory
    created 0700: the catalog names every key and tenant of the vault."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        info = path.stat()
        if info.st_uid == os.getuid() and info.st_mode & 0o077:
            path.chmod(0o600)  # one an earlier version created with the umask's mode


def _postgres_engine(parsed: URL, timeout_s: float | None, **kwargs: Any) -> Engine:
    kwargs.setdefault("pool_pre_ping", True)
    if timeout_s is None:
        return create_engine(parsed, **kwargs)
    kwargs.setdefault("pool_timeout", timeout_s)
    engine = create_engine(parsed, **kwargs)
    deadline_s = timeout_s + min(DEADLINE_GRACE_S, timeout_s / 4)
    statement_ms = math.ceil(timeout_s * 1000)
    expired_at = [-math.inf]  # when a deadline last passed on one of this engine's connections

    def expired() -> None:
        expired_at[0] = time.monotonic()

    @event.listens_for(engine, "do_connect")
    def _connect(_dialect: Any, _record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
        import psycopg

        from catalog.deadline import DeadlineConnection

        if time.monotonic() - expired_at[0] < timeout_s:
            raise psycopg.OperationalError("the catalog just timed out; not reconnecting yet")
        cparams.setdefault("connect_timeout", max(MIN_CONNECT_TIMEOUT_S, math.ceil(timeout_s)))
        options = f"{cparams.get('options', '')} -c statement_timeout={statement_ms}"
        cparams["options"] = options.strip()
        return DeadlineConnection.open(deadline_s, expired, *cargs, **cparams)

    return engine
