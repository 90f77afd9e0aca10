"""The catalog engine: SQLite and PostgreSQL settings every caller gets (catalog/db.py)."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from catalog.db import make_engine, redacted


def test_sqlite_engine_settings(tmp_path):
    """SQLite engines: WAL, busy timeout, foreign keys on, write lock taken at BEGIN."""
    engine = make_engine(f"sqlite:///{tmp_path}/sub/dir/c.sqlite3")  # parent dirs created
    try:
        with engine.begin() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
            assert conn.execute(text("PRAGMA busy_timeout")).scalar() >= 1000
            conn.execute(text("CREATE TABLE t (x INTEGER)"))
        # A second connection cannot write while the first holds a transaction open:
        # BEGIN IMMEDIATE took the write lock up front.
        other = make_engine(f"sqlite:///{tmp_path}/sub/dir/c.sqlite3")
        with other.connect() as c2:
            c2.exec_driver_sql("PRAGMA busy_timeout=50")
            c2.rollback()
            with engine.begin(), pytest.raises(OperationalError, match="locked"):
                c2.begin()
        other.dispose()
    finally:
        engine.dispose()


def test_redacted_hides_the_password():
    assert redacted("postgresql+psycopg://u:secret@h/db") == "postgresql+psycopg://u:***@h/db"
