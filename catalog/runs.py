"""Maintenance runs: a row per GC or verify pass, whichever instance or command ran it.

- run: kind ("gc" or "verify"), holder (who ran it), started and finished times, outcome
  ("ok", "problems": verify found damage, "failed": the pass raised) and a JSON summary
  (the GC report, the verify counts). The newest of each kind is what /metrics and the
  status page show as the fleet's last GC and last verify.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from catalog.models import MaintenanceRunRow

KINDS = ("gc", "verify")
OUTCOMES = ("ok", "problems", "failed")
KEEP = 1000  # rows kept per kind


@dataclass(frozen=True, slots=True)
class Run:
    kind: str
    holder: str
    started_at: datetime
    finished_at: datetime
    outcome: str
    details: dict[str, Any] | None


def record(
    *,
    session: Session,
    kind: str,
    holder: str,
    started_at: datetime,
    finished_at: datetime,
    outcome: str,
    details: dict[str, Any] | None = None,
) -> None:
    """Add a run, and drop the oldest beyond KEEP of its kind."""
    if kind not in KINDS or outcome not in OUTCOMES:
        raise ValueError(f"run kind {kind!r} / outcome {outcome!r} unknown")
    session.add(
        MaintenanceRunRow(
            kind=kind,
            holder=holder[:255],
            started_at=started_at,
            finished_at=finished_at,
            outcome=outcome,
            details=details,
        )
    )
    session.flush()
    r = MaintenanceRunRow
    old = select(r.id).where(r.kind == kind).order_by(r.id.desc()).offset(KEEP).limit(1)
    cutoff = session.scalar(old)
    if cutoff is not None:
        session.execute(delete(r).where(r.kind == kind, r.id <= cutoff))


def last(*, session: Session, kind: str) -> Run | None:
    """The newest run of `kind`."""
    r = MaintenanceRunRow
    row = session.scalars(
        select(r).where(r.kind == kind).order_by(r.finished_at.desc(), r.id.desc()).limit(1)
    ).one_or_none()
    if row is None:
        return None
    return Run(row.kind, row.holder, row.started_at, row.finished_at, row.outcome, row.details)
