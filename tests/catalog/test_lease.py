"""Leases (catalog/lease.py) on SQLite and PostgreSQL: one holder at a time, renewal,
release, and takeover only once a holder's lease has expired."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session

from catalog import lease

TTL = timedelta(minutes=5)


def tx(engine, fn):
    with Session(engine) as s, s.begin():
        return fn(s)


def test_one_holder_until_it_releases(db_engine):
    """A second holder is refused while the first holds the lease, and gets it once the
    first releases it; releasing someone else's lease does nothing."""
    now = datetime.now(UTC)
    got = tx(db_engine, lambda s: lease.acquire(session=s, name="gc", holder="a", ttl=TTL, now=now))
    assert got is not None and got.holder == "a" and got.expires_at == now + TTL
    assert (
        tx(db_engine, lambda s: lease.acquire(session=s, name="gc", holder="b", ttl=TTL, now=now))
        is None
    )
    assert not tx(db_engine, lambda s: lease.release(session=s, name="gc", holder="b"))
    assert tx(db_engine, lambda s: lease.holder_of(session=s, name="gc")).holder == "a"
    assert tx(db_engine, lambda s: lease.release(session=s, name="gc", holder="a"))
    assert (
        tx(db_engine, lambda s: lease.acquire(session=s, name="gc", holder="b", ttl=TTL, now=now))
        is not None
    )


def test_an_expired_lease_is_taken_over_and_its_old_holder_cannot_renew(db_engine):
    """A holder that stopped renewing (it died) loses the lease at expiry: another takes
    it, and the old holder's renewal then fails, so it knows to stop."""
    t0 = datetime.now(UTC)
    assert tx(
        db_engine, lambda s: lease.acquire(session=s, name="gc", holder="dead", ttl=TTL, now=t0)
    )
    before = t0 + TTL - timedelta(seconds=1)
    assert (
        tx(
            db_engine,
            lambda s: lease.acquire(session=s, name="gc", holder="b", ttl=TTL, now=before),
        )
        is None
    )
    after = t0 + TTL
    got = tx(
        db_engine, lambda s: lease.acquire(session=s, name="gc", holder="b", ttl=TTL, now=after)
    )
    assert got is not None and got.acquired_at == after
    assert not tx(
        db_engine, lambda s: lease.renew(session=s, name="gc", holder="dead", ttl=TTL, now=after)
    )
    assert tx(
        db_engine, lambda s: lease.renew(session=s, name="gc", holder="b", ttl=TTL, now=after)
    )


def test_a_renewal_keeps_the_first_acquisition_time(db_engine):
    t0 = datetime.now(UTC)
    tx(db_engine, lambda s: lease.acquire(session=s, name="gc", holder="a", ttl=TTL, now=t0))
    later = t0 + timedelta(minutes=1)
    got = tx(
        db_engine, lambda s: lease.acquire(session=s, name="gc", holder="a", ttl=TTL, now=later)
    )
    assert (got.acquired_at, got.expires_at) == (t0, later + TTL)


def test_racing_acquirers_get_exactly_one_holder(db_engine):
    """Eight threads acquire the same free lease at once: exactly one holds it."""
    now = datetime.now(UTC)
    start = threading.Barrier(8)
    won: list[str] = []

    def take(name: str) -> None:
        start.wait()
        if tx(
            db_engine, lambda s: lease.acquire(session=s, name="gc", holder=name, ttl=TTL, now=now)
        ):
            won.append(name)

    threads = [threading.Thread(target=take, args=(f"h{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(won) == 1
    assert tx(db_engine, lambda s: lease.holder_of(session=s, name="gc")).holder == won[0]


def test_a_lease_needs_a_positive_ttl(db_engine):
    with pytest.raises(ValueError, match="ttl"):
        tx(
            db_engine,
            lambda s: lease.acquire(
                session=s, name="gc", holder="a", ttl=timedelta(0), now=datetime.now(UTC)
            ),
        )
