"""Catalog queries: keyword-only functions that never commit.

The caller owns the transaction (`with Session(engine) as s, s.begin(): ...`),
so two writes can be atomic. Ids go in as values (catalog/ids.py) and are stored as
their hex; chunk rows are keyed by the chunk id's hex.

Words (see docs/architecture.md):
- cut: the state after exactly `depth` tokens, as the catalog knows it (Cut).
  An aligned cut can serve any longer prompt that shares its chain link; a
  non-aligned cut serves only the exact history it names.
- reservation: a publish's claim on chunk rows (last_referenced_at touched, row
  inserted if absent) committed before it uploads; GC leaves a chunk alone for a
  grace period after its last reference. See catalog/gc.py.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import (
    ColumnElement,
    CursorResult,
    Executable,
    and_,
    delete,
    exists,
    func,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from catalog.chain import TokenChain
from catalog.ids import ChainDigest, IdentityDigest, ManifestId
from catalog.models import LAST_USE_ORDER, ChunkRow, IdentityRow, ManifestChunkRow, ManifestRow


@dataclass(frozen=True, slots=True)
class Cut:
    """A sealed cut as its catalog row records it: everything a reader needs to open and
    check its manifest object without asking the catalog again."""

    manifest_id: ManifestId
    identity: IdentityDigest
    depth: int
    chain: ChainDigest
    aligned: bool
    logits_witnessed: bool
    bytes: int
    generation: int
    producer: str
    provenance: str
    object_key: str
    # (chunk id hex, plaintext size) of its parts in part order, where the lookup read
    # them with the row (find_deepest's with_chunks); else None.
    chunks: tuple[tuple[str, int], ...] | None = field(default=None, compare=False)

    @classmethod
    def of(cls, row: Any) -> Cut:
        return cls(
            manifest_id=ManifestId.from_hex(row.id),
            identity=IdentityDigest.from_hex(row.identity),
            depth=row.depth,
            chain=ChainDigest.from_hex(row.chain),
            aligned=row.aligned,
            logits_witnessed=row.logits_witnessed,
            bytes=row.bytes,
            generation=row.generation,
            producer=row.producer,
            provenance=row.provenance,
            object_key=row.object_key,
        )


@dataclass(frozen=True, slots=True)
class ChunkClaim:
    """A chunk row as a publish sees it: its incarnation and whether GC has condemned it."""

    first_stored_at: datetime
    condemned: bool


CUT_COLUMNS = (
    ManifestRow.id,
    ManifestRow.identity,
    ManifestRow.depth,
    ManifestRow.chain,
    ManifestRow.aligned,
    ManifestRow.logits_witnessed,
    ManifestRow.bytes,
    ManifestRow.generation,
    ManifestRow.producer,
    ManifestRow.provenance,
    ManifestRow.object_key,
)


def find_deepest(
    *,
    session: Session,
    identity: IdentityDigest,
    chain: TokenChain,
    deeper_than: int = 0,
    at_most: int | None = None,
    with_chunks: bool = False,
) -> Cut | None:
    """The deepest sealed cut that can serve this prompt under this identity, in one
    indexed query, with depth in (deeper_than, at_most]. `with_chunks`: the cut carries
    its chunk list (Cut.chunks), read in the same statement on PostgreSQL, so a reader
    can fetch its chunks without asking the catalog again.

    Every link of the chain is a candidate: aligned links name ancestors, the exact-end
    link names the prompt itself. A cut at the prompt's full depth serves only with
    witnessed final logits (invariant 3); below it only aligned cuts serve (a
    non-aligned cut names one exact history).

    On PostgreSQL the statement is one fixed text with the links as two array
    parameters: nothing is compiled or rendered per call, and psycopg prepares it on the
    server once it has run a few times (it is on every request's path).
    """
    links = _links(chain, deeper_than, at_most)
    if not links:
        return None
    if session.get_bind().dialect.name == "postgresql":
        parameters = find_deepest_parameters(identity=identity, chain=chain, links=links)
        statement = FIND_DEEPEST_WITH_CHUNKS_POSTGRES if with_chunks else FIND_DEEPEST_POSTGRES
        row = session.connection().exec_driver_sql(statement, parameters).one_or_none()
        listed = (row.chunks or []) if row is not None and with_chunks else None
    else:
        row, listed = _find_deepest_elsewhere(session, identity, chain, links), None
        if row is not None and with_chunks:  # a second statement
            listed = manifest_chunk_refs(session=session, manifest_id=ManifestId.from_hex(row.id))
    if row is None:
        return None
    cut = Cut.of(row)
    return cut if listed is None else replace(cut, chunks=tuple((c, n) for c, n in listed))


def _find_deepest_elsewhere(
    session: Session,
    identity: IdentityDigest,
    chain: TokenChain,
    links: list[tuple[int, ChainDigest]],
) -> Any:
    """find_deepest's row on a dialect other than PostgreSQL (SQLite), compiled per call."""
    m = ManifestRow
    return session.execute(
        select(*CUT_COLUMNS)
        .where(
            m.identity == identity.hex,
            m.chain.in_([digest.hex for _, digest in links]),  # served by (identity, chain)
            tuple_(m.chain, m.depth).in_([(digest.hex, d) for d, digest in links]),
            or_(
                and_(m.depth == chain.depth, m.logits_witnessed),
                and_(m.depth < chain.depth, m.aligned),
            ),
        )
        .order_by(m.depth.desc())
        .limit(1)
    ).one_or_none()


def _links(
    chain: TokenChain, deeper_than: int, at_most: int | None
) -> list[tuple[int, ChainDigest]]:
    return [
        (d, digest)
        for d, digest in chain.links
        if d > deeper_than and (at_most is None or d <= at_most)
    ]


def find_deepest_parameters(
    *, identity: IdentityDigest, chain: TokenChain, links: Sequence[tuple[int, ChainDigest]]
) -> dict[str, Any]:
    """FIND_DEEPEST_POSTGRES's parameters for these candidate links of `chain`."""
    return {
        "identity": identity.hex,
        "chains": [digest.hex for _, digest in links],
        "depths": [d for d, _ in links],
        "depth": chain.depth,
    }


# find_deepest's statement on PostgreSQL (psycopg's pyformat parameters): each link a
# probe of the (identity, chain) index, its depth checked against the link's.
FIND_DEEPEST_POSTGRES = f"""\
SELECT {", ".join(f"m.{c.key}" for c in CUT_COLUMNS)}
FROM unnest(CAST(%(chains)s AS varchar[]), CAST(%(depths)s AS bigint[])) AS link(chain, depth)
JOIN {ManifestRow.__tablename__} AS m
  ON m.identity = %(identity)s AND m.chain = link.chain AND m.depth = link.depth
WHERE (m.depth = %(depth)s AND m.logits_witnessed) OR (m.depth < %(depth)s AND m.aligned)
ORDER BY m.depth DESC
LIMIT 1"""

# The same, with the found cut's chunk list ([[chunk id hex, size], ...] in part order)
# from its manifest_chunks rows: computed for the one row found.
FIND_DEEPEST_WITH_CHUNKS_POSTGRES = f"""\
SELECT found.*, (
  SELECT json_agg(json_build_array(mc.chunk, c.size) ORDER BY mc.ordinal)
  FROM {ManifestChunkRow.__tablename__} AS mc
  JOIN {ChunkRow.__tablename__} AS c ON c.id = mc.chunk
  WHERE mc.manifest = found.id
) AS chunks
FROM ({FIND_DEEPEST_POSTGRES}) AS found"""


def get_cut(*, session: Session, manifest_id: ManifestId) -> Cut | None:
    row = session.execute(
        select(*CUT_COLUMNS).where(ManifestRow.id == manifest_id.hex)
    ).one_or_none()
    return None if row is None else Cut.of(row)


def touch_cut(*, session: Session, manifest_id: ManifestId, at: datetime | None = None) -> bool:
    """Mark a cut as just served and count the hit (GC evicts the least recently hit
    first). False if gone."""
    changed = affected_rows(
        session,
        update(ManifestRow)
        .where(ManifestRow.id == manifest_id.hex)
        .values(last_hit_at=at or _now(), hits=ManifestRow.hits + 1),
    )
    return changed == 1


def cut_by_idempotency_key(*, session: Session, key: bytes) -> Cut | None:
    row = session.execute(
        select(*CUT_COLUMNS).where(ManifestRow.idempotency_key == key.hex())
    ).one_or_none()
    return None if row is None else Cut.of(row)


def manifest_chunk_ids(*, session: Session, manifest_id: ManifestId) -> list[str]:
    """The chunk ids (hex) of a manifest, in part order."""
    return list(
        session.scalars(
            select(ManifestChunkRow.chunk)
            .where(ManifestChunkRow.manifest == manifest_id.hex)
            .order_by(ManifestChunkRow.ordinal)
        )
    )


def manifest_chunk_refs(*, session: Session, manifest_id: ManifestId) -> list[tuple[str, int]]:
    """(chunk id hex, plaintext size) of a manifest's parts, in part order: what a reader
    may fetch before the manifest object itself has arrived."""
    rows = session.execute(
        select(ManifestChunkRow.chunk, ChunkRow.size)
        .join(ChunkRow, ChunkRow.id == ManifestChunkRow.chunk)
        .where(ManifestChunkRow.manifest == manifest_id.hex)
        .order_by(ManifestChunkRow.ordinal)
    )
    return [(chunk, size) for chunk, size in rows]


# -- publish ---------------------------------------------------------------------------


def reserve_chunks(
    *, session: Session, chunks: Mapping[str, int], now: datetime, stored_sizes: Mapping[str, int]
) -> dict[str, ChunkClaim]:
    """Insert or touch a row per chunk id (hex -> size); condemned rows are left as they are.

    Rows are written in id order so concurrent publishers lock them in one order.
    """
    ids = sorted(chunks)
    if not ids:
        return {}
    stmt = dialect_insert(session, ChunkRow).values(
        [
            {
                "id": i,
                "size": chunks[i],
                "stored_size": stored_sizes.get(i),
                "first_stored_at": now,
                "last_referenced_at": now,
            }
            for i in ids
        ]
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=[ChunkRow.id],
        set_={"last_referenced_at": stmt.excluded.last_referenced_at},
        where=ChunkRow.condemned_at.is_(None),
    )
    session.execute(stmt)
    return claims(session=session, ids=ids)


def claims(*, session: Session, ids: Sequence[str], lock: bool = False) -> dict[str, ChunkClaim]:
    """The chunk rows that exist among `ids`; `lock` takes row locks (PostgreSQL) in id order."""
    stmt = (
        select(ChunkRow.id, ChunkRow.first_stored_at, ChunkRow.condemned_at)
        .where(ChunkRow.id.in_(sorted(set(ids))))
        .order_by(ChunkRow.id)
    )
    if lock:
        stmt = stmt.with_for_update()
    return {
        r.id: ChunkClaim(r.first_stored_at, r.condemned_at is not None)
        for r in session.execute(stmt)
    }


def stored_chunks(*, session: Session, ids: Sequence[str]) -> set[str]:
    """The ids among `ids` whose chunk is stored: a committed manifest references its row
    (so it was stored and verified first) and GC has not condemned it."""
    stmt = (
        select(ChunkRow.id)
        .join(ManifestChunkRow, ManifestChunkRow.chunk == ChunkRow.id)
        .where(ChunkRow.id.in_(sorted(set(ids))), ChunkRow.condemned_at.is_(None))
        .distinct()
    )
    return set(session.scalars(stmt))


def touch_chunks(*, session: Session, ids: Sequence[str], now: datetime) -> None:
    session.execute(
        update(ChunkRow).where(ChunkRow.id.in_(sorted(set(ids)))).values(last_referenced_at=now)
    )


def identity_components(*, session: Session, identity: IdentityDigest) -> dict[str, Any] | None:
    """The components recorded for an identity (None when unknown or not recorded)."""
    row = select(IdentityRow.components).where(IdentityRow.digest == identity.hex)
    return session.scalar(row)


def ensure_identity(
    *,
    session: Session,
    identity: IdentityDigest,
    components: Mapping[str, Any] | None,
    now: datetime,
    namespace: str | None = None,
    model: str | None = None,
) -> None:
    """The identity's row; a row recorded without a model name (or namespace) gets it."""
    stmt = dialect_insert(session, IdentityRow).values(
        digest=identity.hex,
        components=dict(components) if components else None,
        created_at=now,
        namespace=namespace,
        model=model,
    )
    i = IdentityRow
    missing = or_(
        and_(i.model.is_(None), stmt.excluded.model.is_not(None)),
        and_(i.namespace.is_(None), stmt.excluded.namespace.is_not(None)),
    )
    session.execute(
        stmt.on_conflict_do_update(
            index_elements=[i.digest],
            set_={
                "model": func.coalesce(i.model, stmt.excluded.model),
                "namespace": func.coalesce(i.namespace, stmt.excluded.namespace),
            },
            where=missing,
        )
    )


def insert_manifest(
    *, session: Session, row: Mapping[str, Any], chunks: Sequence[tuple[str, str]]
) -> bool:
    """Insert a manifest row and its (role, chunk id) rows; False if its idempotency key exists."""
    stmt = dialect_insert(session, ManifestRow).values(**row)
    stmt = stmt.on_conflict_do_nothing(index_elements=[ManifestRow.idempotency_key])
    inserted = session.execute(stmt.returning(ManifestRow.id)).scalar_one_or_none()
    if inserted is None:
        return False
    if chunks:
        session.execute(
            dialect_insert(session, ManifestChunkRow).values(
                [
                    {"manifest": row["id"], "ordinal": i, "role": role, "chunk": chunk}
                    for i, (role, chunk) in enumerate(chunks)
                ]
            )
        )
    return True


# -- GC --------------------------------------------------------------------------------


def referenced_bytes(*, session: Session, namespace: str | None = None) -> int:
    """Plaintext bytes of the distinct chunks that at least one manifest references (of
    `namespace`'s identities only, when given: chunk ids are keyed per namespace, so
    tenants never share a chunk and their footprints add up to the vault's)."""
    referenced = exists().where(ManifestChunkRow.chunk == ChunkRow.id)
    if namespace is not None:
        referenced = (
            exists()
            .where(ManifestChunkRow.chunk == ChunkRow.id)
            .where(ManifestChunkRow.manifest == ManifestRow.id)
            .where(ManifestRow.identity == IdentityRow.digest)
            .where(IdentityRow.namespace == namespace)
        )
    total = select(func.coalesce(func.sum(ChunkRow.size), 0)).where(referenced)
    return int(session.execute(total).scalar_one())


def exclusive_bytes(*, session: Session, manifest_id: ManifestId) -> int:
    """Plaintext bytes of the chunks only this manifest references (what evicting it frees)."""
    mine, other = ManifestChunkRow, ManifestChunkRow.__table__.alias("other")
    shared = exists().where(other.c.chunk == ChunkRow.id, other.c.manifest != manifest_id.hex)
    ids = select(mine.chunk).where(mine.manifest == manifest_id.hex)
    total = select(func.coalesce(func.sum(ChunkRow.size), 0)).where(ChunkRow.id.in_(ids), ~shared)
    return int(session.execute(total).scalar_one())


# Most recently used first: ix_manifests_last_use walked backwards.
_NEWEST = tuple(column.desc() for column in LAST_USE_ORDER)


def least_recently_hit(
    *, session: Session, limit: int, namespace: str | None = None
) -> list[tuple[ManifestId, str]]:
    """(manifest id, object key), least recently hit first (never hit: by creation); only
    cuts of `namespace`'s identities when given."""
    m = ManifestRow
    stmt = select(m.id, m.object_key)
    if namespace is not None:
        stmt = stmt.join(IdentityRow, IdentityRow.digest == m.identity).where(
            IdentityRow.namespace == namespace
        )
    rows = session.execute(stmt.order_by(*LAST_USE_ORDER).limit(limit))
    return [(ManifestId.from_hex(r.id), r.object_key) for r in rows]


def recent_cuts(*, session: Session, limit: int) -> list[Cut]:
    """The `limit` most recently used cuts (last hit, else creation), newest first: whose
    manifests a restarted server opens ahead (kvpack/service/warm.py)."""
    rows = session.execute(select(*CUT_COLUMNS).order_by(*_NEWEST).limit(limit))
    return [Cut.of(row) for row in rows]


def recent_chunks(
    *, session: Session, budget: int, batch: int = 64, until: float | None = None
) -> list[tuple[str, int]]:
    """(chunk id hex, stored bytes) of the most recently used cuts (last hit, else
    creation), newest cut first and each cut's in part order, every chunk once, until the
    next would take the total past `budget`; condemned chunks left out. What a restarted
    server reads back into memory first (kvpack/service/warm.py). Read `batch` cuts at a
    time, each batch from where the last one ended (an offset would walk the index again
    from the start), and none started after `until` (time.monotonic()): where the cuts
    share their chunks the budget may never fill, and every cut is read (28.8 s for a
    1M-manifest PostgreSQL catalog without chunk lists)."""
    mc, c = ManifestChunkRow, ChunkRow
    key = tuple_(*LAST_USE_ORDER)
    newest = select(*LAST_USE_ORDER).order_by(*_NEWEST).limit(batch)
    picked: dict[str, int] = {}
    total, after = 0, None
    while until is None or time.monotonic() < until:
        cuts = session.execute(newest if after is None else newest.where(key < after)).all()
        if not cuts:
            break
        after, ids = tuple(cuts[-1]), [cut.id for cut in cuts]
        rows = session.execute(
            select(mc.manifest, mc.chunk, func.coalesce(c.stored_size, c.size))
            .join(c, c.id == mc.chunk)
            .where(mc.manifest.in_(ids), c.condemned_at.is_(None))
            .order_by(mc.manifest, mc.ordinal)
        )
        by_cut: dict[str, list[tuple[str, int]]] = {}
        for cut, chunk, size in rows:
            by_cut.setdefault(cut, []).append((chunk, size))
        for cut in ids:
            for chunk, size in by_cut.get(cut, ()):
                if chunk in picked:
                    continue
                if total + size > budget:
                    return list(picked.items())
                picked[chunk] = size
                total += size
    return list(picked.items())


def delete_manifest(*, session: Session, manifest_id: ManifestId, now: datetime) -> str | None:
    """Delete a manifest's rows; its chunks become unreferenced now. Returns its object key."""
    mid = manifest_id.hex
    object_key = session.scalar(select(ManifestRow.object_key).where(ManifestRow.id == mid))
    if object_key is None:
        return None
    chunk_ids = manifest_chunk_ids(session=session, manifest_id=manifest_id)
    session.execute(delete(ManifestChunkRow).where(ManifestChunkRow.manifest == mid))
    session.execute(delete(ManifestRow).where(ManifestRow.id == mid))
    # The grace period counts from the last reference, so an eviction restarts it.
    touch_chunks(session=session, ids=chunk_ids, now=now)
    return object_key


def _collectible(cutoff: datetime) -> tuple[ColumnElement[bool], ...]:
    unreferenced = ~exists().where(ManifestChunkRow.chunk == ChunkRow.id)
    return (
        ChunkRow.condemned_at.is_(None),
        ChunkRow.last_referenced_at < cutoff,
        unreferenced,
    )


def collectible_chunks(*, session: Session, cutoff: datetime, limit: int) -> list[str]:
    """Chunk ids no manifest references and nothing touched since `cutoff`."""
    return list(
        session.scalars(
            select(ChunkRow.id).where(*_collectible(cutoff)).order_by(ChunkRow.id).limit(limit)
        )
    )


def condemn_chunks(
    *, session: Session, ids: Sequence[str], cutoff: datetime, now: datetime, run_id: str
) -> list[str]:
    """Claim chunks for deletion, re-checking every condition in the UPDATE itself.

    The rows are locked first, in a statement of their own: on PostgreSQL an UPDATE that
    waited for a publish's commit re-checks only the row itself, with its subqueries
    still on the snapshot taken before that commit, so its NOT EXISTS could miss the
    manifest_chunks rows the publish just committed (and with a short grace period the
    publish's touch can be older than the cutoff). Once the locks are ours, the UPDATE
    is a new statement on a new snapshot: it sees every reference committed before, and
    a publish committing after waits for our locks and then finds the rows condemned."""
    if not ids:
        return []
    session.execute(
        select(ChunkRow.id)
        .where(ChunkRow.id.in_(sorted(ids)), ChunkRow.condemned_at.is_(None))
        .order_by(ChunkRow.id)
        .with_for_update()
    ).all()
    session.execute(
        update(ChunkRow)
        .where(ChunkRow.id.in_(sorted(ids)), *_collectible(cutoff))
        .values(condemned_at=now, condemned_by=run_id)
    )
    return list(
        session.scalars(
            select(ChunkRow.id)
            .where(ChunkRow.id.in_(sorted(ids)), ChunkRow.condemned_by == run_id)
            .order_by(ChunkRow.id)
        )
    )


def adopt_abandoned(
    *, session: Session, cutoff: datetime, now: datetime, run_id: str, limit: int
) -> list[str]:
    """Take over chunks condemned before `cutoff` by a collector presumed dead."""
    ids = list(
        session.scalars(
            select(ChunkRow.id)
            .where(ChunkRow.condemned_at < cutoff)
            .order_by(ChunkRow.id)
            .limit(limit)
        )
    )
    if not ids:
        return []
    session.execute(
        update(ChunkRow)
        .where(ChunkRow.id.in_(ids), ChunkRow.condemned_at < cutoff)
        .values(condemned_at=now, condemned_by=run_id)
    )
    return list(
        session.scalars(
            select(ChunkRow.id).where(ChunkRow.id.in_(ids), ChunkRow.condemned_by == run_id)
        )
    )


def manifest_object_keys(*, session: Session) -> set[str]:
    """The object key of every manifest row (what an orphan sweep must leave alone)."""
    return set(session.scalars(select(ManifestRow.object_key)))


def chunk_ids(*, session: Session) -> set[str]:
    """Every chunk row's id (hex), condemned or not."""
    return set(session.scalars(select(ChunkRow.id)))


def claim_orphans(*, session: Session, ids: Sequence[str], now: datetime, run_id: str) -> list[str]:
    """Insert a condemned row of this run for each chunk id that has no row; the ids
    claimed (an id some publish reserved meanwhile keeps that publish's row)."""
    if not ids:
        return []
    stmt = dialect_insert(session, ChunkRow).values(
        [
            {
                "id": i,
                "size": 0,
                "first_stored_at": now,
                "last_referenced_at": now,
                "condemned_at": now,
                "condemned_by": run_id,
            }
            for i in sorted(ids)
        ]
    )
    session.execute(stmt.on_conflict_do_nothing(index_elements=[ChunkRow.id]))
    return list(
        session.scalars(
            select(ChunkRow.id)
            .where(ChunkRow.id.in_(sorted(ids)), ChunkRow.condemned_by == run_id)
            .order_by(ChunkRow.id)
        )
    )


def delete_condemned(*, session: Session, ids: Sequence[str], run_id: str) -> int:
    """Delete the rows of chunks this run condemned (after their objects are gone)."""
    if not ids:
        return 0
    return affected_rows(
        session,
        delete(ChunkRow).where(ChunkRow.id.in_(sorted(ids)), ChunkRow.condemned_by == run_id),
    )


def affected_rows(session: Session, statement: Executable) -> int:
    """Run an UPDATE or DELETE; the rows it matched. Session.execute is typed as returning
    a Result, but for these statements it is a CursorResult, which has the count."""
    return cast(CursorResult[Any], session.execute(statement)).rowcount


def dialect_insert(session: Session, table: Any) -> postgresql.Insert | sqlite.Insert:
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        return postgresql.insert(table)
    if dialect == "sqlite":
        return sqlite.insert(table)
    raise NotImplementedError(  # pragma: no cover - the catalog supports these two
        f"catalog upserts support sqlite and postgresql, not {dialect}"
    )


def _now() -> datetime:
    return datetime.now(UTC)
