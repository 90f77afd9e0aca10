"""Quarantine bytes are sealed at rest and age out; operators see and drop imports over
the admin API (admin keys only)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from cas.errors import ObjectCorrupt, ObjectMissing
from cas.layout import object_key
from catalog.ids import IdentityDigest
from catalog.signing import ProducerKeys
from kvpack.remote.quarantine import BadImportId
from tests.kvpack.remote.peerkit import api_key, serve, vault
from tests.kvpack.serverkit import call

IDENT = IdentityDigest(b"\5" * 32)


@pytest.fixture
def service(tmp_path):
    svc = vault(tmp_path / "v")
    yield svc
    svc.close()


def test_quarantined_bytes_are_sealed_and_a_tampered_copy_is_refused(service):
    """The bytes are sealed at rest; a flipped byte, or a genuine sealed object moved to
    another import's key, is refused (ObjectCorrupt), never returned."""
    q, vault = service.quarantine, service.vault
    import_id, other = q.open(peer="a", identity=IDENT), q.open(peer="a", identity=IDENT)
    q.put(import_id, "statement", b"plaintext statement bytes")
    assert q.get(import_id, "statement") == b"plaintext statement bytes"
    key = object_key("quarantine", import_id, "statement")
    stored = vault.run(vault.objects.get(key))
    assert b"plaintext" not in bytes(stored)
    vault.run(vault.objects.put_if_absent(object_key("quarantine", other, "statement"), stored))
    with pytest.raises(ObjectCorrupt, match="another object key"):
        q.get(other, "statement")
    tampered = bytes(stored)[:-1] + bytes([stored[-1] ^ 1])
    vault.run(vault.objects.delete(key))
    vault.run(vault.objects.put_if_absent(key, tampered))
    with pytest.raises(ObjectCorrupt, match="seal tag"):
        q.get(import_id, "statement")


def test_import_ids_are_checked_before_anything_is_looked_up_or_deleted(service):
    """An id that is not 32 hex characters never reaches the catalog or the store; a
    drop of an unknown id deletes nothing."""
    q = service.quarantine
    for bad in ("..", "../../chunks", "x" * 5000, "A" * 32, "0" * 31 + "\0"):
        with pytest.raises(BadImportId):
            q.drop(bad)
    import_id = q.open(peer="a", identity=IDENT)
    q.put(import_id, "statement", b"kept")
    assert not q.drop("0" * 32)
    assert q.get(import_id, "statement") == b"kept"


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


def test_admin_api_lists_shows_and_drops_imports_and_runs_gc(service):
    q = service.quarantine
    import_id = q.open(peer="a", identity=IDENT)
    q.refuse(import_id, "truncated planes: received 3 of 9 bytes")
    admin = api_key(service, role="admin", namespace="*")
    tenant = api_key(service, role="tenant", namespace="default")
    with serve(service) as url:
        assert call(url, "GET", "/v1/admin/quarantine", token=tenant)[0] == 403
        status, _, listed = call(url, "GET", "/v1/admin/quarantine?state=refused", token=admin)
        assert status == 200 and [i["import_id"] for i in listed["imports"]] == [import_id]
        status, _, shown = call(url, "GET", f"/v1/admin/quarantine/{import_id}", token=admin)
        assert status == 200 and shown["reason"].startswith("truncated planes")
        assert call(url, "GET", "/v1/admin/quarantine?state=served", token=admin)[0] == 400
        assert call(url, "DELETE", f"/v1/admin/quarantine/{import_id}", token=admin)[0] == 200
        assert call(url, "DELETE", f"/v1/admin/quarantine/{import_id}", token=admin)[0] == 404
        assert call(url, "DELETE", "/v1/admin/quarantine/..", token=admin)[0] == 400
        status, _, report = call(url, "POST", "/v1/admin/gc", token=admin, body={"budget_bytes": 0})
        assert status == 200 and report["quarantine_dropped"] == 0
        assert call(url, "POST", "/v1/admin/gc", token=admin, body={"budget_bytes": -1})[0] == 400
    assert q.list() == []


def test_admin_key_rotation_saves_the_endorsed_key_and_signs_with_it(service, tmp_path):
    path = tmp_path / "v" / "producer-key.json"
    before = service.vault.producer_keys.current_id
    admin = api_key(service, role="admin", namespace="*")
    with serve(service, producer_key_path=path) as url:
        status, _, bundle = call(url, "POST", "/v1/admin/keys/rotate", token=admin)
    assert status == 200
    [first, second] = bundle["keys"]
    assert (first["id"], second["endorsed_by"]) == (before, before)
    assert service.vault.producer_keys.current_id == second["id"]
    assert ProducerKeys.load(path).current_id == second["id"]  # survives a restart
