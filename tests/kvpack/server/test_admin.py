"""POST /v1/admin/gc refuses what is not a clean number before it deletes anything: on a
vault with published cuts, `budget_bytes: true` (which once read as 1 and emptied the
vault) and every non-finite or overflowing number are a 400 naming the field, and every
manifest and object is still there; a real budget then does evict (the route works)."""

from __future__ import annotations

import asyncio
import http.client
import json
from urllib.parse import urlsplit

import pytest
from sqlalchemy import func, select

from catalog.models import ManifestRow
from tests.engine.slotkit import prompt
from tests.kvpack.serverkit import call, open_tiny_service, running

NAN, INF = float("nan"), float("inf")


@pytest.fixture
def service(tmp_path):
    svc = open_tiny_service(tmp_path / "vault")
    yield svc
    svc.close()


def inventory(service) -> tuple[int, list[str]]:
    """(manifest rows, object keys) of the vault."""
    vault = service.vault
    manifests = vault.read(lambda s: s.scalar(select(func.count()).select_from(ManifestRow)))
    keys = asyncio.run_coroutine_threadsafe(vault.objects.list_keys(""), vault.io.loop)
    return manifests, keys.result(30)


def gc(url: str, raw: str) -> tuple[int, dict]:
    """POST raw JSON text (NaN and Infinity included, which strict JSON would not write)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("POST", "/v1/admin/gc", body=raw, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


@pytest.mark.parametrize(
    ("body", "param"),
    [({"budget_bytes": True}, "budget_bytes"), ({"budget_bytes": False}, "budget_bytes"),
     ({"budget_bytes": 1.0}, "budget_bytes"), ({"budget_bytes": "0"}, "budget_bytes"),
     ({"budget_bytes": NAN}, "budget_bytes"), ({"budget_bytes": INF}, "budget_bytes"),
     ({"budget_bytes": 2**64}, "budget_bytes"),
     ({"budget_bytes": 0, "grace_s": NAN}, "grace_s"),
     ({"budget_bytes": 0, "grace_s": INF}, "grace_s"),
     ({"budget_bytes": 0, "grace_s": -INF}, "grace_s"),
     ({"budget_bytes": 0, "grace_s": 1e308}, "grace_s"),
     ({"budget_bytes": 0, "grace_s": 1e30}, "grace_s"),
     ({"budget_bytes": 0, "grace_s": True}, "grace_s"),
     ({"budget_bytes": 0, "quarantine_retention_s": 1e15}, "quarantine_retention_s"),
     ({"budget_bytes": 0, "quarantine_retention_s": NAN}, "quarantine_retention_s"),
     ({"budget_bytes": 0, "budget": 0}, "budget")],
)  # fmt: skip
def test_a_gc_body_that_is_not_clean_numbers_deletes_nothing(service, body, param):
    with running(service) as url:
        for seed in (1, 2):
            completion = {"prompt": prompt(200, seed=seed), "max_tokens": 2}
            assert call(url, "POST", "/v1/completions", body=completion)[0] == 200
        assert service.flush(30)
        before = inventory(service)
        assert before[0] >= 2 and before[1]
        status, reply = gc(url, json.dumps(body, allow_nan=True))
        assert (status, reply["error"]["param"]) == (400, param)
        assert inventory(service) == before
        status, report = gc(url, json.dumps({"budget_bytes": 0, "grace_s": 0}))
        assert status == 200 and report["evicted"]
        assert inventory(service)[0] == 0
