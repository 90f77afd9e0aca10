"""What the operator commands (`kvpack keys`, `kvpack peers`, `kvpack quarantine`) share.

- storage parser: the storage flags of `kvpack serve` (kvpack/commands/serve.py), as a
  parent for each subcommand, so every one finds the same data dir, catalog and store.
- UsageError: bad operator input (an unknown peer, a malformed bundle file, an unknown
  import id, a bad setting). `run_action` prints its message on stderr and exits 2;
  nothing an operator typed ends in a traceback.
- catalog / quarantine: the vault's catalog engine (schema brought to head first) and
  its Quarantine (catalog, object store, keyring, an IoLoop), opened for one command
  and closed after it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvpack.commands.serve import add_storage_arguments, s3_from_args, settings_from_args
from kvpack.config import ConfigError, Settings

if TYPE_CHECKING:  # alembic, the store and the quarantine load only when a command runs
    from sqlalchemy import Engine

    from kvpack.quarantine import Quarantine

STORE_TIMEOUT_S = 30.0


class UsageError(Exception):
    """Bad input from the operator; the command prints the message and exits 2."""


def storage_parser(*, suppress: bool = False) -> argparse.ArgumentParser:
    """A parent parser holding the storage flags. `suppress`: an unset flag leaves no
    attribute, so it cannot overwrite the same flag given before the subcommand."""
    p = argparse.ArgumentParser(
        add_help=False, argument_default=argparse.SUPPRESS if suppress else None
    )
    add_storage_arguments(p)
    return p


def run_action(prog: str, actions: dict[str, Callable[[argparse.Namespace], int]], args) -> int:
    try:
        return actions[args.action](args)
    except UsageError as e:
        print(f"{prog} {args.action}: {e}", file=sys.stderr)
        return 2


def settings(args: argparse.Namespace) -> Settings:
    try:
        return settings_from_args(args)
    except (ConfigError, ValueError) as e:
        raise UsageError(str(e)) from None


@contextmanager
def catalog(settings: Settings) -> Iterator[Engine]:
    """The catalog engine, its schema upgraded to head; disposed on exit."""
    from kvpack.durable import upgrade_catalog

    upgrade_catalog(settings.database_url)
    db = settings.make_engine()
    try:
        yield db
    finally:
        db.dispose()


@contextmanager
def quarantine(args: argparse.Namespace, settings: Settings) -> Iterator[Quarantine]:
    """The vault's Quarantine, as `kvpack serve` opens it; store, loop and engine closed
    on exit."""
    from cas.open import open_object_store
    from kvpack.durable import IoLoop
    from kvpack.quarantine import Quarantine

    try:
        store = open_object_store(settings.store_url, s3=s3_from_args(args, settings.store_url))
    except ValueError as e:
        raise UsageError(str(e)) from None
    io = IoLoop()
    try:
        with catalog(settings) as db:
            yield Quarantine(db=db, objects=store, keyring=settings.keyring(), io=io,
                             timeout_s=STORE_TIMEOUT_S)  # fmt: skip
    finally:
        try:
            io.run(store.aclose(), STORE_TIMEOUT_S)
        finally:
            io.close()
