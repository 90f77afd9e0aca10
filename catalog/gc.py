"""GC: evict cuts by tenant quotas and a byte budget, reclaim chunks nothing references,
delete orphaned objects.

Words:
- footprint: plaintext bytes of the distinct chunks some manifest references. A
  tenant's footprint counts its own identities' manifests only; chunk ids are keyed per
  namespace, so tenants never share a chunk and their footprints add up.
- quota: a tenant namespace's byte quota (catalog/quotas.py). A tenant over its quota
  loses its own least recently hit cuts, down to the quota, and nobody else's.
- budget: the whole vault's byte budget. After the quotas, the least recently hit cuts
  of any tenant go until the footprint fits it.
- eviction: deleting a manifest's catalog rows (one transaction), then its
  manifest object; least recently hit first (never hit: oldest first). Eviction
  touches the manifest's chunks, so the grace period counts from the moment they
  stopped being referenced.
- orphan: an object no catalog row names. A manifest object is orphaned by a publish
  that died between writing it and committing (or a collector that died between a
  manifest's rows and its object); it is deleted once older than the grace period. A
  chunk object is orphaned by a publish that died after its reservation was collected;
  GC claims it with a condemned row first (so publishes wait), then deletes it.
- grace period: how long after its last reference (a manifest's eviction, or a
  publish's reservation) a chunk is left alone.
- condemned: a chunk row GC has claimed (condemned_at/by) while it deletes the
  chunk's object; the row is deleted only after the object is gone.

Why a publish in flight never loses a chunk (docs/architecture.md, invariant 11):
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
evicting one never races a publish that would adopt it. A publish stalled for longer
than the grace period between writing its manifest object and committing can find the
object collected as an orphan: its cut then fails to load (ManifestMissing), is
condemned and recomputed (fail closed), never served wrong.

Checkpoints: `checkpoint(name)` is awaited at "evicted" (after each eviction),
"condemned", "objects_deleted" and "orphans": tests pause there to interleave, and the
maintainer (kvpack/maintainer.py) renews its lease there and stops when it has lost it.
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
from cas.errors import ObjectMissing
from cas.ids import ChunkId
from cas.layout import prefix_of
from cas.store import ObjectStore
from catalog import queries
from catalog import quotas as quota_queries
from catalog.ids import ManifestId
from catalog.tx import Checkpoint, no_checkpoint, run_tx, with_session

MAX_CONCURRENCY = 8  # object deletions in flight
EVICTION_ROUNDS = 3  # re-measure after evicting: publishes may have added bytes meanwhile


@dataclass
class GcReport:
    footprint_before: int = 0
    footprint_after: int = 0
    evicted: list[ManifestId] = field(default_factory=list)  # in eviction order
    deleted_chunks: list[str] = field(default_factory=list)  # chunk ids (hex)
    freed_bytes: int = 0  # plaintext bytes the evictions left unreferenced
    quota_evicted: dict[str, int] = field(default_factory=dict)  # namespace -> cuts
    orphan_manifests: list[str] = field(default_factory=list)  # object keys
    orphan_chunks: list[str] = field(default_factory=list)  # chunk ids (hex)

    def to_json(self) -> dict[str, object]:
        return {
            "footprint_before": self.footprint_before,
            "footprint_after": self.footprint_after,
            "evicted": len(self.evicted),
            "quota_evicted": dict(self.quota_evicted),
            "freed_bytes": self.freed_bytes,
            "deleted_chunks": len(self.deleted_chunks),
            "orphan_manifests": len(self.orphan_manifests),
            "orphan_chunks": len(self.orphan_chunks),
        }


async def collect(
    *,
    objects: ObjectStore,
    db: Engine,
    budget_bytes: int | None,
    grace: timedelta,
    now: datetime | None = None,
    batch: int = 500,
    checkpoint: Checkpoint | None = None,
    quotas: bool = True,
    orphans: bool = False,
) -> GcReport:
    """Evict each tenant's least recently hit cuts down to its quota (`quotas`), then
    anyone's down to `budget_bytes` (None: no budget); delete chunks unreferenced for
    longer than `grace` from the store and the catalog; with `orphans`, delete objects no
    row names (it lists the store). Chunk object keys do not depend on the namespace, so
    one collector serves every tenant. `checkpoint`: see the module docstring.
    """
    if budget_bytes is not None and budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    if grace < timedelta(0):
        raise ValueError(f"grace must not be negative, got {grace}")
    now = now or datetime.now(UTC)
    cutoff = now - grace
    run_id = secrets.token_hex(8)
    point: Checkpoint = checkpoint or no_checkpoint
    report = GcReport()
    report.footprint_before = await run_tx(db, lambda s: queries.referenced_bytes(session=s))

    if quotas:
        limits = await run_tx(db, lambda s: quota_queries.all_quotas(session=s))
        for namespace, limit in sorted(limits.items()):
            await _evict(objects, db, limit, now, report, point, namespace=namespace)
    if budget_bytes is not None:
        await _evict(objects, db, budget_bytes, now, report, point)

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

    if orphans:
        await _orphan_manifests(objects, db, cutoff, report)
        await point("orphans")
        await _orphan_chunks(objects, db, now, run_id, batch, report, point)

    report.footprint_after = await run_tx(db, lambda s: queries.referenced_bytes(session=s))
    return report


async def _evict(
    objects: ObjectStore,
    db: Engine,
    budget: int,
    now: datetime,
    report: GcReport,
    point: Checkpoint,
    *,
    namespace: str | None = None,
) -> None:
    """Evict least recently hit cuts (of `namespace` only, when given) until the
    footprint (of `namespace`) fits `budget`, measured again after each round."""

    def measure(s: Session) -> int:
        return queries.referenced_bytes(session=s, namespace=namespace)

    def evict_one(s: Session) -> tuple[ManifestId, str, int] | None:
        victims = queries.least_recently_hit(session=s, limit=1, namespace=namespace)
        if not victims:
            return None
        mid, _ = victims[0]
        freed = queries.exclusive_bytes(session=s, manifest_id=mid)
        okey = queries.delete_manifest(session=s, manifest_id=mid, now=now)
        return (mid, okey, freed) if okey else None

    for _ in range(EVICTION_ROUNDS):
        footprint = await run_tx(db, measure)
        if footprint <= budget:
            return
        while footprint > budget:
            victim = await run_tx(db, evict_one)
            if victim is None:
                return
            mid, okey, freed = victim
            await objects.delete(okey)  # rows first: a reader can no longer find it
            report.evicted.append(mid)
            report.freed_bytes += freed
            if namespace is not None:
                report.quota_evicted[namespace] = report.quota_evicted.get(namespace, 0) + 1
            footprint -= freed
            await point("evicted")


async def _orphan_manifests(
    objects: ObjectStore, db: Engine, cutoff: datetime, report: GcReport
) -> None:
    """Delete manifest objects no row names, once older than the grace period."""
    keys = await objects.list_keys(prefix_of("manifest"))
    named = await run_tx(db, lambda s: queries.manifest_object_keys(session=s))
    for key in keys:
        if key in named:
            continue
        try:
            info = await objects.stat(key)
        except ObjectMissing:
            continue
        if info.modified < cutoff:
            await objects.delete(key)
            report.orphan_manifests.append(key)


async def _orphan_chunks(
    objects: ObjectStore,
    db: Engine,
    now: datetime,
    run_id: str,
    batch: int,
    report: GcReport,
    point: Checkpoint,
) -> None:
    """Delete chunk objects that have no row: claimed first with a condemned row of our
    own (a publish that wants the chunk waits for it), then the object, then the row."""
    keys = await objects.list_keys(prefix_of("chunk"))
    by_id = {key.rsplit("/", 1)[-1]: key for key in keys}
    known = await run_tx(db, lambda s: queries.chunk_ids(session=s))
    loose = sorted(i for i in by_id if i not in known)
    for start in range(0, len(loose), batch):
        ids = loose[start : start + batch]
        claim = with_session(queries.claim_orphans, ids=ids, now=now, run_id=run_id)
        claimed = await run_tx(db, claim)
        await bounded([partial(objects.delete, by_id[i]) for i in claimed], MAX_CONCURRENCY)
        await point("objects_deleted")
        drop = with_session(queries.delete_condemned, ids=claimed, run_id=run_id)
        await run_tx(db, drop)
        report.orphan_chunks.extend(claimed)


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
