"""migrations — the Alembic environment and revisions for catalog/.

env.py takes its metadata from catalog.models and its URL from, in order: an
open connection in config.attributes["connection"], a URL in
config.attributes["database_url"], `sqlalchemy.url` in the ini, then
kvpack.config.Settings. Revisions import only `op` and `sa`.

    alembic_config(url)  -> a Config whose script_location is this package
    `kvpack db upgrade|downgrade|current|check` drives it; so does
    `alembic -c migrations/alembic.ini ...`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from alembic.config import Config

HERE = Path(__file__).resolve().parent


def alembic_config(database_url: str | None = None, *, connection=None) -> Config:
    """An Alembic Config for this package; URL or connection override the settings."""
    # stdout now, not Alembic's import-time default, so redirected output is honoured.
    config = Config(str(HERE / "alembic.ini"), stdout=sys.stdout)
    config.set_main_option("script_location", str(HERE))
    if database_url is not None:
        config.attributes["database_url"] = database_url
    if connection is not None:
        config.attributes["connection"] = connection
    return config
