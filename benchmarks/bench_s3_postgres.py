"""`kvpack bench` against a real S3 + PostgreSQL on loopback: a SeaweedFS it starts
itself and a fresh database on the local PostgreSQL, dropped afterwards.

    .venv/bin/python benchmarks/bench_s3_postgres.py 256,512,1024,2048 [--restarts 3 ...]

Arguments after the depths go to `kvpack bench` as they are. Before the bench, one
object of a block's size is written, read once and deleted (`first_read`).
KVPACK_BENCH_PG (default postgresql://postgres@127.0.0.1:5432/postgres) names the
server's maintenance database. Receipts go to receipts/s3pg/.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg

from cas.s3 import S3Config, boto3_client, ensure_bucket
from kvpack.bench.catalog import BLOCK_BYTES
from kvpack.bench.seaweedfs import start_seaweedfs

ADMIN = os.environ.get("KVPACK_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
FIRST_READ_KEY = "first-read"  # outside the bench's prefix (runs/)


def first_read(config: S3Config) -> None:
    """A SeaweedFS started seconds ago pays for its first GET of a large object: 18.6 ms
    against 11.0 ms for the three after it (a block's bytes, medians over five fresh
    servers here), 13.4 against 13.8 ms when one other object was read first. In the
    bench that first GET would be the first restart's first durable leg: a cost of the
    S3 server's start, not of kvpack's, and one a deployed S3 that has served reads
    before does not charge. So the bench's S3 reads once before the bench."""
    client = boto3_client(config)
    try:
        client.put_object(Bucket=config.bucket, Key=FIRST_READ_KEY, Body=os.urandom(BLOCK_BYTES))
        client.get_object(Bucket=config.bucket, Key=FIRST_READ_KEY)["Body"].read()
        client.delete_object(Bucket=config.bucket, Key=FIRST_READ_KEY)
    finally:
        client.close()


def main(depths: str, more: list[str]) -> int:
    db = f"kvpack_bench_{secrets.token_hex(3)}"
    server_url = ADMIN.rsplit("/", 1)[0]
    with psycopg.connect(ADMIN, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{db}"')
    try:
        with tempfile.TemporaryDirectory() as tmp, start_seaweedfs(Path(tmp)) as server:
            s3 = server.s3
            config = s3.config("kvpack-bench")
            ensure_bucket(config)
            first_read(config)
            # Credentials through the environment, so they stay out of process listings.
            env = {
                **os.environ,
                "AWS_ACCESS_KEY_ID": s3.access_key,
                "AWS_SECRET_ACCESS_KEY": s3.secret_key,
            }
            cmd = [
                sys.executable, "-m", "kvpack.cli", "bench", "--depths", depths,
                "--store-url", "s3://kvpack-bench/runs", "--s3-endpoint", s3.endpoint_url,
                "--database-url", f"{server_url}/{db}", "--receipts-dir", "receipts/s3pg", *more,
            ]  # fmt: skip
            print("$", " ".join(cmd[2:]), flush=True)
            return subprocess.call(cmd, env=env)
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "256,512,1024,2048", sys.argv[2:]))
