"""The economics ledger: paired timings, persisted (keyword-only queries that never commit).

- paired timing: one restore of a cut and the identical local prefill of the same cut,
  timed in one process (kvpack/accounting/pairing.py makes them): the identity, the tier
  the restored state came from, the depth (tokens restored = tokens the paired prefill
  computed), both durations and when they were measured. kvpack's economics derive
  speedup and seconds saved from these and nothing else (invariant 8).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from catalog.ids import IdentityDigest
from catalog.models import EconomicsRow


@dataclass(frozen=True, slots=True)
class PairedTiming:
    identity: IdentityDigest
    tier: str  # where the restored state came from
    depth: int
    restore_seconds: float
    prefill_seconds: float
    measured_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    def __post_init__(self) -> None:
        if not isinstance(self.identity, IdentityDigest):
            raise ValueError(f"identity must be an IdentityDigest, got {self.identity!r}")
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {self.depth!r}")
        for name in ("restore_seconds", "prefill_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number of seconds, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")


def insert_timing(*, session: Session, timing: PairedTiming) -> None:
    session.execute(
        insert(EconomicsRow).values(
            identity=timing.identity.hex,
            tier=timing.tier,
            restored_tokens=timing.depth,
            restore_seconds=timing.restore_seconds,
            prefill_seconds=timing.prefill_seconds,
            measured_at=timing.measured_at,
        )
    )


def timings(*, session: Session, identities: Sequence[IdentityDigest]) -> list[PairedTiming]:
    """Every paired timing for these identities, oldest first."""
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
        .where(e.identity.in_([i.hex for i in identities]))
        .order_by(e.measured_at, e.id)
    )
    return [
        PairedTiming(
            identity=IdentityDigest.from_hex(r.identity),
            tier=r.tier,
            depth=r.restored_tokens,
            restore_seconds=r.restore_seconds,
            prefill_seconds=r.prefill_seconds,
            measured_at=r.measured_at,
        )
        for r in rows
    ]
