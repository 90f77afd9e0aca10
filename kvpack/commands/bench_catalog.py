"""`kvpack bench-catalog`: find_deepest on PostgreSQL with a catalog of realistic size,
timed end to end from Python through the server's own path (logic in
kvpack/bench/catalog.py). It creates a fresh database on the server --database-url
names, fills it, measures, prints the table, writes a receipt and drops the database
(--keep keeps it). Exits 1 when a lookup answered the wrong cut."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvpack.commands.common import positive_int

if TYPE_CHECKING:
    from kvpack.commands.common import Subparsers

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/postgres"  # the local server


def register(sub: Subparsers) -> None:
    p = sub.add_parser("bench-catalog", help="time find_deepest on PostgreSQL (1M manifests)")
    p.add_argument("--database-url", default=DEFAULT_URL,
                   help=f"the PostgreSQL server to create the bench database on "
                        f"(default {DEFAULT_URL})")  # fmt: skip
    p.add_argument("--manifests", type=positive_int, default=1_000_000,
                   help="manifest rows to fill (default 1,000,000)")  # fmt: skip
    p.add_argument("--samples", type=positive_int, default=2000, help="timed lookups per leg")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the bench database afterwards")
    p.add_argument("--chunk-lists", action="store_true",
                   help="fill every cut's chunk list and look up as from a remote store, "
                        "which reads the found cut's list with it")  # fmt: skip
    p.add_argument("--receipts-dir", type=Path, default=Path("receipts"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvpack.bench.catalog import CatalogBenchOptions, format_table, save
    from kvpack.bench.catalog import run as bench

    opts = CatalogBenchOptions(
        database_url=args.database_url,
        manifests=args.manifests,
        samples=args.samples,
        seed=args.seed,
        keep=args.keep,
        chunk_lists=args.chunk_lists,
    )
    try:
        receipt = bench(opts, log=lambda m: print(m, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"kvpack bench-catalog: {e}", file=sys.stderr)
        return 2
    print(format_table(receipt))
    print(f"receipt: {save(receipt, args.receipts_dir)}")
    return 0 if receipt["valid"] else 1
