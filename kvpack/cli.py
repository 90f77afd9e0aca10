"""`kvpack` command line. Each subcommand lives in kvpack/commands/<name>.py."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = (
    "db",
    "bench_store",
    "bench_publication",
    "bench_catalog",
    "engine",
    "serve",
    "bench",
    "demo",
    "api_keys",
    "keys",
    "peers",
    "quarantine",
    "vault",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpack", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"kvpack.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
