"""What the vault holds, from the catalog alone: totals, per identity, per tenant.

Words (catalog/gc.py for footprint and quota):
- cut bytes: the plaintext bytes of every cut, each counted whole (what restores read).
- footprint: the plaintext bytes of the distinct chunks those cuts reference (what is
  kept). The dedup ratio is cut bytes / footprint: a conversation whose cuts share their
  leading blocks stores each block once.
- stored bytes: the sealed bytes of every chunk row, referenced or not (unreferenced
  ones wait out the grace period); pending: those no cut references.
- hits: durable and remote hits stamped on the cuts (manifests.hits); a cut evicted or
  forgotten takes its hits with it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import exists, func, select
from sqlalchemy.orm import Session

from catalog import quotas
from catalog.models import ChunkRow, IdentityRow, ManifestChunkRow, ManifestRow


@dataclass
class Usage:
    cuts: int = 0
    cut_bytes: int = 0
    footprint: int = 0
    chunks: int = 0  # distinct chunks referenced
    hits: int = 0
    last_hit: datetime | None = None

    @property
    def dedup_ratio(self) -> float | None:
        return self.cut_bytes / self.footprint if self.footprint else None


@dataclass
class IdentityUsage(Usage):
    identity: str = ""
    model: str | None = None
    namespace: str | None = None


@dataclass
class TenantUsage(Usage):
    namespace: str = ""
    quota: int | None = None


@dataclass
class VaultStats:
    total: Usage
    chunk_rows: int
    stored_bytes: int
    pending_chunks: int
    pending_bytes: int
    identities: list[IdentityUsage] = field(default_factory=list)
    tenants: list[TenantUsage] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        def doc(u: Usage) -> dict[str, Any]:
            d = asdict(u)
            d["dedup_ratio"] = u.dedup_ratio
            d["last_hit"] = u.last_hit.isoformat() if u.last_hit else None
            return d

        return {
            **doc(self.total),
            "chunk_rows": self.chunk_rows,
            "stored_bytes": self.stored_bytes,
            "pending_chunks": self.pending_chunks,
            "pending_bytes": self.pending_bytes,
            "identities": [doc(i) for i in self.identities],
            "tenants": [doc(t) for t in self.tenants],
        }


def vault_stats(*, session: Session) -> VaultStats:
    m, mc, c, i = ManifestRow, ManifestChunkRow, ChunkRow, IdentityRow
    cuts = session.execute(
        select(
            func.count(),
            func.coalesce(func.sum(m.bytes), 0),
            func.coalesce(func.sum(m.hits), 0),
            func.max(m.last_hit_at),
        )
    ).one()
    referenced = exists().where(mc.chunk == c.id)
    kept = session.execute(
        select(func.count(), func.coalesce(func.sum(c.size), 0)).where(referenced)
    ).one()
    rows = session.execute(select(func.count(), func.coalesce(func.sum(c.stored_size), 0))).one()
    pending = session.execute(
        select(func.count(), func.coalesce(func.sum(c.stored_size), 0)).where(~referenced)
    ).one()
    total = Usage(
        cuts=int(cuts[0]),
        cut_bytes=int(cuts[1]),
        hits=int(cuts[2]),
        last_hit=cuts[3],
        footprint=int(kept[1]),
        chunks=int(kept[0]),
    )

    # Per identity and per namespace: cut totals, then distinct chunk bytes.
    per_identity: dict[str, IdentityUsage] = {}
    for row in session.execute(
        select(
            i.digest,
            i.model,
            i.namespace,
            func.count(m.id),
            func.coalesce(func.sum(m.bytes), 0),
            func.coalesce(func.sum(m.hits), 0),
            func.max(m.last_hit_at),
        )
        .join(m, m.identity == i.digest)
        .group_by(i.digest, i.model, i.namespace)
    ):
        per_identity[row[0]] = IdentityUsage(
            identity=row[0],
            model=row[1],
            namespace=row[2],
            cuts=int(row[3]),
            cut_bytes=int(row[4]),
            hits=int(row[5]),
            last_hit=row[6],
        )
    pairs = (
        select(m.identity.label("identity"), mc.chunk.label("chunk"))
        .join(mc, mc.manifest == m.id)
        .distinct()
        .subquery()
    )
    for digest, count, size in session.execute(
        select(pairs.c.identity, func.count(), func.coalesce(func.sum(c.size), 0))
        .join(c, c.id == pairs.c.chunk)
        .group_by(pairs.c.identity)
    ):
        if digest in per_identity:
            per_identity[digest].footprint, per_identity[digest].chunks = int(size), int(count)

    limits = quotas.all_quotas(session=session)
    tenants: dict[str, TenantUsage] = {
        ns: TenantUsage(namespace=ns, quota=q) for ns, q in limits.items()
    }
    for u in per_identity.values():
        ns = u.namespace or "?"
        t = tenants.setdefault(ns, TenantUsage(namespace=ns, quota=limits.get(ns)))
        t.cuts += u.cuts
        t.cut_bytes += u.cut_bytes
        t.hits += u.hits
        # chunk ids are keyed per namespace: identity footprints of one tenant may share
        # chunks (two models never do), so the tenant's is measured on its own below
        if u.last_hit is not None and (t.last_hit is None or u.last_hit > t.last_hit):
            t.last_hit = u.last_hit
    ns_pairs = (
        select(i.namespace.label("namespace"), mc.chunk.label("chunk"))
        .select_from(m)
        .join(i, i.digest == m.identity)
        .join(mc, mc.manifest == m.id)
        .distinct()
        .subquery()
    )
    for ns, count, size in session.execute(
        select(ns_pairs.c.namespace, func.count(), func.coalesce(func.sum(c.size), 0))
        .join(c, c.id == ns_pairs.c.chunk)
        .group_by(ns_pairs.c.namespace)
    ):
        tenant = tenants.get(ns or "?")
        if tenant is not None:
            tenant.footprint, tenant.chunks = int(size), int(count)
    return VaultStats(
        total=total,
        chunk_rows=int(rows[0]),
        stored_bytes=int(rows[1] or 0),  # stored_size is nullable in the model, not here
        pending_chunks=int(pending[0]),
        pending_bytes=int(pending[1] or 0),
        identities=sorted(per_identity.values(), key=lambda u: (-u.footprint, u.identity)),
        tenants=sorted(tenants.values(), key=lambda t: t.namespace),
    )


@dataclass(frozen=True)
class CutRow:
    """One cut as `kvpack vault ls` shows it."""

    manifest_id: str
    identity: str
    model: str | None
    namespace: str | None
    depth: int
    bytes: int
    logits_witnessed: bool
    provenance: str
    created_at: datetime
    last_hit_at: datetime | None
    hits: int

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["created_at"] = self.created_at.isoformat()
        doc["last_hit_at"] = self.last_hit_at.isoformat() if self.last_hit_at else None
        return doc


def list_cuts(
    *,
    session: Session,
    namespace: str | None = None,
    identity: str | None = None,
    model: str | None = None,
    limit: int | None = None,
) -> list[CutRow]:
    """Cuts, by identity then depth; `identity` may be a hex prefix."""
    m, i = ManifestRow, IdentityRow
    stmt = select(
        m.id, m.identity, i.model, i.namespace, m.depth, m.bytes, m.logits_witnessed,
        m.provenance, m.created_at, m.last_hit_at, m.hits,
    ).outerjoin(i, i.digest == m.identity)  # fmt: skip
    if namespace is not None:
        stmt = stmt.where(i.namespace == namespace)
    if identity is not None:
        stmt = stmt.where(m.identity.startswith(identity.lower(), autoescape=True))
    if model is not None:
        stmt = stmt.where(i.model == model)
    stmt = stmt.order_by(i.namespace, m.identity, m.depth, m.id)
    if limit is not None:
        stmt = stmt.limit(limit)
    return [CutRow(*row) for row in session.execute(stmt)]
