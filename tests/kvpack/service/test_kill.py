"""SIGKILL `kvpack serve` while it publishes, restart it (issue 4): no sealed pack lost, no
half pack visible, the next request still correct.

A real server subprocess on the tiny model and the embedded default (SQLite + a local
object directory), A = 64. tests/kvpack/serve_child.py holds the durable publish of one
chosen cut at a catalog.publish checkpoint and announces it in a file; the test then
SIGKILLs the server, inspects the vault, and restarts a plain `kvpack serve` on it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from catalog.models import ManifestRow
from catalog.queries import Cut
from catalog.scope import Scope
from engine.models import load_model
from kvpack.bench.serve import ServerProcess, prompt_tokens, run_leg, settle
from kvpack.commands import common
from kvpack.config import Settings
from tests.kvpack.serve_child import PAUSE_ENV
from tests.kvpack.serverkit import TINY_A

ROOT = Path(__file__).resolve().parents[3]
NAMESPACE = "kill"
FIRST, SECOND = 200, 330  # prompt depths: several blocks each, neither aligned
SECOND_ALIGNED = SECOND // TINY_A * TINY_A  # 320: sealed before the exact cut's publish
LEG = {"model": "tiny", "max_tokens": 8, "timeout_s": 120.0}


def serve_argv(module: str, data_dir: Path) -> list[str]:
    return [sys.executable, "-m", module, "serve", "--host", "127.0.0.1", "--port", "0",
            "--no-auth", "--model", "tiny", "--data-dir", str(data_dir),
            "--namespace", NAMESPACE, "--alignment", str(TINY_A)]  # fmt: skip


def manifest_rows(settings: Settings) -> dict[str, ManifestRow]:
    engine = settings.make_engine()
    try:
        with Session(engine) as s:
            return {r.id: r for r in s.scalars(select(ManifestRow))}
    finally:
        engine.dispose()


def load_every_manifest(settings: Settings) -> dict[str, int]:
    """Open and load every manifest row the catalog shows (MAC, identity, row agreement,
    every chunk fetched and verified); raises on the first that does not. id -> depth."""
    rows = manifest_rows(settings)
    with common.vault(settings) as vault:
        for row in rows.values():
            cut = Cut.of(row)
            loaded = vault.load(cut, Scope(cut.identity, NAMESPACE, TINY_A))
            assert loaded.manifest.id == cut.manifest_id and loaded.manifest.depth == row.depth
            assert [len(d) for _, d in loaded.parts] == [p.size for p in loaded.manifest.parts]
    return {mid: row.depth for mid, row in rows.items()}


def manifest_objects(settings: Settings) -> set[str]:
    with common.vault(settings) as vault:
        return set(vault.run(vault.objects.list_keys("manifests/")))


def wait_for(path: Path, proc, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text().endswith("\n"):
        assert proc.poll() is None, f"server exited ({proc.returncode}) before pausing"
        assert time.monotonic() < deadline, "the publisher never reached its pause point"
        time.sleep(0.05)
    return path.read_text()


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    tok = load_model("tiny", alignment=TINY_A).tokenizer
    first = prompt_tokens(tok, FIRST, seed=3, title="Logbook of the northern station.")
    second = prompt_tokens(tok, SECOND, seed=4, title="Inventory kept at the southern mill.")
    assert first[0] != second[0]  # unrelated: the second prompt starts cold
    return {"first": first, "second": second}


@pytest.fixture
def clean_env(monkeypatch):
    """The children see no stray KVPACK_* settings and can import tests.*."""
    for var in [v for v in os.environ if v.startswith("KVPACK_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )


@pytest.mark.parametrize("pause_at", ["chunks_stored", "manifest_stored"])
def test_sigkill_mid_publish_loses_no_sealed_pack_and_shows_no_half_pack(
    tmp_path, prompts, clean_env, monkeypatch, pause_at
):
    """SIGKILL while the durable publish of the second prompt's exact cut is held at
    `pause_at` (chunks stored; second case: the manifest object stored too), i.e. before
    its catalog commit. Then: every manifest row still opens and loads, the sealed set is
    exactly what it was at the kill (the first prompt's cuts and the second's aligned cut),
    the half-published cut has no row (its stray manifest object, if any, is not listed);
    a restarted server answers the second prompt from the durable 320-token cut with the
    cold run's exact output, and re-publishes the lost exact cut, after which every row
    still loads and none sealed before the kill is gone."""
    data_dir = tmp_path / "vault"
    settings = Settings.load(data_dir=data_dir, alignment=TINY_A, namespace=NAMESPACE, env={})
    announce = tmp_path / "paused"
    monkeypatch.setenv(PAUSE_ENV, json.dumps({"depth": SECOND, "at": pause_at,
                                              "announce": str(announce)}))  # fmt: skip

    argv = serve_argv("tests.kvpack.serve_child", data_dir)
    with ServerProcess(argv, tmp_path / "serve.log", 120.0) as server:
        first = run_leg(server.url, "first", prompts["first"], **LEG)
        cold = run_leg(server.url, "second", prompts["second"], **LEG)
        assert first["valid"] and cold["valid"], (first["error"], cold["error"])
        assert first["tier"] == cold["tier"] == "none"  # both computed from scratch
        wait_for(announce, server.proc)
        sealed = load_every_manifest(settings)
        os.kill(server.proc.pid, signal.SIGKILL)
        assert server.proc.wait(30) == -signal.SIGKILL
    # What was sealed before the kill: both of the first prompt's durable cuts and the
    # second's aligned cut; the exact cut being published at the kill is not among them.
    assert sorted(sealed.values()) == sorted([FIRST // TINY_A * TINY_A, FIRST, SECOND_ALIGNED])

    after_kill = load_every_manifest(settings)
    assert after_kill == sealed  # none lost, no half pack gained a row
    listed = {r.object_key for r in manifest_rows(settings).values()}
    strays = manifest_objects(settings) - listed
    assert len(strays) == (1 if pause_at == "manifest_stored" else 0)  # killed where we said

    plain = serve_argv("kvpack.cli", data_dir)
    with ServerProcess(plain, tmp_path / "serve-restarted.log", 120.0) as server:
        again = run_leg(server.url, "second", prompts["second"], **LEG)
        assert again["valid"], again["error"]
        assert (again["tier"], again["cached_tokens"]) == ("durable", SECOND_ALIGNED)
        assert (again["output"], again["completion_tokens"]) == (
            cold["output"], cold["completion_tokens"])  # fmt: skip
        assert settle(server.url, timeout_s=60)["settled"]
    assert server.exit_code == 0

    restored = load_every_manifest(settings)
    assert sealed.items() <= restored.items()
    assert sorted(set(restored.values()) - set(sealed.values())) == [SECOND]
