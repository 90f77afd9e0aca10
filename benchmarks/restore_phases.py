"""Where a durable restore's time goes: its phases, timed one by one.

    .venv/bin/python benchmarks/restore_phases.py [--model smollm2] [--depth 2048]
        [--rounds 6] [--mlx-cache-limit 2GiB]

Publishes the exact cut of a `depth`-token prompt into a fresh embedded vault (local
directory + SQLite, in a temporary folder), opens a new Service on it (an empty resident
tier), then restores the cut into a slot `rounds` times through the durable tier's
reader, timing each phase: find (the catalog query), manifest (open and verify it),
intake (allocate the shadow caches the cut becomes), fill (every chunk read, opened and
re-hashed straight into them) and commit (heads checked, the swap, the caches
evaluated). Prints the first round (fresh memory) and the median of the rest.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from kvpack.config import Settings
from kvpack.service.service import CompletionRequest, Service
from kvpack.tiers.durable import CutReader

PHASES = ("find", "manifest", "intake", "fill", "commit")


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--model", default="smollm2")
    args.add_argument("--depth", type=int, default=2048)
    args.add_argument("--rounds", type=int, default=6)
    args.add_argument("--mlx-cache-limit", help="the mlx_cache_limit setting (unset: MLX's)")
    opts = args.parse_args()
    limit = {"mlx_cache_limit": opts.mlx_cache_limit} if opts.mlx_cache_limit else {}
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings.load(data_dir=Path(tmp) / "vault", env={}, **limit)
        with_cut = Service.open(settings, model=opts.model)
        try:
            tokens = publish(with_cut, opts.depth)
        finally:
            with_cut.close()
        svc = Service.open(settings, model=opts.model)
        try:
            rounds, mb = restore(svc, tokens, opts.rounds)
        finally:
            svc.close()
    print(f"model {opts.model}, depth {opts.depth}, {mb:.1f} MB, mlx_cache_limit {limit or '-'}")
    print(f"{'':12s}" + "".join(f"{p:>10s}" for p in (*PHASES, "total")) + "      MB/s")
    rest = [statistics.median(column) for column in zip(*rounds[1:], strict=True)]
    for name, row in (("first", rounds[0]), ("median rest", rest)):
        total = sum(row)
        cells = "".join(f"{1000 * s:8.1f}ms" for s in (*row, total))
        print(f"{name:12s}{cells}{mb / total:10.0f}")


def publish(svc: Service, depth: int) -> list[int]:
    vocab = svc.tenant("default").pool.vocab_size
    key = mx.random.key(7)
    tokens = [int(t) for t in mx.random.randint(0, vocab, (depth,), key=key).tolist()]
    svc.complete(CompletionRequest(tokens=tokens, max_tokens=1))
    assert svc.flush(900), "publication did not finish"
    return tokens


def restore(svc: Service, tokens: list[int], rounds: int) -> tuple[list[list[float]], float]:
    tenant = svc.tenant("default")
    scope, slot = tenant.scope, tenant.pool.slot(0)
    out, mb = [], 0.0
    for _ in range(rounds):
        slot.reset()
        t = [time.perf_counter()]
        cut = svc.vault.find(scope, scope.chain(tokens))
        assert cut is not None and cut.depth == len(tokens), "the exact cut was not published"
        t.append(time.perf_counter())
        reader = CutReader.open(svc.vault, cut, scope)
        t.append(time.perf_counter())
        intake = slot.intake(reader.layout)
        t.append(time.perf_counter())
        reader.fill(intake)
        t.append(time.perf_counter())
        slot.restore(intake, prompt=tokens)
        mx.eval([a for c in slot.state.cache for a in (c.keys, c.values)])
        t.append(time.perf_counter())
        out.append([b - a for a, b in zip(t, t[1:], strict=False)])
        mb = cut.bytes / 1e6
    return out, mb


if __name__ == "__main__":
    main()
