"""`kvpack quarantine list|show|drop`: peer answers held back, and why (kvpack/quarantine.py).

    kvpack quarantine list [--state refused] [--limit 20] [--json]
    kvpack quarantine show IMPORT_ID
    kvpack quarantine drop IMPORT_ID | --all-refused

`list` prints newest first, one import a line (the reason cut to fit), or with --json
one ImportRecord JSON object a line. `show` prints every field as JSON, and under
"objects" the size of each quarantined object (statement, planes) that is still in the
store, or "gone" (promoted imports keep only their row). It reads and opens each object
to measure and check it, so it holds a planes object in memory. `drop` deletes an
import's objects, then its row; POST /v1/admin/gc ages out old imports of any state.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from catalog.trust import STATES
from kvpack.commands import common
from kvpack.commands.common import UsageError

if TYPE_CHECKING:
    from kvpack.remote.quarantine import Quarantine

RAW = argparse.RawDescriptionHelpFormatter
REASON_WIDTH = 60
ALL = 1 << 30  # `drop --all-refused`: no limit


def register(sub: common.Subparsers) -> None:
    p = sub.add_parser("quarantine", help="list, show or drop quarantined peer imports",
                       description=__doc__, formatter_class=RAW)  # fmt: skip
    actions = p.add_subparsers(dest="action", required=True)
    storage = common.storage_parser()
    ls = actions.add_parser("list", parents=[storage], help="imports, newest first")
    ls.add_argument("--state", choices=STATES)
    ls.add_argument("--limit", type=common.positive_int, default=100, metavar="N",
                    help="at most N imports (default 100)")  # fmt: skip
    ls.add_argument("--json", action="store_true", help="one JSON object a line")
    show = actions.add_parser("show", parents=[storage],
                              help="one import as JSON, with its objects' sizes")  # fmt: skip
    show.add_argument("import_id")
    drop = actions.add_parser("drop", parents=[storage], help="delete an import's bytes and row")
    which = drop.add_mutually_exclusive_group(required=True)
    which.add_argument("import_id", nargs="?", help="the import to drop")
    which.add_argument("--all-refused", action="store_true", help="every refused import")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return common.run_action("kvpack quarantine", ACTIONS, args)


@contextmanager
def _quarantine(args: argparse.Namespace) -> Iterator[Quarantine]:
    from kvpack.remote.quarantine import Quarantine

    with common.vault(common.settings(args)) as vault:
        yield Quarantine(vault)


def _list(args: argparse.Namespace) -> int:
    with _quarantine(args) as q:
        records = q.list(state=args.state, limit=args.limit)
    if args.json:
        for r in records:
            print(json.dumps(r.to_json()))
        return 0
    print(f"{'import id':<32}  {'state':<8}  {'peer':<16}  {'producer':<22}  {'gen':>6}  "
          f"{'depth':>7}  {'created':<19}  reason")  # fmt: skip
    for r in records:
        print(f"{r.import_id:<32}  {r.state:<8}  {r.peer:<16}  {r.producer or '-':<22}  "
              f"{_num(r.generation):>6}  {_num(r.depth):>7}  {r.created_at:%Y-%m-%d %H:%M:%S}  "
              f"{_cut(r.reason or '')}")  # fmt: skip
    return 0


def _show(args: argparse.Namespace) -> int:
    from kvpack.remote.quarantine import NAMES

    with _quarantine(args) as q:
        record = q.show(_checked(args.import_id))
        if record is None:
            raise UsageError(f"no import {args.import_id!r}")
        doc = record.to_json()
        doc["objects"] = {name: _size(q, args.import_id, name) for name in NAMES}
    print(json.dumps(doc, indent=2))
    return 0


def _drop(args: argparse.Namespace) -> int:
    with _quarantine(args) as q:
        if args.all_refused:
            ids = [r.import_id for r in q.list(state="refused", limit=ALL)]
        elif q.show(_checked(args.import_id)) is None:
            raise UsageError(f"no import {args.import_id!r}")
        else:
            ids = [args.import_id]
        dropped = [i for i in ids if q.drop(i)]
    for import_id in dropped:
        print(f"dropped {import_id}")
    if args.all_refused:
        print(f"dropped {len(dropped)} refused import(s)")
    return 0


def _checked(import_id: str) -> str:
    from kvpack.remote.quarantine import BadImportId, check_import_id

    try:
        return check_import_id(import_id)
    except BadImportId as e:
        raise UsageError(str(e)) from None


def _size(q: Quarantine, import_id: str, name: str) -> int | str:
    """The opened size of a quarantined object, "gone", or why it cannot be opened."""
    from cas.errors import ObjectCorrupt, ObjectMissing, UnknownKey

    try:
        return len(q.get(import_id, name))
    except ObjectMissing:
        return "gone"
    except (ObjectCorrupt, UnknownKey) as e:  # fails its seal, or not sealed by us
        return f"unreadable: {e}"


def _num(n: int | None) -> str:
    return "-" if n is None else str(n)


def _cut(reason: str) -> str:
    reason = " ".join(reason.split())  # one line
    return reason if len(reason) <= REASON_WIDTH else reason[: REASON_WIDTH - 3] + "..."


ACTIONS = {"list": _list, "show": _show, "drop": _drop}
