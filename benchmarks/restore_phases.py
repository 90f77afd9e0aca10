"""Where a durable restore's time goes: its phases, timed one by one.

    .venv/bin/python benchmarks/restore_phases.py [--model smollm2] [--depth 2048]
        [--rounds 6] [--mlx-cache-limit 2GiB]

Publishes the exact cut of a `depth`-token prompt (read_path.py's) into a fresh
embedded vault (local directory + SQLite, in a temporary folder), opens a new Service on
it (an empty resident tier), then restores the cut into a slot `rounds` times through
the durable tier's reader, timing each phase: find (the catalog query), manifest (open
and verify it), intake (allocate the shadow caches the cut becomes), fill (every chunk
read, opened and re-hashed straight into them) and commit (heads checked, the swap, the
caches evaluated). Prints the first round (fresh memory) and the median of the rest.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import engine  # noqa: F401 - first: it loads the fast BLAS before mlx.core

# isort: split
import mlx.core as mx
from read_path import options, publish_prompt, vault_settings  # beside this file

from kvpack.service.service import Service
from kvpack.tiers.durable import CutReader

PHASES = ("find", "manifest", "intake", "fill", "commit")


def main() -> None:
    opts = options(__doc__, rounds=6)
    with tempfile.TemporaryDirectory() as tmp:
        settings = vault_settings(tmp, opts)
        with_cut = Service.open(settings, model=opts.model)
        try:
            tokens = publish_prompt(with_cut, opts.depth)
        finally:
            with_cut.close()
        svc = Service.open(settings, model=opts.model)
        try:
            rounds, mb = restore(svc, tokens, opts.rounds)
        finally:
            svc.close()
    limit = opts.mlx_cache_limit or "-"
    print(f"model {opts.model}, depth {opts.depth}, {mb:.1f} MB, mlx_cache_limit {limit}")
    print(f"{'':12s}" + "".join(f"{p:>10s}" for p in (*PHASES, "total")) + "      MB/s")
    rest = [statistics.median(column) for column in zip(*rounds[1:], strict=True)]
    for name, row in (("first", rounds[0]), ("median rest", rest)):
        total = sum(row)
        cells = "".join(f"{1000 * s:8.1f}ms" for s in (*row, total))
        print(f"{name:12s}{cells}{mb / total:10.0f}")


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
