"""What the commands share: the storage flags, the settings they give, operator errors.

- storage flags: where the vault lives (`kvpack serve`'s --data-dir, --store-url,
  --database-url, --namespace, --alignment and the S3 flags, plus --config). Each flag is
  the Settings field of the same name (kvpack/config.py); a flag beats the environment,
  which beats the TOML file. A secret given as --s3-secret-key draws a warning: every
  user of the machine can read a command line.
- UsageError: bad operator input (an unknown peer, a malformed bundle file, an unknown
  import id, a bad setting). `run_action` prints its message on stderr and exits 2;
  nothing an operator typed ends in a traceback.
- catalog / vault: the catalog engine (schema brought to head first), or the whole Vault
  (catalog, store, keys, IO loop), opened for one command and closed after it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeAlias

from kvpack.config import ConfigError, Settings

if TYPE_CHECKING:  # alembic, the store and the vault load only when a command runs
    from sqlalchemy import Engine

    from kvpack.vault import Vault

# What `add_subparsers` returns: each command's register() adds its parser to it.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

STORE_TIMEOUT_S = 30.0
STORAGE_FLAGS = (  # each is the Settings field of the same name
    ("--data-dir", "data dir (default ~/.kvpack, or $KVPACK_DATA_DIR)", str),
    ("--store-url", "object store: file:///dir or s3://bucket/prefix", str),
    ("--database-url", "catalog SQLAlchemy URL (sqlite:/// or postgresql://)", str),
    ("--namespace", "tenant namespace (identity salt)", str),
    ("--alignment", "token alignment A (default 256)", int),
    ("--s3-endpoint", "S3 endpoint URL (MinIO, SeaweedFS, ...)", str),
    ("--s3-region", "S3 region (default us-east-1)", str),
    ("--s3-access-key", "S3 access key id", str),
    (
        "--s3-secret-key",
        "S3 secret key (visible in `ps`: prefer --s3-secret-key-file or $KVPACK_S3_SECRET_KEY)",
        str,
    ),
    ("--s3-secret-key-file", "a file holding the S3 secret key", str),
)


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


class UsageError(Exception):
    """Bad input from the operator; the command prints the message and exits 2."""


def field_of(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_storage_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that say where the vault lives."""
    p.add_argument("--config", help="TOML settings file (default: $KVPACK_CONFIG)")
    for flag, help_text, kind in STORAGE_FLAGS:
        p.add_argument(flag, help=help_text, type=kind)


def storage_parser(*, suppress: bool = False) -> argparse.ArgumentParser:
    """A parent parser holding the storage flags. `suppress`: an unset flag leaves no
    attribute, so it cannot overwrite the same flag given before the subcommand."""
    p = argparse.ArgumentParser(
        add_help=False, argument_default=argparse.SUPPRESS if suppress else None
    )
    add_storage_arguments(p)
    return p


def storage_argv(args: argparse.Namespace, **replace: object) -> list[str]:
    """The storage flags of `args` again, as a child process's argv (with `replace`)."""
    out = []
    for flag in ("--config", *(f for f, _, _ in STORAGE_FLAGS)):
        name = field_of(flag)
        value = replace.get(name, getattr(args, name, None))
        if value is not None:
            out += [flag, str(value)]
    return out


def settings_from_args(args: argparse.Namespace, **extra: Any) -> Settings:
    """The settings the storage flags give, with `extra` overrides (None: not given)."""
    if getattr(args, "s3_secret_key", None):
        warning = ("kvpack: warning: --s3-secret-key is visible to every user of this machine "
                   "(ps); use --s3-secret-key-file or $KVPACK_S3_SECRET_KEY")  # fmt: skip
        print(warning, file=sys.stderr)
    overrides = {field_of(f): getattr(args, field_of(f), None) for f, _, _ in STORAGE_FLAGS}
    return Settings.load(config_file=getattr(args, "config", None), **overrides, **extra)


def run_action(
    prog: str, actions: Mapping[str, Callable[[argparse.Namespace], int]], args: argparse.Namespace
) -> int:
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
    from migrations import migrate

    migrate(settings.database_url)
    db = settings.make_engine()
    try:
        yield db
    finally:
        db.dispose()


@contextmanager
def vault(settings: Settings) -> Iterator[Vault]:
    """The vault as `kvpack serve` opens it; closed on exit."""
    from kvpack.vault import Vault

    opened = Vault.open(settings, timeout_s=STORE_TIMEOUT_S)
    try:
        yield opened
    finally:
        opened.close()
