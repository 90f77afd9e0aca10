"""`kvpack keys generate|rotate|show|trust|untrust|list`: producer keys, ours and trusted.

    kvpack keys generate                 # this vault's producer key file, once
    kvpack keys show > bundle.json       # our public bundle, for a peer's operator
    kvpack keys trust bundle.json        # pin another producer's keys (- reads stdin)
    kvpack keys untrust PRODUCER [--key ID]
    kvpack keys list
    kvpack keys rotate

Words are catalog/signing.py's (producer, producer key, endorsement, bundle) and
catalog/trust.py's (trusted key). `trust` checks the bundle's endorsement chain before
pinning anything; `untrust` marks keys revoked, and a revoked key stays on record so no
endorsement brings it back. `rotate` edits the key file: a running `kvpack serve` keeps
the keys it loaded until restarted (and would overwrite the file at its own next
rotation), so rotate a running server through POST /v1/admin/keys/rotate instead.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy.orm import Session

from catalog import trust
from catalog.signing import Bundle, BundleInvalid, ProducerKeys
from kvpack.commands import common
from kvpack.commands.common import UsageError
from kvpack.config import producer_id

RAW = argparse.RawDescriptionHelpFormatter
PRODUCER_MAX = 200  # catalog column width (TrustedKeyRow.producer)
ROTATE_HELP = (
    "a new signing key endorsed by the current one; for a stopped vault only: a running "
    "server keeps its loaded keys until restart, so rotate it with POST /v1/admin/keys/rotate"
)


def register(sub: common.Subparsers) -> None:
    p = sub.add_parser("keys", help="this vault's producer keys and the keys it trusts",
                       description=__doc__, formatter_class=RAW)  # fmt: skip
    actions = p.add_subparsers(dest="action", required=True)
    storage = common.storage_parser()

    def add(name: str, help: str) -> argparse.ArgumentParser:
        return actions.add_parser(name, parents=[storage], help=help, description=help)

    add("generate", "create this vault's producer key file (refused if it exists)")
    add("rotate", ROTATE_HELP)
    add("show", "print the public bundle (JSON) that a peer's operator passes to `trust`")
    t = add("trust", "trust every key of a producer's bundle, after checking its endorsements")
    t.add_argument("bundle", metavar="FILE", help="bundle JSON (`kvpack keys show`); - for stdin")
    u = add("untrust", "revoke trust in a producer's keys, or in one of them")
    u.add_argument("producer")
    u.add_argument("--key", metavar="ID", help="revoke this key id only")
    add("list", "trusted keys, revoked ones too")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return common.run_action("kvpack keys", ACTIONS, args)


def _generate(args: argparse.Namespace) -> int:
    settings = common.settings(args)
    path = settings.producer_key_path
    if path.exists():
        raise UsageError(f"{path} exists already (`kvpack keys rotate` adds a key to it)")
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    try:  # never replaces a key file that appeared meanwhile (a server starting)
        keys = ProducerKeys.create(path, producer_id(settings.data_dir))
    except FileExistsError:
        raise UsageError(f"{path} exists already") from None
    print(f"producer {keys.producer}, key {keys.current_id} (in {path})")
    return 0


def _rotate(args: argparse.Namespace) -> int:
    path = common.settings(args).producer_key_path
    old = _load(path)
    new = old.rotate()
    new.save(path)
    print(f"producer {new.producer}: new signing key {new.current_id}, endorsed by "
          f"{old.current_id}")  # fmt: skip
    print(f"peers that trust {old.current_id} accept {new.current_id} through its "
          "endorsement (they read it from /v1/peer/keys)")  # fmt: skip
    print("a running `kvpack serve` signs with its loaded key until restarted")
    return 0


def _show(args: argparse.Namespace) -> int:
    print(_load(common.settings(args).producer_key_path).bundle().to_json())
    return 0


def _trust(args: argparse.Namespace) -> int:
    bundle = _read_bundle(args.bundle)
    with common.catalog(common.settings(args)) as db, Session(db) as s, s.begin():
        known = trust.known_key_ids(session=s, producer=bundle.producer)
        try:
            added = trust.trust_bundle(session=s, bundle=bundle, now=datetime.now(UTC))
        except trust.KeyConflict as e:
            raise UsageError(str(e)) from None
        revoked = {r.key_id for r in trust.all_trusted(session=s)
                   if r.producer == bundle.producer and r.revoked_at is not None}  # fmt: skip
    print(f"producer {bundle.producer}: trusted {', '.join(added) or 'no new key'}")
    ids = [k.id for k in bundle.keys]
    if already := [k for k in ids if k in known and k not in revoked]:
        print(f"already trusted: {', '.join(already)}")
    if stay := [k for k in ids if k in revoked]:
        print(f"revoked, and they stay revoked: {', '.join(stay)}")
    return 0


def _untrust(args: argparse.Namespace) -> int:
    with common.catalog(common.settings(args)) as db, Session(db) as s, s.begin():
        revoked = trust.revoke_keys(session=s, producer=args.producer, key_id=args.key,
                                    now=datetime.now(UTC))  # fmt: skip
    if not revoked:
        which = f"key {args.key} of " if args.key else "key of "
        raise UsageError(f"no trusted (unrevoked) {which}producer {args.producer!r}")
    print(f"producer {args.producer}: revoked {', '.join(revoked)}")
    return 0


def _list(args: argparse.Namespace) -> int:
    with common.catalog(common.settings(args)) as db, Session(db) as s:
        rows = trust.all_trusted(session=s)
    print(f"{'producer':<24}  {'key id':<16}  {'endorsed by':<16}  {'added':<19}  revoked")
    for r in rows:
        revoked = f"{r.revoked_at:%Y-%m-%d %H:%M:%S}" if r.revoked_at else "-"
        print(f"{r.producer:<24}  {r.key_id:<16}  {r.endorsed_by or '-':<16}  "
              f"{r.added_at:%Y-%m-%d %H:%M:%S}  {revoked}")  # fmt: skip
    return 0


def _load(path: Path) -> ProducerKeys:
    try:
        return ProducerKeys.load(path)
    except FileNotFoundError:
        raise UsageError(f"no producer key file at {path} (`kvpack keys generate`)") from None
    except ValueError as e:  # load names the file
        raise UsageError(str(e)) from None
    except (OSError, AttributeError) as e:
        raise UsageError(f"producer key file {path}: {e}") from None


def _read_bundle(source: str) -> Bundle:
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {source}: {e}") from None
    name = "stdin" if source == "-" else source
    try:
        bundle = Bundle.from_json(text)
    except BundleInvalid as e:
        raise UsageError(f"{name}: {e}") from None
    if len(bundle.producer) > PRODUCER_MAX:
        raise UsageError(f"{name}: producer name longer than {PRODUCER_MAX} characters")
    return bundle


ACTIONS = {
    "generate": _generate,
    "rotate": _rotate,
    "show": _show,
    "trust": _trust,
    "untrust": _untrust,
    "list": _list,
}
