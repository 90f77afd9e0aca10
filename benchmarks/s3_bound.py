"""What bounds a sealed read from S3 on this machine: the CPU it and the server use.

    .venv/bin/python benchmarks/s3_bound.py [--blocks 1,8,31] [--rounds 9]
        [--segments 180] [--segment-kib 64]

Starts a SeaweedFS on loopback (as bench_s3_postgres.py does), stores --blocks (the
largest count) sealed chunks of random bytes shaped like the demo model's blocks (180
segments of 64 KiB: 11.25 MiB), and then, for each count, alternates `rounds` times:

- raw GET: the bench's baseline (kvpack/bench/probe.py get_objects: aiobotocore, whole
  objects, no seal, as many in flight as the store allows);
- sealed read: ChunkStore.get_into of the same chunks into reused destinations split
  into the segments a restore's intake gives (tag-verified, decrypted, re-hashed).

Both use one client on one event loop. Printed per count: wall seconds (median), the
CPU seconds (mean) of this process (client) and of the SeaweedFS process (server), and the
least time those CPU seconds allow on this machine's cores, (client + server) / cores.
Neither read runs faster than its bound; where the raw GET keeps both cores busy, the
sealed read over it reaches at most the ratio of the bounds: what decrypting and
re-hashing cost on cores the server shares. A restore adds the
manifest, the intake's allocation and the commit on top (benchmarks/restore_phases.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

from cas.chunks import ChunkStore
from cas.keys import Keyring
from cas.s3 import S3Config, S3Store, ensure_bucket
from kvpack.bench.probe import get_objects
from kvpack.bench.seaweedfs import start_seaweedfs

KiB = 1 << 10
TICK = os.sysconf("SC_CLK_TCK")


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--blocks", default="1,8,31", help="chunk counts, comma-separated")
    args.add_argument("--rounds", type=int, default=9)
    args.add_argument("--segments", type=int, default=180, help="segments per chunk")
    args.add_argument("--segment-kib", type=int, default=64)
    opts = args.parse_args()
    counts = [int(n) for n in opts.blocks.split(",")]
    with tempfile.TemporaryDirectory() as tmp, start_seaweedfs(Path(tmp) / "s3") as server:
        os.environ.update(server.s3.env())
        config = S3Config.from_env("bound")
        ensure_bucket(config)
        asyncio.run(run(config, server.process.pid, counts, opts))


async def run(config: S3Config, server_pid: int, counts: list[int], opts: argparse.Namespace):
    store = S3Store(config)
    chunks = ChunkStore(store, Keyring.generate())
    segment = opts.segment_kib * KiB
    size = opts.segments * segment
    try:
        refs = await chunks.put_many([os.urandom(size) for _ in range(max(counts))])
        outs = [[memoryview(bytearray(segment)) for _ in range(opts.segments)] for _ in refs]
        await chunks.warm(size, probe_key="bound/never-written")
        client = await store.client()
        cores = os.cpu_count() or 1
        print(f"chunks of {size / (1 << 20):.2f} MiB in {opts.segments} segments; "
              f"{cores} cores; raw GET {config.max_concurrency} in flight, sealed read "
              f"{chunks.max_concurrency}; {opts.rounds} rounds")  # fmt: skip
        print(f"{'blocks':>6s} {'read':>12s} {'wall':>9s} {'client':>9s} {'server':>9s}"
              f" {'CPU bound':>10s}")  # fmt: skip
        for n in counts:
            keys = [chunks.key(r.id) for r in refs[:n]]
            raw = partial(get_objects, client, config.bucket, keys, config.max_concurrency)
            legs: dict[str, Callable[[], Awaitable[object]]] = {
                "raw GET": raw,
                "sealed read": partial(chunks.get_into, refs[:n], outs[:n]),
            }
            await compare(n, legs, server_pid, opts.rounds, cores)
    finally:
        await store.aclose()


async def compare(
    n: int, legs: dict[str, Callable[[], Awaitable[object]]], pid: int, rounds: int, cores: int
) -> None:
    """Each leg `rounds` times, alternating; a row per leg (wall: median, CPU: mean) and
    their ratio."""
    samples: dict[str, list[tuple[float, float, float]]] = {leg: [] for leg in legs}
    for _ in range(rounds):
        for leg, read in legs.items():
            samples[leg].append(await timed(read, pid))
    bounds = []
    for leg, rows in samples.items():
        walls, clients, servers = zip(*rows, strict=True)
        # CPU as means: /proc counts the server's in clock ticks (10 ms), too coarse for
        # the median of one round.
        wall, mine, theirs = (
            statistics.median(walls),
            statistics.mean(clients),
            statistics.mean(servers),
        )
        bounds.append((wall, (mine + theirs) / cores))
        print(f"{n:6d} {leg:>12s} {ms(wall)} {ms(mine)} {ms(theirs)} {ms(bounds[-1][1])}")
    (raw, raw_bound), (sealed, sealed_bound) = bounds
    print(f"{'':6s} sealed read over raw GET: {raw / sealed:.2f} "
          f"(the CPU bounds allow {raw_bound / sealed_bound:.2f})")  # fmt: skip


async def timed(read: Callable[[], Awaitable[object]], pid: int) -> tuple[float, float, float]:
    """Wall seconds, this process's CPU seconds and process `pid`'s, of one `read()`."""
    mine, theirs, t0 = own_cpu(), cpu_of(pid), time.perf_counter()
    await read()
    wall = time.perf_counter() - t0
    return wall, own_cpu() - mine, cpu_of(pid) - theirs


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of a process, its threads included (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime: fields 14 and 15


def ms(seconds: float) -> str:
    return f"{1000 * seconds:7.1f}ms"


if __name__ == "__main__":
    main()
