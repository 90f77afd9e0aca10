"""remote tier and trust: quarantine columns, trusted_keys, accepted_generations, api_keys

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

The quarantine table of 0001 was never written (no remote tier existed), so it is
rebuilt rather than altered.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def _utc() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.drop_index(op.f("ix_quarantine_identity"), table_name="quarantine")
    op.drop_table("quarantine")
    op.create_table(
        "quarantine",
        sa.Column("import_id", sa.String(length=32), nullable=False),
        sa.Column("peer", sa.String(length=255), nullable=False),
        sa.Column("identity", sa.String(length=64), nullable=False),
        sa.Column("producer", sa.String(length=200), nullable=True),
        sa.Column("generation", sa.BigInteger(), nullable=True),
        sa.Column("depth", sa.BigInteger(), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("manifest", sa.String(length=32), nullable=True),
        sa.Column("created_at", _utc(), nullable=False),
        sa.Column("updated_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("import_id", name=op.f("pk_quarantine")),
    )
    op.create_index(op.f("ix_quarantine_identity"), "quarantine", ["identity"])
    op.create_index(op.f("ix_quarantine_state"), "quarantine", ["state"])
    op.create_table(
        "trusted_keys",
        sa.Column("producer", sa.String(length=200), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=False),
        sa.Column("public_key", sa.String(length=64), nullable=False),
        sa.Column("endorsed_by", sa.String(length=32), nullable=True),
        sa.Column("added_at", _utc(), nullable=False),
        sa.Column("revoked_at", _utc(), nullable=True),
        sa.PrimaryKeyConstraint("producer", "key_id", name=op.f("pk_trusted_keys")),
    )
    op.create_table(
        "accepted_generations",
        sa.Column("producer", sa.String(length=200), nullable=False),
        sa.Column("identity", sa.String(length=64), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("accepted_at", _utc(), nullable=False),
        sa.CheckConstraint(
            "generation >= 0", name=op.f("ck_accepted_generations_generation_nonnegative")
        ),
        sa.PrimaryKeyConstraint("producer", "identity", name=op.f("pk_accepted_generations")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("namespace", sa.String(length=255), nullable=False),
        sa.Column("label", sa.String(length=255), nullable=True),
        sa.Column("created_at", _utc(), nullable=False),
        sa.Column("revoked_at", _utc(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
    )


def downgrade() -> None:
    op.drop_table("api_keys")
    op.drop_table("accepted_generations")
    op.drop_table("trusted_keys")
    op.drop_index(op.f("ix_quarantine_state"), table_name="quarantine")
    op.drop_index(op.f("ix_quarantine_identity"), table_name="quarantine")
    op.drop_table("quarantine")
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
