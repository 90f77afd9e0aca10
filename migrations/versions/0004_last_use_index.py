"""an index on a cut's last use: recent cuts, GC's order and the least recently hit read
in its order (catalog/models.py LAST_USE)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_manifests_last_use",
        "manifests",
        [sa.text("coalesce(last_hit_at, created_at)"), "created_at", "id"],
    )


def downgrade() -> None:
    op.drop_index("ix_manifests_last_use", table_name="manifests")
