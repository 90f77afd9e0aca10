"""The read path, before and after its readers: one cut of a model restored into a slot.

    .venv/bin/python benchmarks/read_path.py [--model smollm2] [--depth 2048] [--rounds 5]
        [--mlx-cache-limit 2GiB]

Publishes the exact cut of a `depth`-token prompt into a fresh embedded vault (local
directory + SQLite, in a temporary folder), then times, interleaved over `rounds`
rounds, four restores of that cut into a slot (each ends once the slot is committed and
its caches are evaluated) and prints each one's median:
- durable, planes: every chunk into one buffer (catalog load_cut), Planes, decoded and
  joined by Slot.restore (the durable tier before its reader);
- durable, reader: the manifest opened, the chunks read straight into the slot's intake
  (kvpack/tiers/durable.py's CutReader);
- resident, planes: the cut's frames decoded (digests checked) and installed (the
  resident tier before it held Snapshots);
- resident, snapshot: the Snapshot the resident tier holds, installed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import engine  # noqa: F401 - first: it loads the fast BLAS before mlx.core

# isort: split
import mlx.core as mx

from engine.format import encode
from engine.state import Planes
from kvpack.config import Settings
from kvpack.service.service import CompletionRequest, Service
from kvpack.tiers.base import Ask
from kvpack.tiers.durable import CutReader


def options(
    doc: str, *, rounds: int, more: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    """The read-path benchmarks' options (this one's and restore_phases.py's, which adds
    its own with `more`)."""
    args = argparse.ArgumentParser(description=doc.splitlines()[0])
    args.add_argument("--model", default="smollm2")
    args.add_argument("--depth", type=int, default=2048)
    args.add_argument("--rounds", type=int, default=rounds)
    args.add_argument("--mlx-cache-limit", help="the mlx_cache_limit setting (unset: MLX's)")
    if more is not None:
        more(args)
    return args.parse_args()


def vault_settings(
    tmp: str, opts: argparse.Namespace, env: dict[str, str] | None = None
) -> Settings:
    """A vault in `tmp` (embedded, unless `env` names a store), with the options' MLX
    cache limit."""
    limit = {"mlx_cache_limit": opts.mlx_cache_limit} if opts.mlx_cache_limit else {}
    return Settings.load(data_dir=Path(tmp) / "vault", env=env or {}, **limit)


def publish_prompt(svc: Service, depth: int) -> list[int]:
    """A seeded `depth`-token prompt, prefilled and its cuts published; its tokens."""
    vocab = svc.tenant("default").pool.vocab_size
    key = mx.random.key(7)
    tokens = [int(t) for t in mx.random.randint(0, vocab, (depth,), key=key).tolist()]
    svc.complete(CompletionRequest(tokens=tokens, max_tokens=1))
    assert svc.flush(900), "publication did not finish"
    return tokens


def main() -> None:
    opts = options(__doc__, rounds=5)
    with tempfile.TemporaryDirectory() as tmp:
        svc = Service.open(vault_settings(tmp, opts), model=opts.model)
        try:
            run(svc, opts.depth, opts.rounds)
        finally:
            svc.close()


def run(svc: Service, depth: int, rounds: int) -> None:
    tenant = svc.tenant("default")
    tokens = publish_prompt(svc, depth)
    scope, slot = tenant.scope, tenant.pool.slot(0)
    cut = svc.vault.find(scope, scope.chain(tokens))
    assert cut is not None and cut.depth == depth, "the exact cut was not published"
    held = svc.resident.find(Ask.of(scope, tokens))
    assert held is not None and held.depth == depth, "the cut is not resident"
    snapshot = held.handle.snapshot
    frames = encode(snapshot)

    def durable_planes() -> Planes:
        loaded = svc.vault.load(cut, scope)
        return Planes(loaded.manifest.layout, tuple(loaded.parts))

    legs: dict[str, Callable[[], object]] = {  # each gives the cut Slot.restore installs
        "durable, planes": durable_planes,
        "durable, reader": lambda: CutReader.open(svc.vault, cut, scope),
        "resident, planes": lambda: Planes(frames.layout, frames.parts),
        "resident, snapshot": lambda: snapshot,
    }
    seconds: dict[str, list[float]] = {name: [] for name in legs}
    for _ in range(rounds):
        for name, leg in legs.items():
            slot.reset()
            started = time.perf_counter()
            slot.restore(leg(), prompt=tokens)  # type: ignore[arg-type]
            mx.eval([a for c in slot.state.cache for a in (c.keys, c.values)])
            seconds[name].append(time.perf_counter() - started)
    mib = cut.bytes / 2**20
    print(f"model {svc.loaded.name}, depth {depth}, {mib:.1f} MiB, median of {rounds} rounds")
    for name, values in seconds.items():
        print(f"  {name:20s} {1000 * statistics.median(values):8.1f} ms")


if __name__ == "__main__":
    main()
