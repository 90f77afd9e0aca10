"""Alembic environment: metadata from catalog.models, the URL as migrations/__init__ says."""

from __future__ import annotations

import os
import warnings
from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection

from catalog.db import make_engine, normalize_database_url
from catalog.models import LAST_USE_INDEX, UTCDateTime
from catalog.models import metadata as target_metadata

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logging", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def database_url() -> str:
    url = (
        config.attributes.get("database_url")
        or config.get_main_option("sqlalchemy.url")
        or os.environ.get("KVPACK_DATABASE_URL")
    )
    if not url:
        raise RuntimeError(
            "no catalog URL: set KVPACK_DATABASE_URL, or run `kvpack db upgrade`, which "
            "finds the catalog as `kvpack serve` does"
        )
    return normalize_database_url(url)


def render_item(type_: str, obj: object, autogen_context: object) -> str | bool:
    # Revisions import only op and sa: our UTC decorator is a plain timezone-aware DateTime.
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things in place; batch mode copies the table.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        render_item=render_item,
    )
    with context.begin_transaction(), warnings.catch_warnings():
        if connection.dialect.name == "sqlite":
            # SQLite's reflection cannot read an expression index back, so neither
            # SQLAlchemy nor autogenerate can compare it (PostgreSQL's can, and does).
            unreadable = f".*expression-based index '?{LAST_USE_INDEX.name}"
            warnings.filterwarnings("ignore", message=unreadable)
        context.run_migrations()


def run_offline() -> None:
    url = database_url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        configure(connection)
        return
    engine = make_engine(database_url(), timeout_s=None)  # a migration may run long
    try:
        with engine.connect() as connection:
            configure(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
