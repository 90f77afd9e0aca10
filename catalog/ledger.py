"""The economics ledger: paired timings, persisted (keyword-only queries that never commit).

- ledger entry: one restore of a cut and the identical local prefill of the same cut,
  timed in one process (kvpack/economics.py's PairedTiming): the identity, the tier the
  restored state came from, the restored tokens (the cut's depth), both durations and
  when they were measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from catalog.models import EconomicsRow


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    identity: bytes
    tier: str
    restored_tokens: int
    restore_seconds: float
    prefill_seconds: float
    measured_at: datetime


def insert_entry(*, session: Session, entry: LedgerEntry) -> None:
    session.execute(
        insert(EconomicsRow).values(
            identity=entry.identity.hex(),
            tier=entry.tier,
            restored_tokens=entry.restored_tokens,
            restore_seconds=entry.restore_seconds,
            prefill_seconds=entry.prefill_seconds,
            measured_at=entry.measured_at,
        )
    )


def entries(*, session: Session, identities: Sequence[bytes]) -> list[LedgerEntry]:
    """Every entry for these identities, oldest first."""
    e = EconomicsRow
    rows = session.execute(
        select(
            e.identity,
            e.tier,
            e.restored_tokens,
            e.restore_seconds,
            e.prefill_seconds,
            e.measured_at,
        )
        .where(e.identity.in_([i.hex() for i in identities]))
        .order_by(e.measured_at, e.id)
    )
    return [
        LedgerEntry(
            identity=bytes.fromhex(r.identity),
            tier=r.tier,
            restored_tokens=r.restored_tokens,
            restore_seconds=r.restore_seconds,
            prefill_seconds=r.prefill_seconds,
            measured_at=r.measured_at,
        )
        for r in rows
    ]
