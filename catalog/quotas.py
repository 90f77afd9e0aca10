"""Quotas: a tenant namespace's byte quota, stored in the catalog.

- quota: the most plaintext bytes of distinct chunks a namespace's cuts may reference
  (its footprint, catalog/gc.py). GC evicts the tenant's own least recently hit cuts
  above it; a namespace without a row has no quota (only the vault's budget applies).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from catalog.models import QuotaRow
from catalog.queries import affected_rows, dialect_insert


def set_quota(*, session: Session, namespace: str, limit: int, now: datetime) -> None:
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"a quota needs a namespace, got {namespace!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"a quota is a number of bytes >= 0, got {limit!r}")
    stmt = dialect_insert(session, QuotaRow).values(
        namespace=namespace, bytes=limit, updated_at=now
    )
    session.execute(
        stmt.on_conflict_do_update(
            index_elements=[QuotaRow.namespace],
            set_={"bytes": stmt.excluded.bytes, "updated_at": stmt.excluded.updated_at},
        )
    )


def clear_quota(*, session: Session, namespace: str) -> bool:
    """Remove a namespace's quota; False when it had none."""
    changed = affected_rows(session, delete(QuotaRow).where(QuotaRow.namespace == namespace))
    return changed == 1


def all_quotas(*, session: Session) -> dict[str, int]:
    """namespace -> quota bytes."""
    return {
        r.namespace: r.bytes for r in session.execute(select(QuotaRow.namespace, QuotaRow.bytes))
    }
