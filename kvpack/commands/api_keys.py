"""`kvpack api-keys create|list|revoke`: the bearer keys `kvpack serve` accepts.

    kvpack api-keys create --role tenant --namespace acme [--label "acme prod"]
    kvpack api-keys list [--namespace acme]
    kvpack api-keys revoke <key id>

`create` prints the token alone on stdout (so `$(kvpack api-keys create ...)` captures
it) and says on stderr that it is shown only once: the catalog keeps a hash of it. A
revocation holds from the server's next request on. The catalog is found as `kvpack
serve` finds it (the same storage flags, environment and config file); the keys' roles
and namespaces are catalog/access.py's.
"""

from __future__ import annotations

import argparse
import sys

from sqlalchemy.orm import Session

from catalog.access import ROLES, check_key, create_key, list_keys, parse_token, revoke_key
from kvpack.commands.common import Subparsers, add_storage_arguments, settings_from_args
from kvpack.config import ConfigError


def register(sub: Subparsers) -> None:
    storage = argparse.ArgumentParser(add_help=False)
    add_storage_arguments(storage)  # --namespace: create's key namespace, list's filter
    p = sub.add_parser("api-keys", help="create, list or revoke API keys (bearer tokens)")
    actions = p.add_subparsers(dest="keys_action", required=True)
    create = actions.add_parser("create", parents=[storage],
                                help="a new key; its token is printed once")  # fmt: skip
    create.add_argument("--role", required=True, choices=ROLES)
    create.add_argument("--label", help="a note for `list` (who holds the key)")
    actions.add_parser("list", parents=[storage], help="every key, revoked ones too")
    revoke = actions.add_parser("revoke", parents=[storage], help="revoke a key by its id")
    revoke.add_argument("key_id")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from migrations import migrate  # alembic: only when a command runs

    try:
        settings = settings_from_args(args)
    except (ConfigError, ValueError) as e:
        print(f"kvpack api-keys: {e}", file=sys.stderr)
        return 2
    migrate(settings.database_url)
    db = settings.make_engine()
    try:
        with Session(db) as session, session.begin():
            return ACTIONS[args.keys_action](session, args)
    finally:
        db.dispose()


def _create(session: Session, args: argparse.Namespace) -> int:
    if args.namespace is None:
        print("kvpack api-keys create: --namespace is required (* for every namespace, "
              "peer and admin keys only)", file=sys.stderr)  # fmt: skip
        return 2
    try:
        check_key(role=args.role, namespace=args.namespace, label=args.label)
    except ValueError as e:
        print(f"kvpack api-keys create: {e}", file=sys.stderr)
        return 2
    token = create_key(session=session, role=args.role, namespace=args.namespace,
                       label=args.label)  # fmt: skip
    parsed = parse_token(token)
    assert parsed is not None, "create_key returns a well-formed token"
    key_id, _ = parsed
    print(f"kvpack api-keys: created {args.role} key {key_id} for namespace "
          f"{args.namespace}", file=sys.stderr)  # fmt: skip
    print(token)
    print("kvpack api-keys: this token is shown only once; the catalog keeps only its hash",
          file=sys.stderr)  # fmt: skip
    return 0


def _list(session: Session, args: argparse.Namespace) -> int:
    keys = list_keys(session=session, namespace=args.namespace)
    print(f"{'id':<16}  {'role':<6}  {'namespace':<20}  {'created':<19}  {'revoked':<19}  label")
    for k in keys:
        revoked = k.revoked_at.strftime("%Y-%m-%d %H:%M:%S") if k.revoked_at else "-"
        print(f"{k.key_id:<16}  {k.role:<6}  {k.namespace:<20}  "
              f"{k.created_at:%Y-%m-%d %H:%M:%S}  {revoked:<19}  {k.label or ''}")  # fmt: skip
    return 0


def _revoke(session: Session, args: argparse.Namespace) -> int:
    if not revoke_key(session=session, key_id=args.key_id):
        print(f"kvpack api-keys revoke: no key {args.key_id!r}", file=sys.stderr)
        return 1
    print(f"kvpack api-keys: revoked key {args.key_id}")
    return 0


ACTIONS = {"create": _create, "list": _list, "revoke": _revoke}
