"""The catalog database: its URL and the SQLAlchemy engine every caller opens it with.

- database URL: an SQLAlchemy URL; postgresql:// and postgres:// are pinned to psycopg 3
  (the installed driver). `redacted` is the form fit for logs.
- make_engine: SQLite (the embedded, single-writer default) gets WAL, a busy timeout,
  foreign keys on, and every transaction opened with BEGIN IMMEDIATE, so a
  read-then-write transaction queues for the write lock up front instead of failing on
  a stale snapshot. PostgreSQL gets a pool that pre-pings connections.

Used by kvpack (the service, the CLI) and by migrations/env.py alike, so Alembic runs on
the same engine settings without importing anything above catalog/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

SQLITE_BUSY_TIMEOUT_MS = 30_000


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


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An Engine with the catalog's settings (see the module docstring)."""
    parsed = make_url(normalize_database_url(url))
    if parsed.get_backend_name() != "sqlite":
        kwargs.setdefault("pool_pre_ping", True)
        return create_engine(parsed, **kwargs)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(parsed, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from pysqlite; SQLAlchemy's "begin" emits ours.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine
