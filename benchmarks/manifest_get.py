"""A manifest-sized S3 read after a warm start: the direct GET against aiobotocore's.

    .venv/bin/python benchmarks/manifest_get.py [--size 3000] [--reads 4] [--processes 3]

Starts a SeaweedFS on loopback (as bench_s3_postgres.py does), writes two objects of
--size bytes, then, alternating the two paths of S3Store.get (cas/s3.py: the direct GET,
and aiobotocore's get_object with `direct_get` off), runs --processes fresh processes
each. A process warms its store as a server's warm start does (a stat of a key never
written, then cas ChunkStore.warm: a get_into of that key per chunk in flight),
then times --reads gets, alternating the two objects. Prints each process's times: the
first read after a start is the one a restart's first request pays.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cas.chunks import ChunkStore
from cas.errors import ObjectMissing
from cas.keys import Keyring
from cas.s3 import S3Config, S3Store, ensure_bucket
from kvpack.bench.seaweedfs import start_seaweedfs

KEYS = ("manifest/a", "manifest/b")
PROBE = "probe/never-written"


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--size", type=int, default=3000, help="bytes of each object")
    args.add_argument("--reads", type=int, default=4, help="gets timed in each process")
    args.add_argument("--processes", type=int, default=3, help="fresh processes per path")
    opts = args.parse_args()
    with tempfile.TemporaryDirectory() as tmp, start_seaweedfs(Path(tmp) / "s3") as server:
        config = server.s3.config("manifest-get")
        ensure_bucket(config)
        asyncio.run(_write(config, opts.size))
        for _ in range(opts.processes):
            for direct in (True, False):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", str(direct), str(opts.reads)],
                    env={**os.environ, **server.s3.env(), "PYTHONPATH": str(Path.cwd())},
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                path = "direct GET" if direct else "aiobotocore"
                print(f"{path:12s} {out.stdout.strip()}")


async def _write(config: S3Config, size: int) -> None:
    store = S3Store(config)
    for i, key in enumerate(KEYS):
        await store.put_if_absent(key, bytes([i]) * size)
    await store.aclose()


async def _child(direct: bool, reads: int) -> list[float]:
    store = S3Store(S3Config.from_env("manifest-get", direct_get=direct))
    with contextlib.suppress(ObjectMissing):
        await store.stat(PROBE)
    await ChunkStore(store, Keyring.generate()).warm(1 << 20, probe_key=PROBE)
    seconds = []
    for i in range(reads):
        t = time.perf_counter()
        await store.get(KEYS[i % len(KEYS)])
        seconds.append(time.perf_counter() - t)
    await store.aclose()
    return seconds


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        times = asyncio.run(_child(sys.argv[2] == "True", int(sys.argv[3])))
        print("  ".join(f"{1000 * s:5.2f} ms" for s in times))
    else:
        main()
