"""`kvpack bench-publication`: publication on vs off on the same prompt, in one run.

Per depth, cold requests in fresh tenant namespaces on a Service with publication on and
one with it off (logic and words in kvpack/bench/publication.py): cold prefill seconds,
decode tokens/s, their ratios, CPU seconds, chunks sealed vs new to the store. Against a
fresh embedded vault in a temporary data dir unless the storage flags name one. The
receipt goes to --receipts-dir (default ./receipts), never overwritten. Exit 0 when every
depth is valid and meets the target, 1 otherwise.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from kvpack.commands.common import (
    Subparsers,
    add_storage_arguments,
    positive_int,
    settings_from_args,
)


def depth_list(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated positive integers ("2048,7936")."""
    out = tuple(positive_int(d.strip()) for d in text.split(",") if d.strip())
    if not out:
        raise argparse.ArgumentTypeError(f"no depths in {text!r}")
    return out


def register(sub: Subparsers) -> None:
    help_text = "publication on vs off: prefill, decode, CPU, chunks sealed"
    p = sub.add_parser("bench-publication", help=help_text)
    p.add_argument("--model", default="smollm2", help="tiny | smollm2 | model dir | .gguf")
    p.add_argument("--depths", type=depth_list, default=(2048,),
                   help="prompt depths in tokens (default 2048; e.g. 2048,7936)")  # fmt: skip
    p.add_argument("--max-tokens", type=positive_int, default=128, help="tokens decoded per leg")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="pairs of legs (on and off) per depth; medians are reported")  # fmt: skip
    p.add_argument("--receipts-dir", type=Path, default=Path("receipts"))
    add_storage_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.models import ModelLoadError
    from kvpack.bench.publication import Plan, format_table
    from kvpack.bench.publication import run as bench
    from kvpack.config import ConfigError

    scratch = None
    if not args.data_dir and not args.store_url and not args.config:
        scratch = args.data_dir = tempfile.mkdtemp(prefix="kvpack-publication-")
    try:
        settings = settings_from_args(args)
        plan = Plan(settings=settings, model=args.model, depths=args.depths,
                    max_tokens=args.max_tokens, rounds=args.rounds,
                    receipts_dir=args.receipts_dir)  # fmt: skip
        receipt = bench(plan, log=lambda m: print(m, file=sys.stderr, flush=True))
    except (ConfigError, ModelLoadError) as e:
        print(f"kvpack bench-publication: {e}")
        return 2
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(format_table(receipt))
    return 0 if all(d["target_met"] for d in receipt["depths"]) else 1
