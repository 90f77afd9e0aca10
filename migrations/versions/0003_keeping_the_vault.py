"""keeping the vault: identity namespace and model, cut hits, quotas, leases,
condemnations, maintenance runs

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-10

Identities recorded before this revision get their namespace from their components (the
namespace is one of them); their model name was never recorded and stays NULL.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _utc() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("identities") as batch:
        batch.add_column(sa.Column("namespace", sa.String(length=255), nullable=True))
        batch.add_column(sa.Column("model", sa.String(length=255), nullable=True))
        batch.create_index(batch.f("ix_identities_namespace"), ["namespace"])
        batch.create_index(batch.f("ix_identities_model"), ["model"])
    with op.batch_alter_table("manifests") as batch:
        batch.add_column(sa.Column("hits", sa.BigInteger(), server_default="0", nullable=False))
    _backfill_namespaces()
    op.create_table(
        "quotas",
        sa.Column("namespace", sa.String(length=255), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", _utc(), nullable=False),
        sa.CheckConstraint("bytes >= 0", name=op.f("ck_quotas_bytes_nonnegative")),
        sa.PrimaryKeyConstraint("namespace", name=op.f("pk_quotas")),
    )
    op.create_table(
        "leases",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("acquired_at", _utc(), nullable=False),
        sa.Column("expires_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_leases")),
    )
    op.create_table(
        "condemnations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("manifest", sa.String(length=32), nullable=False),
        sa.Column("identity", sa.String(length=64), nullable=False),
        sa.Column("depth", sa.BigInteger(), nullable=False),
        sa.Column("object_key", sa.String(length=1024), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("chunk", sa.String(length=64), nullable=True),
        sa.Column("condemned_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_condemnations")),
    )
    op.create_index(op.f("ix_condemnations_manifest"), "condemnations", ["manifest"])
    op.create_index(op.f("ix_condemnations_condemned_at"), "condemnations", ["condemned_at"])
    op.create_table(
        "maintenance_runs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("started_at", _utc(), nullable=False),
        sa.Column("finished_at", _utc(), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("details", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_maintenance_runs")),
    )
    op.create_index(
        "ix_maintenance_runs_kind_finished_at", "maintenance_runs", ["kind", "finished_at"]
    )


def _backfill_namespaces() -> None:
    identities = sa.table(
        "identities",
        sa.column("digest", sa.String),
        sa.column("components", sa.JSON),
        sa.column("namespace", sa.String),
    )
    conn = op.get_bind()
    rows = conn.execute(sa.select(identities.c.digest, identities.c.components)).all()
    for digest, components in rows:
        namespace = (components or {}).get("namespace")
        if isinstance(namespace, str):
            conn.execute(
                identities.update().where(identities.c.digest == digest).values(namespace=namespace)
            )


def downgrade() -> None:
    op.drop_index("ix_maintenance_runs_kind_finished_at", table_name="maintenance_runs")
    op.drop_table("maintenance_runs")
    op.drop_index(op.f("ix_condemnations_condemned_at"), table_name="condemnations")
    op.drop_index(op.f("ix_condemnations_manifest"), table_name="condemnations")
    op.drop_table("condemnations")
    op.drop_table("leases")
    op.drop_table("quotas")
    with op.batch_alter_table("manifests") as batch:
        batch.drop_column("hits")
    with op.batch_alter_table("identities") as batch:
        batch.drop_index(batch.f("ix_identities_model"))
        batch.drop_index(batch.f("ix_identities_namespace"))
        batch.drop_column("model")
        batch.drop_column("namespace")
