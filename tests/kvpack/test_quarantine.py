"""Quarantine bytes are sealed at rest and age out; operators see and drop imports over
the admin API (admin keys only)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta

import pytest

from cas.errors import ObjectMissing
from cas.layout import object_key
from catalog.signing import ProducerKeys
from tests.kvpack.peerkit import api_key, serve, vault

IDENT = b"\5" * 32


@pytest.fixture
def service(tmp_path):
    svc = vault(tmp_path / "v")
    yield svc
    svc.close()


def test_quarantined_bytes_are_sealed_and_a_tampered_copy_is_refused(service):
    q = service.quarantine
    import_id = q.open(peer="a", identity=IDENT)
    q.put(import_id, "statement", b"plaintext statement bytes")
    assert q.get(import_id, "statement") == b"plaintext statement bytes"
    key = object_key("quarantine", import_id, "statement")
    stored = service.durable.io.run(service.durable.objects.get(key), 10)
    assert b"plaintext" not in bytes(stored)
    tampered = bytes(stored)[:-1] + bytes([stored[-1] ^ 1])
    service.durable.io.run(service.durable.objects.delete(key), 10)
    service.durable.io.run(service.durable.objects.put_if_absent(key, tampered), 10)
    with pytest.raises(ValueError, match="fails its seal"):
        q.get(import_id, "statement")


def test_collect_drops_imports_past_retention_bytes_first(service):
    q = service.quarantine
    old, new = q.open(peer="a", identity=IDENT), q.open(peer="a", identity=IDENT)
    for import_id in (old, new):
        q.put(import_id, "statement", b"x")
        q.refuse(import_id, "bad signature")
    later = datetime.now(UTC) + timedelta(hours=2)
    assert q.collect(retention=timedelta(hours=1), now=later) == 2
    assert q.list() == []
    with pytest.raises(ObjectMissing):
        q.get(old, "statement")
    keep = q.open(peer="a", identity=IDENT)
    assert q.collect(retention=timedelta(hours=1)) == 0 and q.show(keep) is not None


def call(url, path, key, method="GET", body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_admin_api_lists_shows_and_drops_imports_and_runs_gc(service):
    q = service.quarantine
    import_id = q.open(peer="a", identity=IDENT)
    q.refuse(import_id, "truncated planes: received 3 of 9 bytes")
    admin = api_key(service, role="admin", namespace="*")
    tenant = api_key(service, role="tenant", namespace="default")
    with serve(service) as url:
        assert call(url, "/v1/admin/quarantine", tenant)[0] == 403
        status, listed = call(url, "/v1/admin/quarantine?state=refused", admin)
        assert status == 200 and [i["import_id"] for i in listed["imports"]] == [import_id]
        status, shown = call(url, f"/v1/admin/quarantine/{import_id}", admin)
        assert status == 200 and shown["reason"].startswith("truncated planes")
        assert call(url, "/v1/admin/quarantine?state=served", admin)[0] == 400
        assert call(url, f"/v1/admin/quarantine/{import_id}", admin, "DELETE")[0] == 200
        assert call(url, f"/v1/admin/quarantine/{import_id}", admin, "DELETE")[0] == 404
        status, report = call(url, "/v1/admin/gc", admin, "POST", {"budget_bytes": 0})
        assert status == 200 and report["quarantine_dropped"] == 0
        assert call(url, "/v1/admin/gc", admin, "POST", {"budget_bytes": -1})[0] == 400
    assert q.list() == []


def test_admin_key_rotation_saves_the_endorsed_key_and_signs_with_it(service, tmp_path):
    path = tmp_path / "v" / "producer-key.json"
    before = service.durable.producer_keys.current_id
    admin = api_key(service, role="admin", namespace="*")
    with serve(service, producer_key_path=path) as url:
        status, bundle = call(url, "/v1/admin/keys/rotate", admin, "POST")
    assert status == 200
    [first, second] = bundle["keys"]
    assert (first["id"], second["endorsed_by"]) == (before, before)
    assert service.durable.producer_keys.current_id == second["id"]
    assert ProducerKeys.load(path).current_id == second["id"]  # survives a restart
