"""Trusted keys, accepted generations and quarantine rows, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from catalog import trust
from catalog.ids import IdentityDigest
from catalog.signing import ProducerKeys

NOW = datetime(2026, 11, 30, tzinfo=UTC)
IDENT = IdentityDigest(b"\7" * 32)


def test_generations_are_accepted_only_strictly_newer(db_session):
    def accept(producer, generation, identity=IDENT):
        return trust.accept_generation(
            session=db_session, producer=producer, identity=identity, generation=generation,
            now=NOW,
        )  # fmt: skip

    assert accept("a", 10)
    assert not accept("a", 10)  # a replay
    assert not accept("a", 9)  # stale
    assert accept("a", 11)
    assert accept("b", 5)  # per producer
    assert accept("a", 1, identity=IdentityDigest(b"\x08" * 32))  # and per identity
    assert accept("a", 2**63 - 1)
    assert not accept("a", 2**63 - 1)
    got = trust.accepted_generation(session=db_session, producer="a", identity=IDENT)
    assert got == 2**63 - 1


def test_trusted_keys_pin_revoke_and_never_change_under_an_id(db_session):
    keys = ProducerKeys.generate("vault-a").rotate()
    bundle = keys.bundle()
    added = trust.trust_bundle(session=db_session, bundle=bundle, now=NOW)
    assert added == [k.id for k in bundle.keys]
    assert trust.trust_bundle(session=db_session, bundle=bundle, now=NOW) == []  # idempotent
    first = bundle.keys[0]
    assert trust.key_owner(session=db_session, key_id=first.id) == ("vault-a", first.public)
    with pytest.raises(trust.KeyConflict):
        trust.trust_keys(
            session=db_session, producer="vault-a", keys=[(first.id, b"\0" * 32, None)], now=NOW
        )
    assert trust.revoke_keys(session=db_session, producer="vault-a", key_id=first.id, now=NOW) == [
        first.id
    ]
    assert trust.key_owner(session=db_session, key_id=first.id) is None
    assert set(trust.trusted_keys(session=db_session, producer="vault-a")) == {bundle.keys[1].id}
    # Trusting the bundle again does not bring a revoked key back.
    trust.trust_bundle(session=db_session, bundle=bundle, now=NOW)
    assert trust.key_owner(session=db_session, key_id=first.id) is None
    assert first.id in trust.known_key_ids(session=db_session, producer="vault-a")


def test_quarantine_rows_move_through_their_states_and_age_out(db_session):
    trust.open_import(session=db_session, import_id="i1", peer="a", identity=IDENT, now=NOW)
    trust.open_import(
        session=db_session, import_id="i2", peer="a", identity=IDENT, now=NOW + timedelta(days=2)
    )
    trust.update_import(session=db_session, import_id="i1", now=NOW, state="refused",
                        reason="bad")  # fmt: skip
    with pytest.raises(ValueError, match="state"):
        trust.update_import(session=db_session, import_id="i1", now=NOW, state="served")
    [row] = trust.list_imports(session=db_session, state="refused")
    assert (row.import_id, row.reason) == ("i1", "bad")
    assert trust.imports_before(session=db_session, before=NOW + timedelta(days=1)) == ["i1"]
    assert trust.delete_import(session=db_session, import_id="i1")
    assert not trust.delete_import(session=db_session, import_id="i1")
