"""The store benchmark: what sealing and each backend cost, on this machine, in one run.

Rows (MiB/s of plaintext):
- blake3: keyed chunk ids of every chunk, in this process.
- seal / open: the chunk seal (format 2: AES-256-GCM under a per-chunk key) over every
  chunk, one thread (open includes the re-hash).
- chunk store put / get_many on each backend (local directory, S3): digest, seal,
  verify, put-if-absent; fetch, verify, decrypt into one buffer.
- raw baselines of the same bytes without sealing: boto3 put_object / get_object with
  a thread pool of the same concurrency; plain files written with fsync and read back.
- floor: the machine's floor for the same chunks (cas/floor.py: file read into a reused
  buffer + AES-256-GCM open + BLAKE3, one thread); beside every get, the fraction of
  the floor's rate it reaches (floor seconds / get seconds).

Validity gate: every get is compared with what was put; a mismatch marks the row
INVALID and the command exits 1. Each backend writes under a fresh prefix, and
deletes it afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from cas.chunks import ChunkStore
from cas.floor import Floor, measure_floor
from cas.ids import ChunkId
from cas.keys import Keyring
from cas.local import LocalDirStore
from cas.s3 import S3Config, S3Store, boto3_client, ensure_bucket
from cas.seal import ChunkSeal
from cas.store import ObjectStore
from kvpack.bench.seaweedfs import start_seaweedfs

MiB = 1 << 20
T = TypeVar("T")


@dataclass(frozen=True)
class BenchOptions:
    total_mib: int = 256
    chunk_mib: int = 8
    concurrency: int = 8
    backends: tuple[str, ...] = ("local", "s3")
    s3: S3Config | None = None  # None: start a SeaweedFS for the run
    work_dir: Path | None = None


@dataclass(frozen=True)
class Row:
    path: str
    backend: str
    op: str
    nbytes: int
    seconds: float
    valid: bool = True

    @property
    def mib_s(self) -> float:
        return self.nbytes / MiB / self.seconds if self.seconds > 0 else float("inf")


def _timed(fn: Callable[[], T]) -> tuple[float, T]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run(opts: BenchOptions, *, log: Callable[[str], None] = print) -> tuple[list[Row], Floor]:
    """Every row, and the floor of the same chunks."""
    if not 1 <= opts.chunk_mib <= opts.total_mib:
        raise ValueError(f"chunk size {opts.chunk_mib} MiB must be within 1..{opts.total_mib}")
    n = opts.total_mib // opts.chunk_mib
    size = opts.chunk_mib * MiB
    log(f"generating {n} chunks of {opts.chunk_mib} MiB ({n * opts.chunk_mib} MiB)")
    data = memoryview(os.urandom(n * size))
    chunks = [data[i * size : (i + 1) * size] for i in range(n)]
    total = n * size
    ring = Keyring.generate()
    rows = _crypto_rows(chunks, ring, total)
    with tempfile.TemporaryDirectory(prefix="kvpack-bench-", dir=opts.work_dir) as tmp:
        work = Path(tmp)
        log("floor ...")
        floor = measure_floor([size] * n, directory=work)
        if "local" in opts.backends:
            log("local directory ...")
            rows += _local_rows(chunks, data, ring, work / "local", opts)
        if "s3" in opts.backends:
            with _s3_target(opts, work / "seaweedfs", log) as cfg:
                log(f"s3 at {cfg.endpoint_url} ...")
                rows += _s3_rows(chunks, data, ring, cfg, opts)
    return rows, floor


def _crypto_rows(chunks: list[memoryview], ring: Keyring, total: int) -> list[Row]:
    key = ring.digest_key("bench")
    t_hash, ids = _timed(lambda: [ChunkId.of(c, key=key) for c in chunks])
    seal = ChunkSeal(ring)
    t_seal, sealed = _timed(lambda: [seal.seal(i, c) for i, c in zip(ids, chunks, strict=True)])
    out = bytearray(len(chunks[0]))

    def open_all() -> None:
        for i, s in zip(ids, sealed, strict=True):
            seal.open_into(
                i, s, memoryview(out)[: len(s) - (len(s) - len(chunks[0]))], digest_key=key
            )

    t_open, _ = _timed(open_all)
    return [
        Row("blake3 (keyed, chunk id)", "cpu", "hash", total, t_hash),
        Row("chunk seal", "cpu", "seal", total, t_seal),
        Row("chunk seal + re-hash", "cpu", "open", total, t_open),
    ]


def _chunk_store_rows(
    store: ObjectStore,
    chunks: list[memoryview],
    data: memoryview,
    ring: Keyring,
    opts: BenchOptions,
    backend: str,
) -> list[Row]:
    cs = ChunkStore(store, ring, namespace="bench", max_concurrency=opts.concurrency)

    async def go() -> tuple[float, float, bool]:
        t0 = time.perf_counter()
        refs = await cs.put_many(chunks)
        t1 = time.perf_counter()
        out = await cs.get_many(refs)
        t2 = time.perf_counter()
        ok = out == data
        await asyncio.gather(*(cs.delete(r.id) for r in refs))
        await store.aclose()
        return t1 - t0, t2 - t1, ok

    t_put, t_get, ok = asyncio.run(go())
    total = data.nbytes
    return [
        Row("chunk store (sealed)", backend, "put", total, t_put),
        Row("chunk store (sealed)", backend, "get", total, t_get, ok),
    ]


def _local_rows(
    chunks: list[memoryview], data: memoryview, ring: Keyring, root: Path, opts: BenchOptions
) -> list[Row]:
    rows = _chunk_store_rows(LocalDirStore(root / "cas"), chunks, data, ring, opts, "local")
    raw = root / "raw"
    raw.mkdir(parents=True)

    def write(i: int) -> None:
        with open(raw / str(i), "wb") as f:
            f.write(chunks[i])
            f.flush()
            os.fsync(f.fileno())

    def read(i: int) -> bool:
        return (raw / str(i)).read_bytes() == chunks[i]

    with ThreadPoolExecutor(opts.concurrency) as pool:
        t_put, _ = _timed(lambda: list(pool.map(write, range(len(chunks)))))
        t_get, oks = _timed(lambda: list(pool.map(read, range(len(chunks)))))
    shutil.rmtree(raw)
    rows += [
        Row("raw files (fsync)", "local", "put", data.nbytes, t_put),
        Row("raw files", "local", "get", data.nbytes, t_get, all(oks)),
    ]
    return rows


def _s3_rows(
    chunks: list[memoryview], data: memoryview, ring: Keyring, cfg: S3Config, opts: BenchOptions
) -> list[Row]:
    cfg = dataclasses.replace(cfg, max_concurrency=opts.concurrency)
    run_prefix = f"{cfg.key_prefix}bench-{uuid.uuid4().hex[:8]}/"
    cs_cfg = dataclasses.replace(cfg, prefix=run_prefix + "cas")
    rows = _chunk_store_rows(S3Store(cs_cfg), chunks, data, ring, opts, "s3")
    client = boto3_client(cfg)
    keys = [f"{run_prefix}raw/{i}" for i in range(len(chunks))]

    def put(i: int) -> None:
        client.put_object(Bucket=cfg.bucket, Key=keys[i], Body=chunks[i].tobytes())

    def get(i: int) -> bool:
        return client.get_object(Bucket=cfg.bucket, Key=keys[i])["Body"].read() == chunks[i]

    with ThreadPoolExecutor(opts.concurrency) as pool:
        t_put, _ = _timed(lambda: list(pool.map(put, range(len(chunks)))))
        t_get, oks = _timed(lambda: list(pool.map(get, range(len(chunks)))))
        list(pool.map(lambda k: client.delete_object(Bucket=cfg.bucket, Key=k), keys))
    client.close()
    return rows + [
        Row("raw boto3 (unsealed)", "s3", "put", data.nbytes, t_put),
        Row("raw boto3 (unsealed)", "s3", "get", data.nbytes, t_get, all(oks)),
    ]


@contextmanager
def _s3_target(
    opts: BenchOptions, data_dir: Path, log: Callable[[str], None]
) -> Iterator[S3Config]:
    if opts.s3 is not None:
        ensure_bucket(opts.s3)
        yield opts.s3
        return
    log("starting SeaweedFS (weed mini) on loopback ...")
    with start_seaweedfs(data_dir) as server:
        cfg = server.s3.config("kvpack-bench")
        ensure_bucket(cfg)
        yield cfg


def floor_fraction(row: Row, floor: Floor) -> float | None:
    """The fraction of the floor's rate a get of the floor's bytes reaches; else None."""
    if row.op != "get" or row.nbytes != floor.bytes or row.seconds <= 0:
        return None
    return floor.seconds / row.seconds


def format_table(rows: list[Row], floor: Floor, opts: BenchOptions) -> str:
    head = (f"{'path':<28} {'backend':<7} {'op':<5} {'MiB':>6} {'seconds':>8} {'MiB/s':>8} "
            f"{'x floor':>7}")  # fmt: skip
    lines = [
        f"kvpack bench-store: {opts.total_mib // opts.chunk_mib} chunks x {opts.chunk_mib} MiB, "
        f"concurrency {opts.concurrency}, {os.cpu_count()} CPUs",
        f"floor (read into a reused buffer + AES-256-GCM open + BLAKE3, one thread): "
        f"{floor.seconds:.3f} s, {floor.rate / MiB:.1f} MiB/s (read {floor.read_s:.3f} s, "
        f"open {floor.open_s:.3f} s, hash {floor.hash_s:.3f} s)",
        head,
        "-" * len(head),
    ]
    for r in rows:
        flag = "" if r.valid else "  INVALID (bytes differ)"
        fraction = floor_fraction(r, floor)
        share = "-" if fraction is None else f"{fraction:.2f}"
        lines.append(
            f"{r.path:<28} {r.backend:<7} {r.op:<5} {r.nbytes / MiB:>6.0f} "
            f"{r.seconds:>8.2f} {r.mib_s:>8.1f} {share:>7}{flag}"
        )
    return "\n".join(lines)
