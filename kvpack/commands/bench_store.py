"""`kvpack bench-store`: put/get throughput of each object-store backend beside raw
boto3, the machine's BLAKE3 and AEAD speed, and the floor of the same chunks with the
fraction of it each get reaches (logic in kvpack/bench/store.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpack.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    p = sub.add_parser("bench-store", help="measure chunk-store put/get per backend (MiB/s)")
    p.add_argument("--total-mib", type=int, default=256, help="bytes moved per leg (MiB)")
    p.add_argument("--chunk-mib", type=int, default=8, help="chunk size (MiB), 4-8 typical")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--backends", default="local,s3", help="comma list of local, s3")
    p.add_argument("--s3-endpoint", help="S3 endpoint; default: start a local SeaweedFS")
    p.add_argument("--s3-bucket", default="kvpack-bench")
    p.add_argument("--s3-access-key", default=os.environ.get("AWS_ACCESS_KEY_ID"))
    p.add_argument("--s3-secret-key", default=os.environ.get("AWS_SECRET_ACCESS_KEY"))
    p.add_argument("--work-dir", type=Path, help="where the local store and SeaweedFS write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cas.s3 import S3Config
    from kvpack.bench.store import BenchOptions, format_table
    from kvpack.bench.store import run as bench

    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    unknown = set(backends) - {"local", "s3"}
    if unknown:
        print(f"error: unknown backend(s) {sorted(unknown)}; use local, s3", file=sys.stderr)
        return 2
    s3 = None
    if args.s3_endpoint:
        s3 = S3Config(
            bucket=args.s3_bucket,
            endpoint_url=args.s3_endpoint,
            access_key=args.s3_access_key,
            secret_key=args.s3_secret_key,
        )
    opts = BenchOptions(
        total_mib=args.total_mib,
        chunk_mib=args.chunk_mib,
        concurrency=args.concurrency,
        backends=backends,
        s3=s3,
        work_dir=args.work_dir,
    )
    rows, floor = bench(opts, log=lambda m: print(m, file=sys.stderr))
    print(format_table(rows, floor, opts))
    return 0 if all(r.valid for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    """Standalone: `python -m kvpack.commands.bench_store [options]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="kvpack")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench-store", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
