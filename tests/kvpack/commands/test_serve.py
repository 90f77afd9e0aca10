"""`kvpack serve --model org/name`: a Hugging Face repo id resolved in the local cache (the
`hub_cache` fixture, found through HF_HOME as a user's would be), served cold, then warm
from the resident tier, then — after a restart on the same data dir — from the durable
tier; a repo id that is not cached stops the command with the error naming it; and the
GIL switch interval set before the service opens."""

from __future__ import annotations

import subprocess
import sys
import time

from kvpack.bench.serve import ServerProcess
from kvpack.server.app import READY
from tests.kvpack.serverkit import TINY_A, call

REPO = "kvpack-test/tiny-8bit"
PROMPT = "A model from the cache, its prefixes from the vault. " * 6


def serve_argv(data_dir, model: str) -> list[str]:
    return [sys.executable, "-m", "kvpack.cli", "serve", "--host", "127.0.0.1", "--port", "0",
            "--no-auth", "--model", model, "--data-dir", str(data_dir),
            "--alignment", str(TINY_A)]  # fmt: skip


def complete(url: str) -> dict:
    body = {"model": REPO, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    status, _, reply = call(url, "POST", "/v1/completions", body=body)
    assert status == 200, reply
    return reply


def wait_published(url: str, polls: int = 1200) -> None:
    """Until the server's background queue is empty (publication runs after the reply)."""
    for _ in range(polls):
        if call(url, "GET", "/healthz")[2]["publication"]["queued"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the server never finished publishing")


def test_serve_a_repo_id_cold_warm_then_durable(tmp_path, hub_cache, monkeypatch):
    """HF_HOME names the cache; the served model is the repo's; three calls, three tiers,
    one text."""
    monkeypatch.setenv("HF_HOME", str(hub_cache.parent))  # the fixture's cache is $HF_HOME/hub
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("KVPACK_CACHE_DIR", str(tmp_path / "kvpack-cache"))
    argv = serve_argv(tmp_path / "vault", REPO)
    with ServerProcess(argv, tmp_path / "first.log", 120.0) as server:
        assert call(server.url, "GET", "/v1/models")[2]["data"][0]["id"] == REPO
        cold = complete(server.url)
        wait_published(server.url)
        warm = complete(server.url)
    with ServerProcess(argv, tmp_path / "second.log", 120.0) as server:
        durable = complete(server.url)
    tiers = [r["kvpack"]["tier"] for r in (cold, warm, durable)]
    assert tiers == ["none", "resident", "durable"]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (cold, warm, durable)]
    assert cached == [0, cold["usage"]["prompt_tokens"], cold["usage"]["prompt_tokens"]]
    assert len({r["choices"][0]["text"] for r in (cold, warm, durable)}) == 1
    log = (tmp_path / "first.log").read_text()
    assert f"model {REPO}" in log
    assert log.index("kvpack serve: warm in") < log.index(READY)  # warmed before it listens


def test_serve_a_repo_id_that_is_not_cached_exits_naming_it(tmp_path, hub_cache, monkeypatch):
    """Exit 2 before serving, the message naming the repo id, the revision and the folder."""
    monkeypatch.setenv("HF_HOME", str(hub_cache.parent))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    out = subprocess.run(
        serve_argv(tmp_path / "vault", "kvpack-test/absent@v2"), capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "kvpack-test/absent" in out.stdout and "'v2'" in out.stdout
    assert str(hub_cache / "models--kvpack-test--absent") in out.stdout


def test_serve_shortens_the_gil_switch_interval_before_its_threads_start(tmp_path, monkeypatch):
    """The server's threads hand the GIL to each other (see SWITCH_INTERVAL_S): the
    interval is set before the service, whose threads it is for, is opened."""
    from engine.models import ModelLoadError
    from kvpack import cli
    from kvpack.commands.serve import SWITCH_INTERVAL_S
    from kvpack.service.service import Service

    seen: list[float] = []

    def open_service(*_args, **_kwargs):
        seen.append(sys.getswitchinterval())
        raise ModelLoadError("tiny", "not loaded: the test stops here")

    monkeypatch.setattr(Service, "open", open_service)
    before = sys.getswitchinterval()
    try:
        argv = ["serve", "--no-auth", "--host", "127.0.0.1", "--data-dir", str(tmp_path)]
        assert cli.main(argv) == 2
    finally:
        sys.setswitchinterval(before)
    assert seen == [SWITCH_INTERVAL_S] and before > SWITCH_INTERVAL_S
