"""Restores measured inside the server (kvpack/service/restores.py) and GET
/v1/admin/restores: the peak RSS is the restore's own (the high-water mark is reset
before it), each record carries the ladder's seconds and bytes, and only an admin key
reads them."""

from __future__ import annotations

import mmap
import sys

import pytest
from sqlalchemy.orm import Session

from catalog import access
from engine.slots import Slot
from kvpack.server.auth import catalog_authenticator
from kvpack.service.restores import RestoreMeter
from kvpack.service.service import CompletionRequest
from kvpack.tiers.ladder import Installed
from tests.kvpack.serverkit import call, open_tiny_service, running

MIB = 1 << 20
PAGE = mmap.PAGESIZE
linux = pytest.mark.skipif(sys.platform != "linux", reason="peak RSS is read from /proc")


@linux
def test_the_peak_is_the_restores_own_and_misses_are_not_recorded():
    """A restore that touches 64 MiB and frees them records a peak of at least that above
    its starting RSS; the next restore, touching nothing, records far less (the mark was
    reset, not carried over); a miss and a session continuation leave no record. Seconds,
    bytes, tier and depth are the Installed receipt's."""
    meter = RestoreMeter()
    slot = object.__new__(Slot)  # never touched: the meter reads only the receipt

    def restore_touching(nbytes: int) -> Installed:
        if nbytes:  # fresh anonymous pages: memory the allocator kept could be reused
            with mmap.mmap(-1, nbytes) as scratch:
                scratch[::PAGE] = b"\x01" * (nbytes // PAGE)  # touch every page
        return Installed(slot, "durable", 512, restore_seconds=0.25, restore_bytes=3 * MIB)

    meter.measure(lambda: restore_touching(64 * MIB))
    meter.measure(lambda: restore_touching(0))
    meter.measure(lambda: Installed(slot, "none", 0))
    meter.measure(lambda: Installed(slot, "session", 512))
    big, small = meter.records()
    assert (big.tier, big.depth, big.seconds, big.bytes) == ("durable", 512, 0.25, 3 * MIB)
    # the kernel batches RSS counts per thread (up to 64 pages behind): 63, not 64, MiB
    assert big.peak_rss_added >= 63 * MIB > 4 * small.peak_rss_added
    assert big.rss_before > 0


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    svc = open_tiny_service(tmp_path_factory.mktemp("vault"))
    svc.restores = RestoreMeter()
    yield svc
    svc.close()


def key(service, role: str) -> str:
    with Session(service.vault.db) as s, s.begin():
        return access.create_key(session=s, role=role, namespace="*" if role != "tenant"
                                 else service.loaded.identity.namespace)  # fmt: skip


def test_the_route_lists_restores_to_admin_keys_only(measured):
    """A resident hit is recorded with the completion's restore seconds and the resident
    estimate of its bytes (the cold miss is not); GET /v1/admin/restores answers an admin
    key with the records, a tenant key 403, no key 401."""
    tokens = measured.loaded.tokenizer.encode("The harbor board met at dawn. " * 20)
    req = CompletionRequest(tokens=tokens, max_tokens=2)
    measured.complete(req)  # cold: publishes
    assert measured.flush(timeout=60)
    hit = measured.complete(req)  # the slot holds decoded tokens too: not a continuation
    assert hit.tier == "resident"
    (record,) = measured.restores.records()
    assert record.tier == "resident" and record.depth == hit.cached_tokens
    assert record.seconds == hit.restore_seconds and record.bytes > 0

    with running(measured, authenticate=catalog_authenticator(measured.vault.db)) as url:
        status, _, body = call(url, "GET", "/v1/admin/restores", token=key(measured, "admin"))
        assert status == 200 and body["restores"] == [record.to_json()]
        status, _, _ = call(url, "GET", "/v1/admin/restores", token=key(measured, "tenant"))
        assert status == 403
        status, _, _ = call(url, "GET", "/v1/admin/restores")
        assert status == 401


def test_a_server_that_does_not_measure_answers_404(tiny_service):
    with running(tiny_service) as url:  # anonymous: an admin
        status, _, body = call(url, "GET", "/v1/admin/restores")
    assert status == 404 and "--measure-restores" in body["error"]["message"]
