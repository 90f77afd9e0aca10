"""migrations — the Alembic environment and revisions for catalog/.

env.py takes its metadata from catalog.models and its URL from, in order: an
open connection in config.attributes["connection"], a URL in
config.attributes["database_url"], `sqlalchemy.url` in the ini, then
$KVPACK_DATABASE_URL. It imports only catalog/ (the engine comes from catalog/db.py),
so migrating never loads the MLX engine. Revisions import only `op` and `sa`.

    alembic_config(url)  -> a Config whose script_location is this package
    migrate(url)         -> upgrade to head (what `kvpack serve` runs on start)
    `kvpack db upgrade|downgrade|current|check` drives it (with kvpack's settings, the
    data-dir default included); so does `alembic -c migrations/alembic.ini ...`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from alembic import command
from alembic.config import Config

if TYPE_CHECKING:
    from sqlalchemy import Connection

HERE = Path(__file__).resolve().parent


def alembic_config(
    database_url: str | None = None, *, connection: Connection | None = None
) -> Config:
    """An Alembic Config for this package; URL or connection override the settings."""
    # stdout now, not Alembic's import-time default, so redirected output is honoured.
    config = Config(str(HERE / "alembic.ini"), stdout=sys.stdout)
    config.set_main_option("script_location", str(HERE))
    if database_url is not None:
        config.attributes["database_url"] = database_url
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def migrate(database_url: str, revision: str = "head") -> None:
    """Bring the catalog schema to `revision` (idempotent; a no-op when already there)."""
    config = alembic_config(database_url)
    config.attributes["configure_logging"] = False
    command.upgrade(config, revision)
