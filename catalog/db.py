"""The catalog database: its URL and the SQLAlchemy engine every caller opens it with.

- database URL: an SQLAlchemy URL; postgresql:// and postgres:// are pinned to psycopg 3
  (the installed driver). `redacted` is the form fit for logs.
- make_engine: SQLite (the embedded, single-writer default) gets WAL, a busy timeout,
  foreign keys on, and every transaction opened with BEGIN IMMEDIATE, so a
  read-then-write transaction queues for the write lock up front instead of failing on
  a stale snapshot; a new database file is created 0600 in a 0700 directory.
  PostgreSQL gets a pool that reuses connections without a pre-ping round trip: a
  checkout only looks at the idle connection's socket (no round trip), and one the
  server or a proxy closed meanwhile is replaced there (see liveness).
- liveness: an idle connection is owed nothing by the server, so one whose socket is
  readable (the server's goodbye on a restart, a reset, EOF) or that psycopg already
  knows broken is dead; the pool opens a new one in its place. A connection that dies
  unseen (after the check, or on a path that drops traffic silently) fails its call;
  Reader retries a read once for that, and the deadlines below bound the silent case.
- Reader: read-only calls, the lookups every request makes. PostgreSQL: in autocommit, so
  a lookup is its one statement's round trip, without a BEGIN/ROLLBACK pair (under
  READ COMMITTED, PostgreSQL's default, every statement takes its own snapshot inside a
  transaction too, so a read of several statements sees what it saw before); a call
  whose connection turns out dead (the pool invalidates it and every connection older
  than it) runs once more on a fresh one, unless its deadline passed (a server that does
  not answer is not retried). SQLite: a plain session, as before.
- timeout (`timeout_s`): how long any one catalog call may wait. SQLite: the busy
  timeout. PostgreSQL: `connect_timeout`, a server-side `statement_timeout`, and a
  client-side deadline on every wait for the server (the statement timeout and a little
  grace), because a server or network that stops answering never cancels anything
  itself; a connection whose deadline passed is closed, so the pool drops it, and for
  one timeout after that new connections fail at once instead of waiting out the
  connect timeout too (a retry or the next call would otherwise reconnect, doubling the
  wait).
  Past any of them the call raises an OperationalError (one of UNREACHABLE): callers
  decide whether that is an outage (recompute) or a refusal (auth fails closed).
  None: no timeouts (migrations, which may legitimately run long statements).

Used by kvpack (the service, the CLI) and by migrations/env.py alike, so Alembic runs on
the same engine settings without importing anything above catalog/.
"""

from __future__ import annotations

import math
import os
import select
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session

T = TypeVar("T")

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


class Reader:
    """Read-only catalog calls on one engine (see the module docstring)."""

    def __init__(self, db: Engine) -> None:
        self.db = db
        postgres = db.dialect.name == "postgresql"
        self._bind = db.execution_options(isolation_level="AUTOCOMMIT") if postgres else db

    def __call__(self, query: Callable[[Session], T]) -> T:
        """query(session), retried once on a fresh connection when its own had died."""
        try:
            with Session(self._bind) as session:
                return query(session)
        except sa_exc.DBAPIError as e:
            if not e.connection_invalidated or _deadline_passed(e):
                raise
        with Session(self._bind) as session:
            return query(session)


def _deadline_passed(e: sa_exc.DBAPIError) -> bool:
    from catalog.deadline import DeadlinePassed

    return isinstance(e.orig, DeadlinePassed)


def _dropped(dbapi_connection: Any) -> bool:
    """Whether an idle connection is known dead without asking the server (liveness)."""
    if dbapi_connection.closed or dbapi_connection.broken:
        return True
    poller = select.poll()  # POLLHUP and POLLERR are always reported
    poller.register(dbapi_connection.pgconn.socket, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(0))


def _postgres_engine(parsed: URL, timeout_s: float | None, **kwargs: Any) -> Engine:
    if timeout_s is not None:
        kwargs.setdefault("pool_timeout", timeout_s)
    engine = create_engine(parsed, **kwargs)

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        if _dropped(dbapi_connection):
            # The pool replaces it, and every connection opened before it (after a
            # server restart they are all gone), with new ones as they are checked out.
            raise sa_exc.InvalidatePoolError("the catalog closed this pooled connection")

    if timeout_s is None:
        return engine
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
