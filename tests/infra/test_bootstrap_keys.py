"""infra/bootstrap-keys.sh (compose's kvpack-keys step), run with this checkout's CLI on
a SQLite catalog: the first run prints an admin and a tenant token that the catalog
accepts; later runs print none and make none."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from catalog.access import authenticate, list_keys
from tests.infra.files import INFRA, ROOT

SCRIPT = INFRA / "bootstrap-keys.sh"
LINE = re.compile(r"(admin|tenant) key \(namespace (\S+)\): (kvp_\S+)")


def run(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The script with `kvpack` meaning this checkout's CLI, its data dir in tmp_path."""
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        shim = bin_dir / "kvpack"
        shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m kvpack.cli "$@"\n')
        shim.chmod(0o755)
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPACK_")}
    env |= extra | {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "KVPACK_DATA_DIR": str(tmp_path / "data"),
    }
    done = subprocess.run(
        [str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done


def catalog(tmp_path: Path) -> Session:
    return Session(create_engine(f"sqlite:///{tmp_path / 'data' / 'catalog.sqlite3'}"))


def test_first_start_prints_two_working_keys_and_later_starts_print_none(tmp_path):
    first = run(tmp_path)
    printed = LINE.findall(first.stdout)
    assert [(role, ns) for role, ns, _ in printed] == [("admin", "*"), ("tenant", "default")]
    with catalog(tmp_path) as session:
        for role, namespace, token in printed:
            principal = authenticate(session=session, token=token)
            assert principal is not None
            assert (principal.role, principal.namespace) == (role, namespace)
    again = run(tmp_path)
    assert not LINE.search(again.stdout) and "kvp_" not in again.stdout
    with catalog(tmp_path) as session:
        assert len(list_keys(session=session)) == 2


def test_the_tenant_namespace_is_the_scripts_argument(tmp_path):
    printed = LINE.findall(run(tmp_path, "acme").stdout)
    assert ("tenant", "acme") in [(role, ns) for role, ns, _ in printed]


def test_a_metrics_key_file_gets_a_working_admin_key_once_and_again_when_lost(tmp_path):
    key_file = tmp_path / "metrics" / "admin-key"
    key_file.parent.mkdir()
    env = {"KVPACK_METRICS_KEY_FILE": str(key_file)}
    first = run(tmp_path, env=env)
    token = key_file.read_text().strip()
    assert token not in first.stdout and token not in first.stderr  # never printed
    assert key_file.stat().st_mode & 0o777 == 0o644
    with catalog(tmp_path) as session:
        principal = authenticate(session=session, token=token)
        assert principal is not None and principal.role == "admin"
        count = len(list_keys(session=session))
    run(tmp_path, env=env)
    assert key_file.read_text().strip() == token
    key_file.unlink()  # a fresh volume over the same catalog
    run(tmp_path, env=env)
    fresh = key_file.read_text().strip()
    with catalog(tmp_path) as session:
        assert fresh != token and authenticate(session=session, token=fresh) is not None
        assert len(list_keys(session=session)) == count + 1
