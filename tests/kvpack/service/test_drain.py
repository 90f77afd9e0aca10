"""SIGTERM drains (issue 14): `kvpack serve` stops listening, lets the requests in flight
and the publication queue finish within its drain timeout, then exits; what it could not
finish is logged with a count. Real processes, the real CLI; the store is slowed by the
serve_child hook so that publication is surely still queued when the signal comes."""

from __future__ import annotations

import http.client
import json
import os
import signal
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from engine.models import load_model
from kvpack.bench.serve import ServerProcess, prompt_tokens, run_leg
from tests.kvpack.serve_child import DELAY_ENV
from tests.kvpack.serverkit import TINY_A

ROOT = Path(__file__).resolve().parents[3]
LEG = {"model": "tiny", "max_tokens": 8, "timeout_s": 120.0}


def serve_argv(module: str, data_dir: Path) -> list[str]:
    return [sys.executable, "-m", module, "serve", "--host", "127.0.0.1", "--port", "0",
            "--no-auth", "--model", "tiny", "--data-dir", str(data_dir),
            "--alignment", str(TINY_A)]  # fmt: skip


@pytest.fixture
def child_env(monkeypatch):
    """The children see no stray KVPACK_* settings and can import tests.*."""
    for var in [v for v in os.environ if v.startswith("KVPACK_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    return monkeypatch


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return prompt_tokens(load_model("tiny", alignment=TINY_A).tokenizer, 200, seed=5,
                         title="Ledger of the eastern gate.")  # fmt: skip


def terminate(server: ServerProcess) -> int:
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    return server.proc.wait(120)


def test_sigterm_right_after_a_cold_request_keeps_its_cut(tmp_path, child_env, tokens):
    """The cold request's publication is still queued (each publish waits 1 s) when
    SIGTERM arrives; the server drains it and exits 0, and a restarted server serves the
    prompt from the durable tier with the cold output."""
    child_env.setenv(DELAY_ENV, json.dumps({"seconds": 1.0}))
    slow = ServerProcess(serve_argv("tests.kvpack.serve_child", tmp_path), tmp_path / "a.log",
                         300)  # fmt: skip
    with slow:
        cold = run_leg(slow.url, "cold", tokens, **LEG)
        assert cold["valid"] and cold["tier"] == "none", cold
        assert terminate(slow) == 0
    log = (tmp_path / "a.log").read_text()
    assert "draining" in log and "not finished" not in log
    child_env.delenv(DELAY_ENV)
    with ServerProcess(serve_argv("kvpack.cli", tmp_path), tmp_path / "b.log", 300) as again:
        warm = run_leg(again.url, "durable", tokens, **LEG)
    assert (warm["tier"], warm["cached_tokens"]) == ("durable", len(tokens))
    assert warm["output"] == cold["output"]


def test_a_drain_that_runs_out_logs_what_it_could_not_finish(tmp_path, child_env, tokens):
    """With a 1 s drain and a store that takes 30 s a publish, the server exits after
    its drain and says how many publication jobs it gave up (nothing half-written: the
    next server finds no cut, and recomputes)."""
    child_env.setenv(DELAY_ENV, json.dumps({"seconds": 30.0}))
    child_env.setenv("KVPACK_DRAIN_TIMEOUT", "1")
    slow = ServerProcess(serve_argv("tests.kvpack.serve_child", tmp_path), tmp_path / "a.log",
                         300)  # fmt: skip
    with slow:
        assert run_leg(slow.url, "cold", tokens, **LEG)["valid"]
        assert terminate(slow) == 0
    log = (tmp_path / "a.log").read_text()
    assert "publication job(s) not finished within the drain timeout (1s)" in log
    count = int(log.split("publication job(s) not finished")[0].split()[-1])
    assert count >= 1


def test_a_request_in_flight_finishes_and_new_connections_are_refused(tmp_path, child_env):
    """SIGTERM while a long completion streams: the listener closes at once (a new
    connection is refused) and the stream still runs to its end ([DONE])."""
    with ServerProcess(serve_argv("kvpack.cli", tmp_path), tmp_path / "a.log", 300) as server:
        parts = urlsplit(server.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        body = {"model": "tiny", "prompt": "a long answer", "max_tokens": 1500, "temperature": 0,
                "stream": True}  # fmt: skip
        conn.request("POST", "/v1/completions", body=json.dumps(body))
        stream = conn.getresponse()
        assert stream.status == 200 and stream.readline().startswith(b"data:")
        server.proc.send_signal(signal.SIGTERM)
        refused, deadline = None, time.monotonic() + 30
        while refused is None and time.monotonic() < deadline:  # closes moments after
            probe = http.client.HTTPConnection(parts.hostname, parts.port, timeout=1)
            try:
                probe.request("GET", "/healthz")
                probe.getresponse().read()
            except ConnectionRefusedError as e:
                refused = e
            except (ConnectionError, TimeoutError, http.client.HTTPException):
                pass  # accepted just before the listener closed: never served, not refused
            finally:
                probe.close()
        assert refused is not None
        rest = stream.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")
        assert server.proc.wait(120) == 0
