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


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The script with `kvpack` meaning this checkout's CLI, its data dir in tmp_path."""
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        shim = bin_dir / "kvpack"
        shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m kvpack.cli "$@"\n')
        shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPACK_")}
    env |= {
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
