"""`kvpack engine ...`: look at the compute layer directly (no vault involved).

Subcommands are registered in ENGINE_COMMANDS; add one by writing a
`register_<name>(engine_sub)` function and listing it there.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

import engine  # noqa: F401  (first: a fast BLAS must load before mlx.core, engine/blas.py)

if TYPE_CHECKING:
    from kvpack.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    p = sub.add_parser("engine", help="inspect models and the engine (identity, ...)")
    engine_sub = p.add_subparsers(dest="engine_command", required=True)
    for register_one in ENGINE_COMMANDS:
        register_one(engine_sub)


def register_identity(engine_sub: Subparsers) -> None:
    p = engine_sub.add_parser("identity", help="print a model's identity and its components")
    p.add_argument("--model", default="tiny", help="tiny | smollm2 | model directory | .gguf")
    p.add_argument("--alignment", type=int, default=256)
    p.add_argument("--namespace", default="default")
    p.add_argument("--adapter", default=None, help="mlx-lm adapter directory (LoRA)")
    p.add_argument("--hex", action="store_true", help="print only the identity digest")
    p.set_defaults(func=run_identity)


def run_identity(args: argparse.Namespace) -> int:
    from engine.models import ModelLoadError, load_model

    try:
        loaded = load_model(
            args.model, alignment=args.alignment, namespace=args.namespace, adapter=args.adapter
        )
    except (ModelLoadError, ValueError) as e:
        print(f"kvpack engine identity: {e}")
        return 2
    if args.hex:
        print(loaded.identity.hex)
    else:
        print(f"model {loaded.name} ({loaded.num_params:,} parameters)")
        print(loaded.identity.describe())
    return 0


def register_bench(engine_sub: Subparsers) -> None:
    p = engine_sub.add_parser(
        "bench", help="time prefill vs snapshot/restore (and mlx-lm save/load) per depth"
    )
    p.add_argument("--model", default="smollm2", help="tiny | smollm2 | model directory | .gguf")
    p.add_argument("--alignment", type=int, default=256)
    p.add_argument(
        "--depths", default="256,512,1024,2048", help="comma-separated prompt depths in tokens"
    )
    p.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from engine import bench

    depths = [int(d) for d in args.depths.split(",") if d.strip()]
    return bench.main(args.model, depths=depths, alignment=args.alignment)


def register_blas(engine_sub: Subparsers) -> None:
    p = engine_sub.add_parser("blas", help="which BLAS serves MLX's matmuls, and how fast")
    p.add_argument("--size", type=int, default=1024, help="square float32 matmul size")
    p.set_defaults(func=run_blas)


def run_blas(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from engine.blas import status

    st = status()
    print(f"blas: {st.fingerprint()} ({st.how}: {st.reason})")
    n = args.size
    a = mx.random.normal((n, n), key=mx.random.key(0))
    b = mx.random.normal((n, n), key=mx.random.key(1))
    mx.eval(a @ b)  # warm-up
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - t)
    print(f"matmul {n}x{n} float32: {2 * n**3 / best / 1e9:.1f} GFLOP/s ({best * 1e3:.1f} ms)")
    return 0


ENGINE_COMMANDS = [register_identity, register_bench, register_blas]
