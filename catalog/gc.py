"""GC: evict cuts by a byte budget, then reclaim chunks nothing references.

Words:
- footprint: plaintext bytes of the distinct chunks some manifest references.
- eviction: deleting a manifest's catalog rows (one transaction), then its
  manifest object; least recently hit first (never hit: oldest first), until the
  footprint fits the budget. Eviction touches the manifest's chunks, so the
  grace period counts from the moment they stopped being referenced.
- grace period: how long after its last reference (a manifest's eviction, or a
  publish's reservation) a chunk is left alone.
- condemned: a chunk row GC has claimed (condemned_at/by) while it deletes the
  chunk's object; the row is deleted only after the object is gone.

Why a publish in flight never loses a chunk (DESIGN invariant 11):
1. Before uploading, a publish reserves its chunks in a committed transaction:
   each row is inserted or has last_referenced_at set to now, unless GC has
   condemned it, in which case the publish waits until the row is gone (GC
   deletes the object first), then reserves a fresh row and uploads again.
   So "already exists" on a later put-if-absent can never be an object that a
   collector is about to delete.
2. GC condemns with one conditional UPDATE that re-checks every condition
   (not condemned, untouched since now - grace, no manifest_chunks row). On
   PostgreSQL a concurrent reservation or commit holds the row lock and its
   new last_referenced_at fails the re-check; SQLite serializes writers.
3. The publish's final transaction locks its chunk rows (in id order) and
   checks each is still the row it reserved (present, not condemned, same
   first_stored_at), then touches them and inserts manifest_chunks rows, which
   make them unreferenceable by GC forever after. If a reservation was collected
   (the publish outlived the grace period) the transaction rolls back and the
   publish reserves and uploads again.
4. A collector that dies after condemning leaves rows that publishes wait on;
   the next collector adopts condemnations older than the grace period.

Manifest objects are written once per publish attempt under a unique key, so
evicting one never races a publish that would adopt it.
Not collected (yet): manifest objects orphaned by a crashed publish (small).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from cas.chunks import ChunkStore, bounded
from cas.ids import ChunkId
from cas.store import ObjectStore
from catalog import queries
from catalog.ids import ManifestId
from catalog.tx import Checkpoint, no_checkpoint, run_tx

MAX_CONCURRENCY = 8  # object deletions in flight


@dataclass
class GcReport:
    footprint_before: int = 0
    footprint_after: int = 0
    evicted: list[ManifestId] = field(default_factory=list)  # in eviction order
    deleted_chunks: list[str] = field(default_factory=list)  # chunk ids (hex)


async def collect(
    *,
    objects: ObjectStore,
    db: Engine,
    budget_bytes: int | None,
    grace: timedelta,
    now: datetime | None = None,
    batch: int = 500,
    checkpoint: Checkpoint | None = None,
) -> GcReport:
    """Evict least recently hit cuts down to `budget_bytes` (None: no eviction), then
    delete chunks unreferenced for longer than `grace` from the store and the catalog.
    Chunk object keys do not depend on the namespace, so one collector serves every tenant.

    `checkpoint(name)` is awaited at "condemned" and "objects_deleted" (tests interleave).
    """
    if budget_bytes is not None and budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    if grace < timedelta(0):
        raise ValueError(f"grace must not be negative, got {grace}")
    now = now or datetime.now(UTC)
    cutoff = now - grace
    run_id = secrets.token_hex(8)
    point = checkpoint or no_checkpoint
    report = GcReport()
    report.footprint_before = await run_tx(db, lambda s: queries.referenced_bytes(session=s))

    if budget_bytes is not None:
        await _evict(objects, db, budget_bytes, now, report)

    adopted = await run_tx(
        db,
        lambda s: queries.adopt_abandoned(
            session=s, cutoff=cutoff, now=now, run_id=run_id, limit=batch
        ),
    )
    await _reclaim(objects, db, adopted, run_id, report)

    while True:

        def condemn(s: Session) -> list[str]:
            ids = queries.collectible_chunks(session=s, cutoff=cutoff, limit=batch)
            return queries.condemn_chunks(session=s, ids=ids, cutoff=cutoff, now=now, run_id=run_id)

        condemned = await run_tx(db, condemn)
        if not condemned:
            break
        await point("condemned")
        await _reclaim(objects, db, condemned, run_id, report, point)

    report.footprint_after = await run_tx(db, lambda s: queries.referenced_bytes(session=s))
    return report


async def _evict(
    objects: ObjectStore, db: Engine, budget: int, now: datetime, report: GcReport
) -> None:
    footprint = report.footprint_before
    while footprint > budget:

        def evict_one(s: Session) -> tuple[ManifestId, str, int] | None:
            victims = queries.least_recently_hit(session=s, limit=1)
            if not victims:
                return None
            mid, _ = victims[0]
            freed = queries.exclusive_bytes(session=s, manifest_id=mid)
            okey = queries.delete_manifest(session=s, manifest_id=mid, now=now)
            return (mid, okey, freed) if okey else None

        victim = await run_tx(db, evict_one)
        if victim is None:
            return
        mid, okey, freed = victim
        await objects.delete(okey)  # rows first: a reader can no longer find it
        report.evicted.append(mid)
        footprint -= freed


async def _reclaim(
    objects: ObjectStore,
    db: Engine,
    ids: Sequence[str],
    run_id: str,
    report: GcReport,
    point: Checkpoint | None = None,
) -> None:
    """Delete the objects of chunks this run condemned, then their rows."""
    if not ids:
        return
    keys = [ChunkStore.key(ChunkId.from_hex(i)) for i in ids]
    await bounded([partial(objects.delete, k) for k in keys], MAX_CONCURRENCY)
    if point is not None:
        await point("objects_deleted")
    await run_tx(db, lambda s: queries.delete_condemned(session=s, ids=ids, run_id=run_id))
    report.deleted_chunks.extend(ids)
