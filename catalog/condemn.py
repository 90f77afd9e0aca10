"""Condemnation: a cut that failed verification is taken out of the catalog at once and
its broken bytes out of the store, so the next publish of the same history is clean.

Words:
- condemn: record why (a condemnations row: manifest, identity, depth, object key, kind,
  reason, the broken chunk if any), delete the cut's rows (find never offers it again,
  for this vault and for peers), then delete its manifest object. Its chunks become
  unreferenced and GC reclaims them after the grace period; a republish of the same
  history reserves them again, and the idempotency key no longer names the broken row.
- broken chunk: a chunk that is corrupt or missing breaks every cut that references it,
  so all of them are condemned in the same transaction, and the chunk's row is claimed
  the way GC claims one (condemned_at/by): a publish that needs the chunk waits until
  the broken object is deleted and the row is gone, then uploads the chunk afresh. A
  publish that already reserved it fails its final check and reserves again.
- kind: a short name for what failed: chunk_corrupt, chunk_missing, manifest_invalid,
  manifest_missing, stale_generation, restore_refused, size_mismatch, unsigned, ...

Order, and why a condemner that dies leaves nothing another cannot finish: rows first
(one transaction), then objects. A manifest object left behind is an orphan GC deletes;
a broken chunk left condemned is adopted by the next collector after the grace period.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session

from cas.chunks import ChunkStore
from cas.errors import ChunkCorrupt, ChunkMissing, ObjectCorrupt, UnknownKey
from cas.ids import ChunkId
from cas.store import ObjectStore
from catalog import queries
from catalog.errors import ManifestInvalid, ManifestMissing, StaleGeneration
from catalog.ids import ManifestId
from catalog.models import ChunkRow, CondemnationRow, ManifestChunkRow, ManifestRow
from catalog.tx import run_tx

KINDS: tuple[tuple[type[BaseException], str], ...] = (  # most specific first
    (ChunkCorrupt, "chunk_corrupt"),
    (ChunkMissing, "chunk_missing"),
    (ManifestMissing, "manifest_missing"),
    (ManifestInvalid, "manifest_invalid"),
    (StaleGeneration, "stale_generation"),
    (ObjectCorrupt, "object_corrupt"),
    (UnknownKey, "unknown_key"),
)


def kind_of(error: BaseException) -> str:
    """The kind of a verification failure; "refused" for one this layer does not know."""
    return next((k for t, k in KINDS if isinstance(error, t)), "refused")


def broken_chunk(error: BaseException) -> ChunkId | None:
    """The chunk a failure names, when the chunk itself is broken."""
    if isinstance(error, ChunkCorrupt | ChunkMissing):
        return error.chunk_id
    return None


@dataclass(frozen=True, slots=True)
class Condemned:
    manifest_id: ManifestId
    identity: str  # hex
    depth: int
    object_key: str
    kind: str
    reason: str


async def condemn(
    *,
    objects: ObjectStore,
    db: Engine,
    manifest_id: ManifestId,
    kind: str,
    reason: str,
    chunk: ChunkId | None = None,
    now: datetime | None = None,
) -> list[Condemned]:
    """Condemn a cut (and, for a broken `chunk`, every cut referencing it); returns what
    was condemned (empty when the cut was gone already)."""
    now = now or datetime.now(UTC)
    run_id = f"heal-{secrets.token_hex(5)}"
    hex_chunk = None if chunk is None else chunk.hex

    def rows(s: Session) -> tuple[list[Condemned], bool]:
        claimed = False
        victims = [manifest_id.hex]
        if hex_chunk is not None:
            # Lock the chunk's row first: a publish committing a reference to it either
            # finished before (we see its manifest below) or waits and then sees it condemned.
            claimed = _claim_broken(s, hex_chunk, now, run_id)
            victims += list(
                s.scalars(
                    select(ManifestChunkRow.manifest).where(ManifestChunkRow.chunk == hex_chunk)
                )
            )
        out = []
        for mid in sorted(set(victims)):
            got = _condemn_row(s, mid, kind, reason, hex_chunk, now)
            if got is not None:
                out.append(got)
        return out, claimed

    condemned, claimed = await run_tx(db, rows)
    for c in condemned:
        await objects.delete(c.object_key)
    if claimed and hex_chunk is not None:
        await objects.delete(ChunkStore.key(ChunkId.from_hex(hex_chunk)))
        await run_tx(
            db, lambda s: queries.delete_condemned(session=s, ids=[hex_chunk], run_id=run_id)
        )
    return condemned


def recent(*, session: Session, limit: int = 100) -> list[CondemnationRow]:
    """The latest condemnations, newest first."""
    return list(
        session.scalars(
            select(CondemnationRow)
            .order_by(CondemnationRow.condemned_at.desc(), CondemnationRow.id.desc())
            .limit(limit)
        )
    )


def _claim_broken(s: Session, chunk: str, now: datetime, run_id: str) -> bool:
    """Mark the broken chunk's row condemned by this run (False: none, or GC has it)."""
    changed = queries.affected_rows(
        s,
        update(ChunkRow)
        .where(ChunkRow.id == chunk, ChunkRow.condemned_at.is_(None))
        .values(condemned_at=now, condemned_by=run_id),
    )
    return changed == 1


def _condemn_row(
    s: Session, mid: str, kind: str, reason: str, chunk: str | None, now: datetime
) -> Condemned | None:
    row = s.execute(
        select(ManifestRow.identity, ManifestRow.depth, ManifestRow.object_key).where(
            ManifestRow.id == mid
        )
    ).one_or_none()
    if row is None:
        return None
    s.add(
        CondemnationRow(
            manifest=mid,
            identity=row.identity,
            depth=row.depth,
            object_key=row.object_key,
            kind=kind,
            reason=reason[:2000],
            chunk=chunk,
            condemned_at=now,
        )
    )
    queries.delete_manifest(session=s, manifest_id=ManifestId.from_hex(mid), now=now)
    return Condemned(
        ManifestId.from_hex(mid), row.identity, row.depth, row.object_key, kind, reason
    )
