"""`kvpack peers [list [--check]] | add | remove`: the vaults this one imports from.

    kvpack peers add east https://east.example:8000 --api-key-env EAST_PEER_KEY
    kvpack peers list --check
    kvpack peers remove east

A peer (kvpack/peers.py) is a name, the base URL of its `kvpack serve` and the peer API
key it issued to us; the key comes from an environment variable or a file, so it never
appears on a command line, and no command prints it. `list --check` calls each peer's
GET /v1/peer/keys and says, per key of its bundle, whether our trust store accepts it:
yes, through an endorsement by a trusted key (a rotation), revoked, or no (`kvpack keys
trust` pins a producer). A running `kvpack serve` reads the peers file when it starts.
"""

from __future__ import annotations

import argparse
import os
import urllib.error
import urllib.request
from pathlib import Path

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from catalog.access import parse_token
from catalog.signing import Bundle, BundleInvalid
from kvpack.commands import common
from kvpack.commands.common import UsageError
from kvpack.remote.peers import Peer, load_peers, save_peers

RAW = argparse.RawDescriptionHelpFormatter
CHECK_TIMEOUT_S = 5.0
MAX_BUNDLE_BYTES = 1 << 20


def register(sub: common.Subparsers) -> None:
    p = sub.add_parser("peers", parents=[common.storage_parser()],
                       help="list, add or remove the peers this vault imports from",
                       description=__doc__, formatter_class=RAW)  # fmt: skip
    p.set_defaults(func=run, check=False)
    actions = p.add_subparsers(dest="action")
    # Suppressed defaults: flags given before the action are not reset by the action's.
    storage = common.storage_parser(suppress=True)
    ls = actions.add_parser("list", parents=[storage], help="the peers (never their keys)")
    check = f"call each peer's /v1/peer/keys ({CHECK_TIMEOUT_S:g} s timeout)"
    ls.add_argument("--check", action="store_true", help=check)
    add = actions.add_parser("add", parents=[storage], help="add a peer")
    add.add_argument("name", help="1-63 letters, digits, '.', '_', '-'")
    add.add_argument("url", help="base URL of the peer's `kvpack serve` (http or https)")
    key = add.add_mutually_exclusive_group(required=True)
    key.add_argument("--api-key-env", metavar="VAR",
                     help="environment variable holding the peer key it issued to us")  # fmt: skip
    key.add_argument("--api-key-file", metavar="FILE", help="file holding that key")
    rm = actions.add_parser("remove", parents=[storage], help="remove a peer")
    rm.add_argument("name")


def run(args: argparse.Namespace) -> int:
    args.action = args.action or "list"  # `kvpack peers` alone lists
    return common.run_action("kvpack peers", ACTIONS, args)


def _load(path: Path) -> list[Peer]:
    try:
        return load_peers(path)
    except ValueError as e:  # names the file
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"peers file {path}: {e}") from None


def _list(args: argparse.Namespace) -> int:
    settings = common.settings(args)
    peers = _load(settings.peers_path)
    if not peers:
        print(f"no peers (in {settings.peers_path}); add one with `kvpack peers add`")
        return 0
    width = max(len(p.name) for p in peers)
    if not args.check:
        for peer in peers:
            print(f"{peer.name:<{width}}  {peer.url}")
        return 0
    with common.catalog(settings) as db:
        for peer in peers:
            print(f"{peer.name:<{width}}  {peer.url}  {_check(peer, db)}", flush=True)
    return 0


def _check(peer: Peer, db: Engine) -> str:
    """One line: the peer's producer and whether we trust each of its keys, or the error."""
    from catalog import trust

    request = urllib.request.Request(f"{peer.url}/v1/peer/keys")
    # Unredirected: a redirect to another host must not carry our key there.
    request.add_unredirected_header("Authorization", f"Bearer {peer.api_key}")
    try:
        with urllib.request.urlopen(request, timeout=CHECK_TIMEOUT_S) as response:
            body = response.read(MAX_BUNDLE_BYTES)
    except urllib.error.HTTPError as e:
        return f"error: HTTP {e.code} {e.reason}"
    except urllib.error.URLError as e:
        return f"error: unreachable ({e.reason})"
    except TimeoutError:
        return f"error: timed out after {CHECK_TIMEOUT_S:g} s"
    except OSError as e:
        return f"error: {e}"
    try:
        bundle = Bundle.from_json(body)
    except BundleInvalid as e:
        return f"error: bad bundle: {e}"
    with Session(db) as s:
        trusted = trust.trusted_keys(session=s, producer=bundle.producer)
        known = trust.known_key_ids(session=s, producer=bundle.producer)
    endorsed = {k.id for k in bundle.endorsed_from(trusted) if k.id not in known}

    def verdict(kid: str, public: bytes) -> str:
        if trusted.get(kid) == public:
            return "yes"
        if kid in endorsed:
            return "yes (endorsed)"
        return "revoked" if kid in known else "no"

    keys = ", ".join(f"{k.id} trusted: {verdict(k.id, k.public)}" for k in bundle.keys)
    return f"ok, producer {bundle.producer}, keys [{keys}]"


def _add(args: argparse.Namespace) -> int:
    settings = common.settings(args)
    peers = _load(settings.peers_path)
    if any(p.name == args.name for p in peers):
        raise UsageError(f"a peer named {args.name!r} exists already (`kvpack peers remove`)")
    api_key = _api_key(args)
    if parse_token(api_key) is None:
        raise UsageError("the peer key is not a kvpack API key (kvp_...)")
    try:
        peer = Peer(args.name, args.url.rstrip("/"), api_key)
    except ValueError as e:
        raise UsageError(str(e)) from None
    save_peers(settings.peers_path, [*peers, peer])
    print(f"added peer {peer.name} ({peer.url}) to {settings.peers_path}")
    return 0


def _api_key(args: argparse.Namespace) -> str:
    if args.api_key_env is not None:
        key = os.environ.get(args.api_key_env, "").strip()
        if not key:
            raise UsageError(f"environment variable {args.api_key_env} is unset or empty")
        return key
    try:
        key = Path(args.api_key_file).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {args.api_key_file}: {e}") from None
    if not key:
        raise UsageError(f"{args.api_key_file} is empty")
    return key


def _remove(args: argparse.Namespace) -> int:
    settings = common.settings(args)
    peers = _load(settings.peers_path)
    kept = [p for p in peers if p.name != args.name]
    if len(kept) == len(peers):
        raise UsageError(f"no peer named {args.name!r}")
    save_peers(settings.peers_path, kept)
    print(f"removed peer {args.name}")
    return 0


ACTIONS = {"list": _list, "add": _add, "remove": _remove}
