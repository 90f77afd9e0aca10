"""Catalog tables: the facts about what the vault holds.

Words (see docs/architecture.md):
- identities: one row per identity digest, with the components that made it, its
  tenant namespace and the name of the model it was loaded as (what `kvpack vault
  forget --model` and the per-identity stats go by; None where not recorded).
- manifests: one row per sealed cut: identity, depth, chain digest (the token
  chain link naming tokens[:depth]), aligned, logits witnessed, bytes,
  generation, producer, provenance, the idempotency key (UNIQUE: one history,
  one manifest), the manifest object's key, created and last-hit times, hits.
- manifest_chunks: the ordered chunk references of a manifest (ordinal, role).
- chunks: one row per stored chunk id: plaintext size, stored size, when its
  row was created (its first reservation), when a manifest or a publish last
  referenced it, and GC's claim (condemned_at/by) while its object is deleted.
- quarantine: one row per remote import (kvpack/remote.py): the peer, the identity
  asked for, the producer and generation the answer claimed, its state (pending,
  refused, promoted) and, when refused, why. Its bytes live under quarantine/<id>/.
- trusted_keys: producer public keys whose signatures a remote import accepts, each
  pinned by an operator or endorsed by a key already trusted (rotation).
- accepted_generations: the newest generation accepted per producer and identity
  (replay protection: an older or equal one is refused).
- api_keys: bearer keys, stored as SHA-256 of the secret, each with its role (tenant,
  peer, admin) and namespace; a revoked key keeps its row with revoked_at set.
- economics_ledger: paired restore/prefill timings.
- quotas: the byte quota of a tenant namespace (its footprint; catalog/gc.py evicts the
  tenant's own least recently hit cuts above it).
- leases: a named, expiring claim (catalog/lease.py): one collector of a fleet at a time.
- condemnations: a record per cut condemned because it failed verification, and why
  (catalog/condemn.py); the cut's own rows are gone, so it is never offered again.
- maintenance_runs: one row per GC or verify pass (who, when, outcome, a JSON summary):
  the fleet's last GC and last verify, whichever instance or command ran them.

Digests are stored as lowercase hex strings (identity, chain, chunk ids,
idempotency keys): portable across SQLite and PostgreSQL, and the same text as
the object keys. Times are timezone-aware UTC.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    func,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

HEX_DIGEST = 64
MANIFEST_ID = 32

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC in, timezone-aware UTC out (SQLite stores naive UTC text)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("catalog times must be timezone-aware")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class IdentityRow(Base):
    __tablename__ = "identities"

    digest: Mapped[str] = mapped_column(String(HEX_DIGEST), primary_key=True)
    components: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    namespace: Mapped[str | None] = mapped_column(String(255), index=True)
    model: Mapped[str | None] = mapped_column(String(255), index=True)


class ManifestRow(Base):
    __tablename__ = "manifests"
    __table_args__ = (
        Index("ix_manifests_identity_chain", "identity", "chain"),
        CheckConstraint("depth >= 1", name="depth_positive"),
        CheckConstraint("generation >= 0", name="generation_nonnegative"),
    )

    id: Mapped[str] = mapped_column(String(MANIFEST_ID), primary_key=True)
    identity: Mapped[str] = mapped_column(ForeignKey("identities.digest"))
    depth: Mapped[int] = mapped_column(BigInteger)
    chain: Mapped[str] = mapped_column(String(HEX_DIGEST))
    aligned: Mapped[bool]
    logits_witnessed: Mapped[bool]
    bytes: Mapped[int] = mapped_column(BigInteger)
    generation: Mapped[int] = mapped_column(BigInteger)
    producer: Mapped[str] = mapped_column(String(200))
    provenance: Mapped[str] = mapped_column(String(64))
    idempotency_key: Mapped[str] = mapped_column(String(HEX_DIGEST), unique=True)
    object_key: Mapped[str] = mapped_column(String(1024))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    last_hit_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    hits: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


# A cut's last use: its last hit, else its publication. Recent cuts (a restart's warm
# start), GC's eviction order and the least recently hit are read in its order, which
# the index keeps, so each reads the index from one end instead of sorting every
# manifest: on a 1M-manifest PostgreSQL catalog the 256 most recent took 0.38-0.59 s
# sorted, 4-7 ms from the index. Each hit's stamp updates the index too, off the
# response path (on the background worker).
LAST_USE = func.coalesce(ManifestRow.last_hit_at, ManifestRow.created_at)
# Ties broken by publication, then id: the order the index holds, which a query must
# order by (either way round) for the index to serve it.
LAST_USE_ORDER = (LAST_USE, ManifestRow.created_at, ManifestRow.id)
LAST_USE_INDEX = Index("ix_manifests_last_use", *LAST_USE_ORDER)


class ManifestChunkRow(Base):
    __tablename__ = "manifest_chunks"

    manifest: Mapped[str] = mapped_column(
        ForeignKey("manifests.id", ondelete="CASCADE"), primary_key=True
    )
    ordinal: Mapped[int] = mapped_column(Integer, primary_key=True)
    role: Mapped[str] = mapped_column(String(128))
    # No cascade: a chunk row cannot vanish under a manifest that references it.
    chunk: Mapped[str] = mapped_column(ForeignKey("chunks.id"), index=True)


class ChunkRow(Base):
    __tablename__ = "chunks"
    __table_args__ = (CheckConstraint("size >= 0", name="size_nonnegative"),)

    id: Mapped[str] = mapped_column(String(HEX_DIGEST), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    stored_size: Mapped[int | None] = mapped_column(BigInteger)
    first_stored_at: Mapped[datetime] = mapped_column(UTCDateTime)
    last_referenced_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    condemned_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    condemned_by: Mapped[str | None] = mapped_column(String(32))


class QuarantineRow(Base):
    __tablename__ = "quarantine"

    import_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    peer: Mapped[str] = mapped_column(String(255))
    identity: Mapped[str] = mapped_column(String(HEX_DIGEST), index=True)
    producer: Mapped[str | None] = mapped_column(String(200))
    generation: Mapped[int | None] = mapped_column(BigInteger)
    depth: Mapped[int | None] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str | None] = mapped_column(Text)
    manifest: Mapped[str | None] = mapped_column(String(MANIFEST_ID))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class TrustedKeyRow(Base):
    __tablename__ = "trusted_keys"

    producer: Mapped[str] = mapped_column(String(200), primary_key=True)
    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    public_key: Mapped[str] = mapped_column(String(HEX_DIGEST))
    endorsed_by: Mapped[str | None] = mapped_column(String(32))
    added_at: Mapped[datetime] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class AcceptedGenerationRow(Base):
    __tablename__ = "accepted_generations"
    __table_args__ = (CheckConstraint("generation >= 0", name="generation_nonnegative"),)

    producer: Mapped[str] = mapped_column(String(200), primary_key=True)
    identity: Mapped[str] = mapped_column(String(HEX_DIGEST), primary_key=True)
    generation: Mapped[int] = mapped_column(BigInteger)
    accepted_at: Mapped[datetime] = mapped_column(UTCDateTime)


class ApiKeyRow(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    secret_hash: Mapped[str] = mapped_column(String(HEX_DIGEST))
    role: Mapped[str] = mapped_column(String(16))
    namespace: Mapped[str] = mapped_column(String(255))
    label: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class EconomicsRow(Base):
    __tablename__ = "economics_ledger"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    identity: Mapped[str] = mapped_column(String(HEX_DIGEST), index=True)
    tier: Mapped[str] = mapped_column(String(16))
    restored_tokens: Mapped[int] = mapped_column(BigInteger)
    restore_seconds: Mapped[float] = mapped_column(Float)
    prefill_seconds: Mapped[float] = mapped_column(Float)
    measured_at: Mapped[datetime] = mapped_column(UTCDateTime)


class QuotaRow(Base):
    __tablename__ = "quotas"
    __table_args__ = (CheckConstraint("bytes >= 0", name="bytes_nonnegative"),)

    namespace: Mapped[str] = mapped_column(String(255), primary_key=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class LeaseRow(Base):
    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(255))
    acquired_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)


class CondemnationRow(Base):
    __tablename__ = "condemnations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    manifest: Mapped[str] = mapped_column(String(MANIFEST_ID), index=True)
    identity: Mapped[str] = mapped_column(String(HEX_DIGEST))
    depth: Mapped[int] = mapped_column(BigInteger)
    object_key: Mapped[str] = mapped_column(String(1024))
    kind: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str] = mapped_column(Text)
    chunk: Mapped[str | None] = mapped_column(String(HEX_DIGEST))
    condemned_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)


class MaintenanceRunRow(Base):
    __tablename__ = "maintenance_runs"
    __table_args__ = (Index("ix_maintenance_runs_kind_finished_at", "kind", "finished_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(16))
    holder: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime] = mapped_column(UTCDateTime)
    outcome: Mapped[str] = mapped_column(String(16))
    details: Mapped[dict[str, Any] | None] = mapped_column(JSON)


metadata = Base.metadata
