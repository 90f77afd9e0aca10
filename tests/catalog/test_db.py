"""The catalog engine: SQLite and PostgreSQL settings every caller gets (catalog/db.py)."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from sqlalchemy import event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from catalog.db import Reader, make_engine, redacted
from catalog.deadline import DeadlinePassed
from tests.proxy import proxy


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


def test_sqlite_busy_timeout_follows_the_timeout_and_the_file_is_private(tmp_path):
    """Branches: the busy timeout is the catalog timeout; a new catalog file is created
    0600 in a new 0700 directory, and an existing one created 0644 is tightened."""
    path = tmp_path / "new" / "catalog.sqlite3"
    engine = make_engine(f"sqlite:///{path}", timeout_s=0.25)
    try:
        with engine.begin() as conn:
            assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 250
    finally:
        engine.dispose()
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    loose = tmp_path / "loose.sqlite3"
    loose.touch(mode=0o644)
    loose.chmod(0o644)
    make_engine(f"sqlite:///{loose}").dispose()
    assert loose.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_a_timeout_must_be_a_positive_finite_number(bad):
    with pytest.raises(ValueError, match="timeout_s"):
        make_engine("sqlite://", timeout_s=bad)


@pytest.fixture
def pg_url(tmp_path):
    from tests.fixtures.db import DatabaseFactory

    factory = DatabaseFactory("postgres", tmp_path)
    yield factory.create()
    factory.drop_all()


def in_thread(fn, *, wait_s: float = 60.0):
    """Run `fn` in a thread; (returned value or raised exception). A call that never
    ends fails the test after `wait_s` instead of hanging the suite."""
    done, out = threading.Event(), {}

    def run():
        try:
            out["value"] = fn()
        except Exception as e:  # noqa: BLE001 - handed to the test
            out["error"] = e
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(wait_s), f"the call did not end within {wait_s} s"
    return out.get("value"), out.get("error")


@pytest.mark.postgres
def test_postgres_statement_timeout_cancels_a_long_statement(pg_url):
    """Branch: the server's statement_timeout ends a statement that runs too long; the
    connection stays usable."""
    engine = make_engine(pg_url, timeout_s=1)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SHOW statement_timeout")).scalar() == "1s"
            with pytest.raises(OperationalError, match="statement timeout"):
                conn.execute(text("SELECT pg_sleep(30)"))
            conn.rollback()
            assert conn.execute(text("SELECT 1")).scalar() == 1
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_postgres_that_stops_answering_fails_the_call_and_recovers_after(pg_url):
    """Fault injection: PostgreSQL behind a TCP proxy that stops forwarding. A query on a
    pooled connection fails at the client deadline; a reconnect right after it fails at
    once (no second wait), one a timeout later at connect_timeout; none waits forever.
    Once healed, the same engine answers again (the broken connection left the pool)."""
    url = make_url(pg_url)
    with proxy(url.host or "127.0.0.1", url.port or 5432) as p:
        engine = make_engine(url.set(host="127.0.0.1", port=p.port).render_as_string(False),
                             timeout_s=1)  # fmt: skip
        try:
            with engine.connect() as conn:
                assert conn.execute(text("SELECT 1")).scalar() == 1
                p.stall()
                _, error = in_thread(lambda: conn.execute(text("SELECT 2")).scalar())
            assert isinstance(error, OperationalError)
            _, error = in_thread(lambda: _select(engine))
            assert isinstance(error, OperationalError) and "not reconnecting" in str(error)
            time.sleep(1.1)
            connections = p.connections
            _, error = in_thread(lambda: _select(engine))
            assert isinstance(error, OperationalError) and p.connections == connections + 1
            p.heal()
            time.sleep(1.1)
            assert in_thread(lambda: _select(engine)) == (1, None)
        finally:
            engine.dispose()


def _select(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT 1")).scalar()


def _backend_pid(session) -> int:
    return session.execute(text("SELECT pg_backend_pid()")).scalar()


def _terminate(pg_url: str, pid: int) -> None:
    """End one backend from the server's side (as a restart or an operator does) and wait
    until it is gone."""
    admin = make_url(pg_url).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        while conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
            time.sleep(0.01)


@pytest.mark.postgres
def test_postgres_reads_are_one_round_trip_on_a_reused_connection(pg_url):
    """No pre-ping and no BEGIN/ROLLBACK pair: once psycopg has prepared the statement on
    the server (it does after a few runs), each read is one round trip, all on the one
    connection the pool keeps (counted at a TCP proxy in front of the real server)."""
    url = make_url(pg_url)
    with proxy(url.host or "127.0.0.1", url.port or 5432) as p:
        engine = make_engine(url.set(host="127.0.0.1", port=p.port).render_as_string(False))
        read = Reader(engine)
        try:
            for _ in range(10):
                assert read(lambda s: s.execute(text("SELECT 1")).scalar()) == 1
            requests = p.requests
            for _ in range(20):
                read(lambda s: s.execute(text("SELECT 1")).scalar())
            assert (p.requests - requests, p.connections) == (20, 1)
        finally:
            engine.dispose()


@pytest.mark.postgres
def test_postgres_checkout_replaces_a_connection_the_server_ended(pg_url):
    """Branch (liveness at checkout): the server ended the pooled connection while it was
    idle (a restart ends them all); the next checkout sees the socket closed and hands out
    a new connection, so even a transaction (never retried) answers, with no pre-ping."""
    engine = make_engine(pg_url)
    try:
        with engine.begin() as conn:
            pid = _backend_pid(conn)
        _terminate(pg_url, pid)
        with engine.begin() as conn:
            assert _backend_pid(conn) != pid
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_postgres_read_whose_connection_dies_after_checkout_is_retried_once(pg_url):
    """Branch (retry): the connection passes the checkout check and dies before its query
    (the server ended it in between); the read runs again on a fresh connection and
    answers. A transaction is not retried: its caller sees the disconnect."""
    engine = make_engine(pg_url)
    read = Reader(engine)
    killed: list[int] = []

    def kill_once(dbapi_connection, _record, _proxy):
        if not killed:
            killed.append(dbapi_connection.info.backend_pid)
            _terminate(pg_url, killed[0])

    try:
        read(_backend_pid)  # a pooled connection to die
        event.listen(engine, "checkout", kill_once)
        assert read(_backend_pid) not in killed and len(killed) == 1
        killed.clear()
        with pytest.raises(OperationalError) as raised, engine.begin() as conn:
            _backend_pid(conn)
        assert raised.value.connection_invalidated
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_postgres_reads_survive_a_proxy_that_cut_every_connection(pg_url):
    """Fault injection: a TCP proxy in front of the real server resets every open
    connection (a load balancer or PgBouncer restart) and then forwards again; the next
    reads answer on a new connection."""
    url = make_url(pg_url)
    with proxy(url.host or "127.0.0.1", url.port or 5432) as p:
        engine = make_engine(url.set(host="127.0.0.1", port=p.port).render_as_string(False))
        read = Reader(engine)
        try:
            pid = read(_backend_pid)
            p.drop()
            p.heal()
            assert read(_backend_pid) != pid and p.connections == 2
        finally:
            engine.dispose()


@pytest.mark.postgres
def test_postgres_read_past_its_deadline_is_not_retried(pg_url):
    """Branch: a read whose server stopped answering fails at its deadline, once: no
    second connection is tried (the retry is for dead sockets, not silent servers)."""
    url = make_url(pg_url)
    with proxy(url.host or "127.0.0.1", url.port or 5432) as p:
        engine = make_engine(url.set(host="127.0.0.1", port=p.port).render_as_string(False),
                             timeout_s=1)  # fmt: skip
        read = Reader(engine)
        try:
            read(_backend_pid)
            p.stall()
            _, error = in_thread(lambda: read(_backend_pid))
            # A retry would have raised its own error: "not reconnecting yet".
            assert isinstance(error, OperationalError) and isinstance(error.orig, DeadlinePassed)
        finally:
            p.heal()
            engine.dispose()
