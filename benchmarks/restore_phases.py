"""Where a durable restore's time goes: its phases, timed one by one.

    .venv/bin/python benchmarks/restore_phases.py [--model smollm2] [--depth 2048]
        [--rounds 6] [--mlx-cache-limit 2GiB] [--s3] [--latency-ms 20]
        [--database-url postgresql://postgres@127.0.0.1:5432/phases]

Publishes the exact cut of a `depth`-token prompt (read_path.py's) into a fresh vault in
a temporary folder (SQLite, or the empty database --database-url names, which the run
migrates; a local directory or, with --s3, a SeaweedFS started here), opens a new
Service on it (an empty resident tier), then restores the cut into a slot `rounds` times
through the durable tier's reader, timing each phase: find (the catalog query; from S3
it brings the cut's chunk list), manifest (open and verify it, the chunks already on
their way), intake (allocate the shadow caches the cut becomes), fill (every chunk read,
opened and re-hashed straight into them) and commit (heads checked, the swap, the
caches evaluated). --latency-ms adds that much to every read of the restoring service's
store, as a store across a network would (a wrapper around the real store). Prints the
first round (fresh memory) and the median of the rest, then, inside the fill: the
intake's allocation of the shadow's buffers (on this thread, beside the reads), and the
CPU seconds this process and, with --s3, the SeaweedFS server used while it ran (the
server's in clock ticks, 10 ms here): beside the fill's wall time, whether the cores
were the bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import engine  # noqa: F401 - first: it loads the fast BLAS before mlx.core

# isort: split
import mlx.core as mx
from read_path import options, publish_prompt, vault_settings  # beside this file

from cas.s3 import ensure_bucket
from kvpack.bench.seaweedfs import start_seaweedfs
from kvpack.service.service import Service
from kvpack.tiers.durable import CutReader
from kvpack.vault import Vault

PHASES = ("find", "manifest", "intake", "fill", "commit")
INSIDE = ("alloc", "cpu self", "cpu store")  # inside the fill (see the module words)


def main() -> None:
    opts = options(__doc__, rounds=6, more=_more)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        env = {"KVPACK_DATABASE_URL": opts.database_url} if opts.database_url else {}
        if opts.s3:
            server = stack.enter_context(start_seaweedfs(Path(tmp) / "s3"))
            env |= server.s3.env() | {"KVPACK_STORE_URL": "s3://phases/vault"}
        settings = vault_settings(tmp, opts, env)
        if opts.s3:
            ensure_bucket(settings.s3_config())
        with_cut = Service.open(settings, model=opts.model)
        try:
            tokens = publish_prompt(with_cut, opts.depth)
        finally:
            with_cut.close()
        vault = Vault.open(settings, objects=Delayed(settings.open_store(), opts.latency_ms / 1000))
        svc = Service.open(settings, model=opts.model, vault=vault)
        store_cpu = _process_cpu(server.process.pid) if opts.s3 else None
        try:
            rounds, inside, mb = restore(svc, tokens, opts.rounds, store_cpu)
        finally:
            svc.close()
            vault.close()
    limit = opts.mlx_cache_limit or "-"
    store = "SeaweedFS" if opts.s3 else "local dir"
    catalog = opts.database_url.split(":")[0] if opts.database_url else "sqlite"
    print(f"model {opts.model}, depth {opts.depth}, {mb:.1f} MB, {store} + {catalog}, "
          f"+{opts.latency_ms:g} ms a read, mlx_cache_limit {limit}")  # fmt: skip
    print(f"{'':12s}" + "".join(f"{p:>10s}" for p in (*PHASES, "total")) + "      MB/s")
    rest = [statistics.median(column) for column in zip(*rounds[1:], strict=True)]
    for name, row in (("first", rounds[0]), ("median rest", rest)):
        total = sum(row)
        cells = "".join(f"{1000 * s:8.1f}ms" for s in (*row, total))
        print(f"{name:12s}{cells}{mb / total:10.0f}")
    print("inside the fill:")
    print(f"{'':12s}" + "".join(f"{p:>10s}" for p in INSIDE))
    later = [
        None if None in column else statistics.median(column)  # type: ignore[type-var]
        for column in zip(*inside[1:], strict=True)
    ]
    for name, row in (("first", inside[0]), ("median rest", later)):
        cells = "".join("         -" if s is None else f"{1000 * s:8.1f}ms" for s in row)
        print(f"{name:12s}{cells}")


def _more(args: Any) -> None:
    args.add_argument("--s3", action="store_true", help="a SeaweedFS started here")
    args.add_argument("--latency-ms", type=float, default=0.0, help="added to every read")
    args.add_argument("--database-url", help="an empty catalog database (default: SQLite)")


class Delayed:
    """The real store, every read (get, get_into, stat) `delay` seconds later."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay = inner, delay
        self.remote = inner.remote or delay > 0  # a delayed store is across a network
        self.maps = getattr(inner, "maps", False) and delay == 0  # a mapping has no delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def get(self, key: str) -> bytes:
        await asyncio.sleep(self.delay)
        return await self.inner.get(key)

    async def get_into(self, key: str, out: memoryview, *landed: Any) -> int:
        await asyncio.sleep(self.delay)
        return await self.inner.get_into(key, out, *landed)

    async def stat(self, key: str) -> Any:
        await asyncio.sleep(self.delay)
        return await self.inner.stat(key)


def restore(
    svc: Service, tokens: list[int], rounds: int, store_cpu: Callable[[], float] | None
) -> tuple[list[list[float]], list[list[float | None]], float]:
    tenant = svc.tenant("default")
    scope, slot = tenant.scope, tenant.pool.slot(0)
    out, inside, mb = [], [], 0.0
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
        cpu, store = time.process_time(), store_cpu() if store_cpu else 0.0
        with _timed(intake, "destinations") as alloc:
            reader.fill(intake)
        t.append(time.perf_counter())
        cpu, store = time.process_time() - cpu, store_cpu() - store if store_cpu else None
        slot.restore(intake, prompt=tokens)
        mx.eval([a for c in slot.state.cache for a in (c.keys, c.values)])
        t.append(time.perf_counter())
        out.append([b - a for a, b in zip(t, t[1:], strict=False)])
        inside.append([sum(alloc), cpu, store])
        mb = cut.bytes / 1e6
    return out, inside, mb


@contextlib.contextmanager
def _timed(obj: Any, name: str) -> Iterator[list[float]]:
    """The seconds of each call of obj.name meanwhile (an instance attribute over the
    method, removed on exit: it refers to obj, and a cycle would keep obj's buffers
    from the next round until the garbage collector runs)."""
    seconds: list[float] = []
    method = getattr(obj, name)

    def timed(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(obj, name, timed)
    try:
        yield seconds
    finally:
        delattr(obj, name)


def _process_cpu(pid: int) -> Callable[[], float]:
    """CPU seconds another process has used so far (Linux /proc, user + system)."""
    tick = os.sysconf("SC_CLK_TCK")

    def read() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    return read


if __name__ == "__main__":
    main()
