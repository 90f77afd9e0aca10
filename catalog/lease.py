"""Leases: a named, expiring claim in the catalog, so one instance of a fleet does a job
at a time (the collector), on SQLite and PostgreSQL alike.

Words:
- lease: a row (name, holder, acquired_at, expires_at). It is held while expires_at is
  in the future; its holder renews it while it works and releases it when done.
- acquire: one upsert that takes the row only when it is free, expired, or already
  ours, then reads it back: exactly one of several racing instances sees itself as the
  holder (PostgreSQL's row lock on the conflicting row, SQLite's single writer).
- a holder that dies simply stops renewing: once its lease expires anyone may take it,
  and whatever it left half done is the next holder's to finish (catalog/gc.py says how
  each step is finished by another).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import case, delete, or_, select, update
from sqlalchemy.orm import Session

from catalog.models import LeaseRow
from catalog.queries import affected_rows, dialect_insert


@dataclass(frozen=True, slots=True)
class Lease:
    name: str
    holder: str
    acquired_at: datetime
    expires_at: datetime


def acquire(
    *, session: Session, name: str, holder: str, ttl: timedelta, now: datetime
) -> Lease | None:
    """Take or renew `name` for `holder` until now + ttl; None when someone else holds it."""
    if ttl <= timedelta(0):
        raise ValueError(f"a lease needs a positive ttl, got {ttl}")
    row = LeaseRow
    stmt = dialect_insert(session, row).values(
        name=name, holder=holder, acquired_at=now, expires_at=now + ttl
    )
    ours = stmt.excluded.holder == row.holder
    session.execute(
        stmt.on_conflict_do_update(
            index_elements=[row.name],
            set_={
                "holder": stmt.excluded.holder,
                "expires_at": stmt.excluded.expires_at,
                # a renewal keeps its first acquisition time; a takeover starts anew
                "acquired_at": case((ours, row.acquired_at), else_=stmt.excluded.acquired_at),
            },
            where=or_(row.expires_at <= now, ours),
        )
    )
    got = holder_of(session=session, name=name)
    return got if got is not None and got.holder == holder else None


def renew(*, session: Session, name: str, holder: str, ttl: timedelta, now: datetime) -> bool:
    """Extend our unexpired lease; False when it is no longer ours (expired and taken)."""
    changed = affected_rows(
        session,
        update(LeaseRow)
        .where(LeaseRow.name == name, LeaseRow.holder == holder, LeaseRow.expires_at > now)
        .values(expires_at=now + ttl),
    )
    return changed == 1


def release(*, session: Session, name: str, holder: str) -> bool:
    """Give the lease up (only our own); False when it was not ours any more."""
    changed = affected_rows(
        session, delete(LeaseRow).where(LeaseRow.name == name, LeaseRow.holder == holder)
    )
    return changed == 1


def holder_of(*, session: Session, name: str) -> Lease | None:
    """The lease row as it is (expired or not); None when nobody ever took it or it was
    released."""
    row = session.execute(
        select(LeaseRow.name, LeaseRow.holder, LeaseRow.acquired_at, LeaseRow.expires_at).where(
            LeaseRow.name == name
        )
    ).one_or_none()
    return None if row is None else Lease(row.name, row.holder, row.acquired_at, row.expires_at)
