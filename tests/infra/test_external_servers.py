"""The variables compose's `tests` service sets (KVPACK_TEST_S3_* and KVPACK_TEST_PG_URL)
do what they say: a suite run in a subprocess with them set uses the server they name,
not one its fixture starts, and passes. The S3 server is a SeaweedFS started here,
outside the fixture, as compose's MinIO is; the suites run with CI=true, as there. Each
runs one module of its suite: what is checked is which server the fixture takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import boto3
import psycopg
from sqlalchemy.engine import make_url

from kvpack.bench.seaweedfs import SeaweedUnavailable, start_seaweedfs
from tests.fixtures.db import DEFAULT_PG_URL, pg_unavailable
from tests.fixtures.s3 import s3_unavailable
from tests.infra.files import ROOT


def run_suite(tmp_path: Path, args: list[str], env: dict[str, str]) -> tuple[dict, list[dict]]:
    """pytest ARGS in a subprocess: (junit totals and skip messages, servers it used)."""
    record, junit = tmp_path / "servers.jsonl", tmp_path / "junit.xml"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KVPACK_TEST_")}
    child_env |= {"PYTHONPATH": str(ROOT), "CI": "true", **env}
    options = ["-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    options += ["-p", "tests.infra.record_servers", f"--record-servers={record}"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *args, *options],
        cwd=ROOT,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    suite = ET.parse(junit).getroot().find("testsuite")
    totals = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    totals["skip_messages"] = [s.get("message", "") for s in suite.iter("skipped")]
    used = [json.loads(line) for line in record.read_text().splitlines()]
    return totals, used


def test_the_s3_suite_uses_the_server_named_by_kvpack_test_s3_endpoint(tmp_path):
    try:
        server = start_seaweedfs(tmp_path / "seaweedfs")
    except SeaweedUnavailable as e:
        s3_unavailable(str(e))
    with server:
        s3 = server.s3
        client = boto3.client(
            "s3",
            endpoint_url=s3.endpoint_url,
            aws_access_key_id=s3.access_key,
            aws_secret_access_key=s3.secret_key,
            region_name=s3.region,
        )
        before = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        totals, used = run_suite(
            tmp_path,
            ["tests/cas/test_contract.py", "-m", "s3"],
            {
                "KVPACK_TEST_S3_ENDPOINT": s3.endpoint_url,
                "KVPACK_TEST_S3_ACCESS_KEY": s3.access_key,
                "KVPACK_TEST_S3_SECRET_KEY": s3.secret_key,
            },
        )
        after = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    assert used == [{"s3_endpoint": s3.endpoint_url}]  # not a fixture-started SeaweedFS
    assert totals["tests"] > totals["skipped"] and totals["failures"] == totals["errors"] == 0
    assert not [m for m in totals["skip_messages"] if "no S3 server" in m]
    assert after == before  # the run's bucket is gone: a shared MinIO is left as found


def test_the_postgres_suite_uses_the_server_named_by_kvpack_test_pg_url(tmp_path):
    base = make_url(os.environ.get("KVPACK_TEST_PG_URL", DEFAULT_PG_URL))
    # The same server, named differently from the fixture's default (the admin database
    # spelt out), so the record shows which of the two the fixture took.
    url = base.set(drivername="postgresql+psycopg", database="postgres")
    try:
        dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
        psycopg.connect(dsn, connect_timeout=5).close()
    except psycopg.Error as e:
        pg_unavailable(f"cannot reach {url.render_as_string()}: {e}")
    totals, used = run_suite(
        tmp_path,
        ["tests/catalog/test_access.py", "-m", "postgres"],
        {"KVPACK_TEST_PG_URL": url.render_as_string(hide_password=False)},
    )
    assert used == [{"pg_url": url.render_as_string(hide_password=True)}]
    assert totals["tests"] > 0 and totals["failures"] == totals["errors"] == totals["skipped"] == 0
