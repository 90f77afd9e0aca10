"""The durable tier against a real vault: one catalog query per lookup, which from a
remote store also brings the chunk list the reader fetches ahead; a load reads the
catalog again only for a cut that did not come from a lookup."""

from __future__ import annotations

import dataclasses
import re

import pytest
from sqlalchemy import event

from catalog.opened import OpenedManifests
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


def test_a_lookup_is_one_catalog_call_and_a_load_reads_the_catalog_no_more(service):
    """find is one indexed find_deepest (the exact-needs-logits rule inside it) that,
    from S3 (with PostgreSQL), also brings the found row's chunk list, which the reader
    fetches while the manifest is on its way; load opens the manifest the Cut names
    without reading the catalog again. A Cut that did not come from find (get_cut's)
    costs a remote load the list's query, unless the vault holds its manifest opened
    (catalog/opened.py): the manifest lists the chunks."""
    durable = service.durable
    request = Ask.of(service.tenant("default").scope, P)
    candidate, found = statements(service, lambda: durable.find(request))
    assert candidate is not None and candidate.depth == len(P)
    assert len(found) == 1 and re.search(r"(FROM|JOIN) manifests\b", found[0])
    remote = service.vault.objects.remote
    if remote:
        manifest = service.vault.open_cut(candidate.handle, request.scope).manifest
        assert "FROM manifest_chunks" in found[0]
        assert candidate.handle.chunks == tuple((r.id.hex, r.size) for r in manifest.chunk_refs)
    else:
        assert candidate.handle.chunks is None
    loaded, during_load = statements(service, lambda: durable.load(candidate, request))
    assert during_load == []
    loaded.close()
    bare = dataclasses.replace(
        candidate, handle=service.vault.get_cut(candidate.handle.manifest_id)
    )
    assert bare.handle == candidate.handle and bare.handle.chunks is None
    assert bare.handle.object_key in service.vault.opened
    reread, during_held = statements(service, lambda: durable.load(bare, request))
    reread.close()
    assert during_held == []
    service.vault.opened = OpenedManifests()  # as after a restart
    reread, during_bare = statements(service, lambda: durable.load(bare, request))
    reread.close()
    if remote:
        assert len(during_bare) == 1 and "FROM manifest_chunks" in during_bare[0]
    else:
        assert during_bare == []
    loaded = durable.load(candidate, request)
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
