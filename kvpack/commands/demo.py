"""`kvpack demo` (`make demo`): the bench on the demo model against the embedded default.

A temporary data dir (SQLite + a local object directory), a fresh server per depth,
cold / warm / miss / second legs, two durable legs on each of three restarted servers (so
first / second after a restart is judged on three pairs), the baselines, and the tables
(kvpack/commands/bench.py). Receipts go to ./receipts.
"""

from __future__ import annotations

import argparse
import tempfile

from kvpack.commands import bench
from kvpack.commands.common import STORAGE_FLAGS, Subparsers, field_of


def register(sub: Subparsers) -> None:
    p = sub.add_parser("demo", help="run the cold/warm/miss/durable bench on the demo model")
    bench.add_bench_arguments(p, model="smollm2", default_depths="256,512,1024", restarts=3)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvpack-demo-") as data_dir:
        unset = {field_of(flag): None for flag, _, _ in STORAGE_FLAGS}
        full = argparse.Namespace(**vars(args), **unset | {"config": None, "data_dir": data_dir})
        return bench.run(full)
