"""Forget: make every cut of an identity, a model or a tenant unreachable at once.

- selector: exactly one of an identity (full hex, or a prefix of at least 8 hex
  characters naming one identity), a model name (every identity recorded with it,
  catalog/models.py), or a namespace (every identity of that tenant).
- forget: the cuts' rows are deleted in batches (each a transaction), so from the first
  commit on neither this vault's find nor a peer's export can name them; then their
  manifest objects are deleted. Their chunks are left to GC: unreferenced from now, they
  go after the grace period (a `kvpack vault gc --grace 0s` reclaims them at once).
  Identity rows stay (they are a few bytes and name what the ledger measured).
A server still running the model publishes its next requests anew: forget a model
after it stops being served.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from cas.store import ObjectStore
from catalog import queries
from catalog.ids import ManifestId
from catalog.models import IdentityRow, ManifestRow
from catalog.tx import run_tx

BATCH = 200
MIN_PREFIX = 8


class SelectorInvalid(ValueError):
    """A forget selector that names nothing precisely (none, several, or an ambiguous
    identity prefix)."""


@dataclass(frozen=True, slots=True)
class Selector:
    identity: str | None = None
    model: str | None = None
    namespace: str | None = None

    def __post_init__(self) -> None:
        given = [v for v in (self.identity, self.model, self.namespace) if v is not None]
        if len(given) != 1 or not given[0]:
            raise SelectorInvalid("name exactly one of an identity, a model or a namespace")
        if self.identity is not None:
            text = self.identity.lower()
            if len(text) < MIN_PREFIX or any(c not in "0123456789abcdef" for c in text):
                raise SelectorInvalid(
                    f"an identity is hex, at least {MIN_PREFIX} characters: {self.identity!r}"
                )
            object.__setattr__(self, "identity", text)

    def __str__(self) -> str:
        if self.identity is not None:
            return f"identity {self.identity}"
        return f"model {self.model}" if self.model is not None else f"namespace {self.namespace}"


@dataclass
class ForgetReport:
    identities: list[str] = field(default_factory=list)  # hex
    cuts: int = 0
    bytes: int = 0  # the cuts' plaintext bytes (shared chunks counted per cut)
    dry_run: bool = False

    def to_json(self) -> dict[str, object]:
        return {
            "identities": self.identities,
            "cuts": self.cuts,
            "bytes": self.bytes,
            "dry_run": self.dry_run,
        }


def identities(*, session: Session, selector: Selector) -> list[str]:
    """The identity digests (hex) the selector names; SelectorInvalid for an ambiguous
    identity prefix."""
    i = IdentityRow
    if selector.model is not None:
        stmt = select(i.digest).where(i.model == selector.model)
    elif selector.namespace is not None:
        stmt = select(i.digest).where(i.namespace == selector.namespace)
    else:
        assert selector.identity is not None
        stmt = select(i.digest).where(i.digest.startswith(selector.identity, autoescape=True))
    found = sorted(session.scalars(stmt))
    if selector.identity is not None and len(found) > 1:
        shown = ", ".join(d[:16] for d in found[:5])
        raise SelectorInvalid(f"identity prefix {selector.identity} names {len(found)}: {shown}")
    return found


async def forget(
    *,
    objects: ObjectStore,
    db: Engine,
    selector: Selector,
    dry_run: bool = False,
    progress: Callable[[int], None] | None = None,
    now: datetime | None = None,
) -> ForgetReport:
    """Delete the rows, then the manifest objects, of every cut the selector names.
    `progress(n)` is called with the number of cuts done after each batch."""
    now = now or datetime.now(UTC)
    report = ForgetReport(dry_run=dry_run)

    def survey(s: Session) -> tuple[list[str], int, int]:
        digests = identities(session=s, selector=selector)
        count, total = s.execute(
            select(func.count(), func.coalesce(func.sum(ManifestRow.bytes), 0)).where(
                ManifestRow.identity.in_(digests)
            )
        ).one()
        return digests, int(count), int(total)

    report.identities, report.cuts, report.bytes = await run_tx(db, survey)
    if dry_run or not report.identities:
        return report

    def batch(s: Session) -> list[str]:
        ids = list(
            s.scalars(
                select(ManifestRow.id)
                .where(ManifestRow.identity.in_(report.identities))
                .order_by(ManifestRow.id)
                .limit(BATCH)
            )
        )
        keys = []
        for mid in ids:
            key = queries.delete_manifest(session=s, manifest_id=ManifestId.from_hex(mid), now=now)
            if key is not None:
                keys.append(key)
        return keys

    done = 0
    while keys := await run_tx(db, batch):
        for key in keys:
            await objects.delete(key)
        done += len(keys)
        if progress is not None:
            progress(len(keys))
    report.cuts = max(report.cuts, done)
    return report
