"""infra/compose.yaml: it validates, its one-shots run in order and are waited for, the
server is published on loopback with a healthcheck that fails when the server does, it
stops on SIGTERM with a grace period, and its services agree with each other (bucket,
credentials, database) as kvpack's own settings read them."""

from __future__ import annotations

import contextlib
import http.server
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import PurePosixPath
from urllib.parse import urlsplit

import pytest
import yaml
from sqlalchemy.engine import make_url

from kvpack.config import Settings
from tests.infra.files import COMPOSE, ROOT, Dockerfile, compose, require_tool

SERVICES = compose()["services"]
DOCKERFILE = Dockerfile.read()
KVPACK_SERVICES = [n for n, s in SERVICES.items() if s.get("image") == SERVICES["kvpack"]["image"]]


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for stage in reversed(DOCKERFILE.resolve(DOCKERFILE.default)):
        env |= stage.env()
    return env


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize(
    "profiles", [[], ["test"], ["monitoring"]], ids=["default", "test-profile", "monitoring"]
)
def test_docker_compose_config_accepts_the_file_and_reads_it_as_yaml_does(profiles):
    tool = require_tool("docker-compose")
    args = [tool, "-f", str(COMPOSE)] + [a for p in profiles for a in ("--profile", p)]
    done = subprocess.run([*args, "config"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "WARN" not in done.stderr, done.stderr
    normalized = yaml.safe_load(done.stdout)["services"]
    assert set(normalized) == set(SERVICES)
    for name, service in SERVICES.items():  # the other tests read the file as compose does
        env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
        assert (normalized[name].get("environment") or {}) == env


def test_every_one_shot_is_awaited_directly_by_a_long_running_service():
    """`up --wait` counts a one-shot's exit 0 as done only when a running service
    depends on it with service_completed_successfully."""
    awaited = {
        dep: name
        for name, s in SERVICES.items()
        for dep, cond in (s.get("depends_on") or {}).items()
        if cond["condition"] == "service_completed_successfully"
    }
    one_shots = set(awaited)
    assert {"minio-bucket", "kvpack-migrate", "kvpack-keys"} <= one_shots
    long_running = {n for n, s in SERVICES.items() if n not in one_shots and not s.get("profiles")}
    for one_shot in one_shots:
        by = {n for n in long_running if one_shot in (SERVICES[n].get("depends_on") or {})}
        assert by, f"{one_shot} is awaited only by other one-shots"


def test_the_catalog_is_migrated_before_keys_are_made_and_both_before_the_server():
    deps = {n: set(SERVICES[n].get("depends_on") or {}) for n in SERVICES}
    assert "kvpack-migrate" in deps["kvpack-keys"]
    assert {"kvpack-migrate", "kvpack-keys", "minio-bucket"} <= deps["kvpack"]
    assert "postgres" in deps["kvpack-migrate"]
    assert SERVICES["kvpack-migrate"]["command"] == ["db", "upgrade"]


def test_the_server_is_published_on_loopback_and_stops_gracefully():
    kvpack = SERVICES["kvpack"]
    assert "entrypoint" not in kvpack  # the image's: kvpack
    argv = kvpack["command"]
    assert argv[0] == "serve"
    port = flag(argv, "--port")
    assert flag(argv, "--host") == "0.0.0.0"
    assert kvpack["ports"] == [f"127.0.0.1:8000:{port}"]
    assert kvpack["stop_signal"] == "SIGTERM"
    grace = re.fullmatch(r"(\d+)s", kvpack["stop_grace_period"])
    assert grace and int(grace[1]) >= 10
    assert kvpack["init"] is True
    data_dir = image_env()["KVPACK_DATA_DIR"]
    assert any(v.split(":")[1] == data_dir for v in kvpack["volumes"])  # keyring, producer key
    assert kvpack["build"]["target"] == DOCKERFILE.default.name


def healthcheck_argv(port: int) -> list[str]:
    kvpack = SERVICES["kvpack"]
    test = kvpack["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "python"
    served = flag(kvpack["command"], "--port")
    code = test[3]
    assert f"http://127.0.0.1:{served}/healthz" in code
    return [sys.executable, test[2], code.replace(f":{served}/", f":{port}/")]


@pytest.fixture
def health_server() -> Iterator[tuple[int, dict]]:
    state = {"status": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(state["status"] if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], state
    server.shutdown()
    server.server_close()


def test_the_healthcheck_passes_on_200_and_fails_on_an_error_or_no_server(health_server):
    port, state = health_server
    assert subprocess.run(healthcheck_argv(port), capture_output=True).returncode == 0
    state["status"] = 503
    assert subprocess.run(healthcheck_argv(port), capture_output=True).returncode != 0
    with refused_port() as closed:
        assert subprocess.run(healthcheck_argv(closed), capture_output=True).returncode != 0


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port that is bound but not listening: connections are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def minio() -> tuple[str, str, str]:
    """(bucket the one-shot creates, root user, root password)."""
    env = SERVICES["minio"]["environment"]
    script = " ".join(SERVICES["minio-bucket"]["command"])
    bucket = re.search(r"mc mb (?:--\S+ )*vault/(\S+)", script)
    alias = re.search(r"mc alias set vault (\S+) (\S+) (\S+)", script)
    assert bucket and alias
    assert alias[1] == "http://minio:9000"
    assert (alias[2], alias[3]) == (env["MINIO_ROOT_USER"], env["MINIO_ROOT_PASSWORD"])
    return bucket[1], env["MINIO_ROOT_USER"], env["MINIO_ROOT_PASSWORD"]


def check_postgres_url(url: str) -> None:
    env = SERVICES["postgres"]["environment"]
    parsed = make_url(url)
    assert (parsed.host, parsed.port) == ("postgres", 5432)
    assert (parsed.username, parsed.password) == (env["POSTGRES_USER"], env["POSTGRES_PASSWORD"])


@pytest.mark.parametrize("service", KVPACK_SERVICES)
def test_kvpack_settings_point_at_the_compose_bucket_and_database(service):
    env = image_env() | SERVICES[service]["environment"]
    settings = Settings.load(env=env)
    bucket, user, password = minio()
    assert settings.store_url.is_s3 and settings.store_url.bucket == bucket
    assert urlsplit(settings.s3_endpoint).netloc == "minio:9000"
    assert (settings.s3_access_key, settings.s3_secret_key) == (user, password)
    check_postgres_url(settings.database_url)
    database = make_url(settings.database_url).database
    assert database == SERVICES["postgres"]["environment"]["POSTGRES_DB"]
    assert str(settings.data_dir) == image_env()["KVPACK_DATA_DIR"]


def test_the_tenant_key_is_made_for_the_servers_namespace_by_the_script_in_the_image():
    keys = SERVICES["kvpack-keys"]
    settings = Settings.load(env=image_env() | SERVICES["kvpack"]["environment"])
    assert keys["command"] == [settings.namespace]
    (copied,) = [
        i.args.split()
        for i in DOCKERFILE.default.all("COPY")
        if i.args.startswith("infra/bootstrap-keys.sh")
    ]
    target = PurePosixPath(copied[-1])
    assert keys["entrypoint"] == [target.name]
    assert str(target.parent) == "/usr/local/bin"  # on PATH in the python images
    assert (ROOT / copied[0]).stat().st_mode & 0o111, "COPY keeps the mode: make it executable"


def test_the_test_service_runs_against_the_compose_minio_and_postgres():
    tests = SERVICES["tests"]
    assert tests["profiles"] == ["test"]
    assert tests["build"]["target"] == "test"
    env = tests["environment"]
    _, user, password = minio()
    assert env["KVPACK_TEST_S3_ENDPOINT"] == "http://minio:9000"
    assert (env["KVPACK_TEST_S3_ACCESS_KEY"], env["KVPACK_TEST_S3_SECRET_KEY"]) == (user, password)
    check_postgres_url(env["KVPACK_TEST_PG_URL"])
    assert env["CI"] == "true"  # unreachable servers fail the run instead of skipping
    assert set(tests["depends_on"]) == {"minio", "postgres"}
    assert all(c["condition"] == "service_healthy" for c in tests["depends_on"].values())
