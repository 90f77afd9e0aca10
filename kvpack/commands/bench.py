"""`kvpack bench`: cold / warm / miss / second legs per depth, each depth on a fresh
server, then two durable legs on a restarted server (same data dir and namespace, empty
resident tier; `--restarts N` restarts N times), then the baselines (the floor, a raw S3
GET, mlx-lm's load + one step) and the restore targets, met or missed
(kvpack/bench/serve.py, figures.py, probe.py).
Depths run up to the model's context, less the generated tokens; a depth beyond is an
error before anything starts.

Against the embedded default (a fresh data dir per depth) or a shared object store and
catalog (--store-url / --database-url, a unique namespace per attempt). Receipts go to
--receipts-dir (default ./receipts), one JSON file per attempt, never overwritten.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from kvpack.commands.common import Subparsers, add_storage_arguments, positive_int, storage_argv


def depths(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(d) for d in text.split(",") if d.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"depths must be integers like 256,512: {text!r}"
        ) from None
    if not out or any(d < 1 for d in out):
        raise argparse.ArgumentTypeError(f"depths must be positive integers: {text!r}")
    return out


def add_bench_arguments(
    p: argparse.ArgumentParser, *, model: str, default_depths: str, restarts: int = 1
) -> None:
    p.add_argument("--model", default=model, help="tiny | smollm2 | model dir | .gguf")
    p.add_argument("--depths", type=depths, default=depths(default_depths),
                   help=f"prompt depths in tokens (default {default_depths})")  # fmt: skip
    p.add_argument("--miss-depth", type=int, default=256, help="miss control prompt tokens")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per leg")
    p.add_argument("--restarts", type=positive_int, default=restarts,
                   help=f"restarted servers per depth, each running both durable legs; first "
                        f"/ second is judged on their median (default {restarts})")  # fmt: skip
    p.add_argument("--receipts-dir", type=Path, default=Path("receipts"))
    p.add_argument("--timeout-base", type=float, default=60.0, help="seconds per leg, plus...")
    p.add_argument("--timeout-per-token", type=float, default=0.5, help="...this per token")
    p.add_argument("--keep-data", action="store_true", help="keep the per-attempt data dirs")


def register(sub: Subparsers) -> None:
    p = sub.add_parser("bench", help="cold/warm/miss/durable bench, one fresh server per depth")
    add_bench_arguments(p, model="smollm2", default_depths="256,512,1024,2048")
    add_storage_arguments(p)  # --data-dir: the root of the per-attempt data dirs
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.models import ModelLoadError, load_model
    from kvpack.bench.serve import BadDepth, BenchError, Plan, check_depths, passed, run_bench

    try:
        loaded = load_model(args.model)  # prompts are cut from its tokenizer's encoding
    except ModelLoadError as e:
        print(f"kvpack bench: {e}")
        return 2
    try:
        depths = (*args.depths, args.miss_depth)
        check_depths(depths, context_length=loaded.context_length, max_tokens=args.max_tokens,
                     model=args.model)  # fmt: skip
    except BadDepth as e:
        print(f"kvpack bench: {e}")
        return 2
    tokenizer = loaded.tokenizer
    work_dir = Path(args.data_dir) if args.data_dir else Path(tempfile.mkdtemp(prefix="kvpack-"))
    serve_argv = [] if args.alignment is None else ["--alignment", str(args.alignment)]
    plan = Plan(
        model=args.model,
        served_as=loaded.name,  # a directory or .gguf is served under its name, not its path
        depths=args.depths,
        work_dir=work_dir,
        receipts_dir=args.receipts_dir,
        storage_argv=tuple(storage_argv(args, data_dir=None, namespace=None, alignment=None)),
        namespace=args.namespace or "bench",
        miss_depth=args.miss_depth,
        max_tokens=args.max_tokens,
        restarts=args.restarts,
        timeout_base_s=args.timeout_base,
        timeout_per_token_s=args.timeout_per_token,
        serve_argv=tuple(serve_argv),
    )
    print(f"kvpack bench: model {plan.model}, depths {list(plan.depths)}, "
          f"data under {work_dir}, receipts in {plan.receipts_dir}")  # fmt: skip
    try:
        receipts = run_bench(plan, tokenizer)
    except BenchError as e:
        print(f"kvpack bench: {e}")
        return 1
    finally:
        if not args.data_dir and not args.keep_data:
            shutil.rmtree(work_dir, ignore_errors=True)
    return 0 if passed(receipts) else 1
