"""The durable tier against a real vault: one catalog query per lookup; a load reads the
catalog once more only from a remote store (the chunk list it fetches ahead)."""

from __future__ import annotations

import re

import pytest
from sqlalchemy import event

from engine.codec.frame import digest_of
from engine.format import encode
from kvpack.tiers.base import Ask
from kvpack.tiers.durable import CutReader
from tests.engine.slotkit import prompt
from tests.kvpack.service.test_service import ask

P = prompt(300, seed=31)


@pytest.fixture
def service(shared_settings, open_service):
    svc = open_service(shared_settings)
    ask(svc, P)
    assert svc.flush(30)
    return svc


def statements(svc, run):
    seen: list[str] = []

    def record(_conn, _cursor, statement, *_args):
        if not statement.startswith(("BEGIN", "COMMIT", "ROLLBACK")):
            seen.append(statement)

    event.listen(svc.vault.db, "before_cursor_execute", record)
    try:
        result = run()
    finally:
        event.remove(svc.vault.db, "before_cursor_execute", record)
    return result, seen


def test_a_lookup_is_one_catalog_query_and_a_load_reads_at_most_the_chunk_list(service):
    """find is one indexed find_deepest (the exact-needs-logits rule inside it), and
    load opens the manifest the Cut names without reading its row again: from S3 its one
    query is the row's chunk list, which the reader fetches while the manifest is on its
    way; from a local directory it reads the catalog not at all."""
    durable = service.durable
    request = Ask.of(service.tenant("default").scope, P)
    candidate, found = statements(service, lambda: durable.find(request))
    assert candidate is not None and candidate.depth == len(P)
    assert len(found) == 1 and re.search(r"(FROM|JOIN) manifests\b", found[0])
    loaded, during_load = statements(service, lambda: durable.load(candidate, request))
    if service.vault.objects.remote:
        assert len(during_load) == 1 and "FROM manifest_chunks" in during_load[0]
    else:
        assert during_load == []
    assert loaded.manifest_bytes == candidate.handle.bytes
    assert isinstance(loaded.cut, CutReader) and loaded.cut.installed is None
    slot = service.tenant("default").pool.slot(0)
    installed, during_read = statements(service, lambda: slot.restore(loaded.cut, prompt=P))
    assert during_read == []  # the reader reads chunks, never the catalog
    assert loaded.cut.installed is installed
    stored = service.vault.load(candidate.handle, request.scope)  # every chunk, as stored
    assert [(r, bytes(d)) for r, d in encode(installed).parts] == [
        (r, bytes(d)) for r, d in stored.parts
    ]  # the verified bytes, installed
    assert [p.digest for p in installed.parts] == [digest_of(r, d) for r, d in stored.parts]
