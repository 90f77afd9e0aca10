"""What a GC pass would do, without doing it (`kvpack vault gc --dry-run`).

The plan replays catalog/gc.py's eviction on a copy of the catalog's manifest map in
memory (each manifest's chunks and their sizes; a chunk's bytes leave the footprint when
its last manifest goes): each tenant down to its quota, then everyone down to the budget,
least recently hit first. Then it counts the chunks GC would reclaim now (unreferenced,
not touched within the grace period, not condemned). Evictions only start the grace
period of the chunks they free, so those are not counted as reclaimed. It holds the
manifest map in memory (one entry per manifest chunk reference).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import exists, func, select
from sqlalchemy.orm import Session

from catalog import quotas
from catalog.models import LAST_USE_ORDER, ChunkRow, IdentityRow, ManifestChunkRow, ManifestRow


@dataclass
class GcPlan:
    footprint_before: int = 0
    footprint_after: int = 0
    evict: list[tuple[str, str | None, str]] = field(default_factory=list)  # (id, ns, why)
    freed_bytes: int = 0
    reclaimable_chunks: int = 0
    reclaimable_bytes: int = 0  # sealed bytes

    def evict_by(self) -> dict[str, int]:
        """Evictions per reason ("budget", "quota:<namespace>")."""
        by: dict[str, int] = defaultdict(int)
        for _, ns, why in self.evict:
            by[f"{why}:{ns}" if why == "quota" else why] += 1
        return dict(by)

    def to_json(self) -> dict[str, object]:
        return {
            "dry_run": True,
            "footprint_before": self.footprint_before,
            "footprint_after": self.footprint_after,
            "evict": len(self.evict),
            "evict_by": self.evict_by(),
            "freed_bytes": self.freed_bytes,
            "reclaimable_chunks": self.reclaimable_chunks,
            "reclaimable_bytes": self.reclaimable_bytes,
        }


def plan(*, session: Session, budget_bytes: int | None, cutoff: datetime) -> GcPlan:
    m, mc, c, i = ManifestRow, ManifestChunkRow, ChunkRow, IdentityRow
    order: list[tuple[str, str | None]] = [
        (r.id, r.namespace)
        for r in session.execute(
            select(m.id, i.namespace).outerjoin(i, i.digest == m.identity).order_by(*LAST_USE_ORDER)
        )
    ]
    chunks_of: dict[str, list[str]] = defaultdict(list)
    size: dict[str, int] = {}
    for mid, chunk, n in session.execute(
        select(mc.manifest, mc.chunk, c.size).join(c, c.id == mc.chunk)
    ):
        chunks_of[mid].append(chunk)
        size[chunk] = n
    refs: dict[str, int] = defaultdict(int)
    ns_of_chunk: dict[str, str | None] = {}
    for mid, ns in order:
        for chunk in set(chunks_of[mid]):
            refs[chunk] += 1
            ns_of_chunk[chunk] = ns
    footprint: dict[str | None, int] = defaultdict(int)
    for chunk in refs:
        footprint[ns_of_chunk[chunk]] += size[chunk]
    out = GcPlan(footprint_before=sum(footprint.values()))
    alive = dict(order)

    def evict(mid: str, ns: str | None, why: str) -> None:
        del alive[mid]
        out.evict.append((mid, ns, why))
        for chunk in set(chunks_of[mid]):
            refs[chunk] -= 1
            if refs[chunk] == 0:
                footprint[ns] -= size[chunk]
                out.freed_bytes += size[chunk]

    for ns, limit in sorted(quotas.all_quotas(session=session).items()):
        for mid, owner in order:
            if footprint[ns] <= limit:
                break
            if owner == ns and mid in alive:
                evict(mid, ns, "quota")
    if budget_bytes is not None:
        for mid, ns in order:
            if sum(footprint.values()) <= budget_bytes:
                break
            if mid in alive:
                evict(mid, ns, "budget")
    out.footprint_after = sum(footprint.values())
    referenced = exists().where(mc.chunk == c.id)
    count, sealed = session.execute(
        select(func.count(), func.coalesce(func.sum(c.stored_size), 0)).where(
            ~referenced, c.condemned_at.is_(None), c.last_referenced_at < cutoff
        )
    ).one()
    out.reclaimable_chunks, out.reclaimable_bytes = int(count), int(sealed or 0)
    return out
