"""initial catalog: identities, manifests, manifest_chunks, chunks, quarantine, economics_ledger

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _utc() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "identities",
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("components", sa.JSON(), nullable=True),
        sa.Column("created_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_identities")),
    )
    op.create_table(
        "chunks",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("stored_size", sa.BigInteger(), nullable=True),
        sa.Column("first_stored_at", _utc(), nullable=False),
        sa.Column("last_referenced_at", _utc(), nullable=False),
        sa.Column("condemned_at", _utc(), nullable=True),
        sa.Column("condemned_by", sa.String(length=32), nullable=True),
        sa.CheckConstraint("size >= 0", name=op.f("ck_chunks_size_nonnegative")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_chunks")),
    )
    op.create_index(op.f("ix_chunks_last_referenced_at"), "chunks", ["last_referenced_at"])
    op.create_table(
        "manifests",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("identity", sa.String(length=64), nullable=False),
        sa.Column("depth", sa.BigInteger(), nullable=False),
        sa.Column("chain", sa.String(length=64), nullable=False),
        sa.Column("aligned", sa.Boolean(), nullable=False),
        sa.Column("logits_witnessed", sa.Boolean(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("producer", sa.String(length=200), nullable=False),
        sa.Column("provenance", sa.String(length=64), nullable=False),
        sa.Column("idempotency_key", sa.String(length=64), nullable=False),
        sa.Column("object_key", sa.String(length=1024), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.Column("last_hit_at", _utc(), nullable=True),
        sa.CheckConstraint("depth >= 1", name=op.f("ck_manifests_depth_positive")),
        sa.CheckConstraint("generation >= 0", name=op.f("ck_manifests_generation_nonnegative")),
        sa.ForeignKeyConstraint(
            ["identity"], ["identities.digest"], name=op.f("fk_manifests_identity_identities")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_manifests")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_manifests_idempotency_key")),
    )
    op.create_index("ix_manifests_identity_chain", "manifests", ["identity", "chain"])
    op.create_table(
        "manifest_chunks",
        sa.Column("manifest", sa.String(length=32), nullable=False),
        sa.Column("ordinal", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(length=128), nullable=False),
        sa.Column("chunk", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["chunk"], ["chunks.id"], name=op.f("fk_manifest_chunks_chunk_chunks")
        ),
        sa.ForeignKeyConstraint(
            ["manifest"],
            ["manifests.id"],
            name=op.f("fk_manifest_chunks_manifest_manifests"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("manifest", "ordinal", name=op.f("pk_manifest_chunks")),
    )
    op.create_index(op.f("ix_manifest_chunks_chunk"), "manifest_chunks", ["chunk"])
    op.create_table(
        "quarantine",
        sa.Column("import_id", sa.String(length=64), nullable=False),
        sa.Column("peer", sa.String(length=255), nullable=False),
        sa.Column("identity", sa.String(length=64), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("import_id", name=op.f("pk_quarantine")),
    )
    op.create_index(op.f("ix_quarantine_identity"), "quarantine", ["identity"])
    op.create_table(
        "economics_ledger",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("identity", sa.String(length=64), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("restored_tokens", sa.BigInteger(), nullable=False),
        sa.Column("restore_seconds", sa.Float(), nullable=False),
        sa.Column("prefill_seconds", sa.Float(), nullable=False),
        sa.Column("measured_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_economics_ledger")),
    )
    op.create_index(op.f("ix_economics_ledger_identity"), "economics_ledger", ["identity"])


def downgrade() -> None:
    op.drop_index(op.f("ix_economics_ledger_identity"), table_name="economics_ledger")
    op.drop_table("economics_ledger")
    op.drop_index(op.f("ix_quarantine_identity"), table_name="quarantine")
    op.drop_table("quarantine")
    op.drop_index(op.f("ix_manifest_chunks_chunk"), table_name="manifest_chunks")
    op.drop_table("manifest_chunks")
    op.drop_index("ix_manifests_identity_chain", table_name="manifests")
    op.drop_table("manifests")
    op.drop_index(op.f("ix_chunks_last_referenced_at"), table_name="chunks")
    op.drop_table("chunks")
    op.drop_table("identities")
