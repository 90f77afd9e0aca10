"""A publisher killed between chunk upload and catalog commit leaves no visible manifest."""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from cas.local import LocalDirStore
from catalog.models import ManifestRow
from tests.catalog.helpers import do_publish, find, load, payloads, tokens

ROOT = Path(__file__).resolve().parents[2]


def spawn_and_kill(spec: dict) -> None:
    """Run the child publisher, wait for it to reach its pause point, SIGKILL it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.catalog.publish_child", json.dumps(spec)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline and not line:
            if sel.select(timeout=1):
                line = proc.stdout.readline().strip()
                if not line and proc.poll() is not None:
                    break
        assert line == "PAUSED", f"child did not pause: {line!r} {proc.stderr.read()}"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("pause_at", ["chunks_stored", "manifest_stored"])
def test_killed_publisher_leaves_no_manifest_and_a_later_publish_completes(
    aio, chunk_store, db_url, db_engine, pause_at
):
    """Crash: SIGKILL after the chunks (and, second case, the manifest object) are stored
    but before the catalog commit -> no manifest visible; publishing again completes."""
    history, planes = tokens(800, 300), payloads(800, n=3)
    objects = chunk_store.objects
    if isinstance(objects, LocalDirStore):
        store = {"kind": "local", "root": str(objects.root)}
    else:
        store = {"kind": "s3", "config": dataclasses.asdict(objects.config)}
    spawn_and_kill(
        {
            "store": store,
            "db_url": db_url,
            "keyring": chunk_store.keyring.to_json(),
            "tokens": history,
            "planes": [(role, data.hex()) for role, data in planes],
            "pause_at": pause_at,
        }
    )
    # The child got as far as uploading every chunk ...
    assert len(aio.run(objects.list_keys("chunks/"))) == 3
    orphans = aio.run(objects.list_keys("manifests/"))
    assert len(orphans) == (1 if pause_at == "manifest_stored" else 0)
    # ... and yet no reader can see a manifest.
    assert find(db_engine, history) is None
    with Session(db_engine) as s:
        assert s.scalar(select(func.count()).select_from(ManifestRow)) == 0

    manifest = aio.run(do_publish(chunk_store, db_engine, history, planes))
    loaded = aio.run(load(chunk_store, db_engine, history))
    assert loaded.manifest == manifest
    assert [(r, bytes(v)) for r, v in loaded.parts] == planes
