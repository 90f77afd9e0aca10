"""API keys (catalog/access.py) on SQLite and PostgreSQL (savepoint per test)."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from catalog import access
from catalog.access import Principal
from catalog.models import ApiKeyRow

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def create(session, role="tenant", namespace="acme", **kw) -> str:
    return access.create_key(session=session, role=role, namespace=namespace, **kw)


def login(session, token: str) -> Principal | None:
    return access.authenticate(session=session, token=token)


def test_a_token_names_its_key_and_only_a_hash_of_its_secret_is_stored(db_session):
    """Branch: create -> `kvp_<16 hex id>_<secret>`; the row holds SHA-256(secret) and no
    column holds the secret; the token authenticates as the key's role and namespace."""
    token = create(db_session, label="acme prod")
    key_id, secret = access.parse_token(token)
    assert token == f"kvp_{key_id}_{secret}" and len(key_id) == 16 and len(secret) >= 43
    row = db_session.get(ApiKeyRow, key_id)
    assert row.secret_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in {row.id, row.secret_hash, row.role, row.namespace, row.label}
    assert login(db_session, token) == Principal(key_id=key_id, role="tenant", namespace="acme")
    assert create(db_session) != token  # every key its own id and secret


@pytest.mark.parametrize(
    "mangle",
    [
        lambda t: t[:-1] + ("A" if t[-1] != "A" else "B"),  # wrong secret, real id
        lambda t: "kvp_" + "0" * 16 + t[20:],  # unknown id, real secret
        lambda t: t.replace("kvp_", "kvq_"),  # wrong prefix
        lambda t: t[: len("kvp_") + 16],  # no secret
        lambda t: t + " ",  # trailing junk
        lambda t: "",
    ],
)
def test_a_wrong_or_malformed_token_authenticates_as_nobody(db_session, mangle):
    """Branches: a well-formed token with a wrong secret (hash comparison), an unknown id,
    and malformed tokens all give None; the real token still works."""
    token = create(db_session)
    assert login(db_session, mangle(token)) is None
    assert login(db_session, token) is not None


def test_a_revoked_key_authenticates_as_nobody_and_keeps_its_row(db_session):
    """Branch: revoke -> None from then on; revoking again keeps the first time; an
    unknown id is reported (False); other keys are untouched."""
    token, other = create(db_session), create(db_session, namespace="zeta")
    key_id, _ = access.parse_token(token)
    assert access.revoke_key(session=db_session, key_id=key_id, now=T0)
    assert login(db_session, token) is None
    assert login(db_session, other) is not None
    assert access.revoke_key(session=db_session, key_id=key_id, now=T0 + timedelta(days=1))
    assert db_session.get(ApiKeyRow, key_id, populate_existing=True).revoked_at == T0
    assert not access.revoke_key(session=db_session, key_id="f" * 16)


def test_list_shows_every_key_without_secrets_oldest_first(db_session):
    """Branch: list_keys returns revoked keys too, oldest first, filtered by namespace when
    asked, and its items carry no secret or hash."""
    db_session.execute(ApiKeyRow.__table__.delete())  # the listing is global: start empty
    first = create(db_session, role="admin", namespace="*", label="ops", now=T0)
    second = create(db_session, now=T0 + timedelta(seconds=1))
    access.revoke_key(session=db_session, key_id=access.parse_token(second)[0], now=T0)
    keys = access.list_keys(session=db_session)
    assert [k.key_id for k in keys] == [access.parse_token(t)[0] for t in (first, second)]
    listed = [(k.role, k.namespace, k.label) for k in keys]
    assert listed == [("admin", "*", "ops"), ("tenant", "acme", None)]
    assert keys[0].revoked_at is None and keys[1].revoked_at == T0
    assert not any(hasattr(k, "secret_hash") or hasattr(k, "secret") for k in keys)
    assert [k.role for k in access.list_keys(session=db_session, namespace="acme")] == ["tenant"]


def test_any_active_key_ignores_revoked_keys(db_session):
    """Branch: no key, or only revoked ones -> False; one unrevoked key -> True."""
    db_session.execute(ApiKeyRow.__table__.delete())
    assert not access.any_active_key(session=db_session)
    token = create(db_session)
    assert access.any_active_key(session=db_session)
    access.revoke_key(session=db_session, key_id=access.parse_token(token)[0])
    assert not access.any_active_key(session=db_session)


@pytest.mark.parametrize(
    ("role", "namespace", "label", "field"),
    [
        ("root", "acme", None, "role"),
        ("tenant", "", None, "namespace"),
        ("tenant", "   ", None, "namespace"),
        ("tenant", "n" * 256, None, "namespace"),
        ("tenant", "*", None, "namespace"),  # a tenant key names one namespace
        ("admin", "acme", None, "namespace"),  # admin keys are global
        ("admin", "*", "l" * 256, "label"),
    ],
)
def test_a_bad_key_is_refused_naming_the_field(db_session, role, namespace, label, field):
    """Branch: each bad argument -> ValueError whose message starts with its field; no row."""
    before = db_session.scalars(select(ApiKeyRow.id)).all()
    with pytest.raises(ValueError, match=f"^{field} "):
        create(db_session, role=role, namespace=namespace, label=label)
    assert db_session.scalars(select(ApiKeyRow.id)).all() == before


def test_every_namespace_is_for_peer_and_admin_keys(db_session):
    """Branch: "*" is accepted for peer and admin keys and comes back as their namespace."""
    for role in ("peer", "admin"):
        token = create(db_session, role=role, namespace="*")
        assert login(db_session, token).namespace == "*"


def test_an_admin_row_scoped_to_one_namespace_does_not_authenticate(db_session):
    """Branch: a row saying admin of "acme" (written by hand, or by an older version) is
    refused: admin keys act on every tenant, so a scoped one would be a false promise."""
    token = create(db_session, role="peer", namespace="acme")
    row = db_session.get(ApiKeyRow, access.parse_token(token)[0])
    row.role = "admin"
    db_session.flush()
    assert login(db_session, token) is None


def test_an_unknown_key_id_costs_the_same_work_as_a_known_one(db_session, monkeypatch):
    """Branch: unknown id vs known id with a wrong secret: each hashes the secret once and
    compares once, so the answer's timing does not say whether the id exists."""
    token = create(db_session)
    key_id, _ = access.parse_token(token)
    calls: list[str] = []
    real_hash, real_compare = access._secret_hash, access.hmac.compare_digest
    monkeypatch.setattr(access, "_secret_hash", lambda s: calls.append("hash") or real_hash(s))
    monkeypatch.setattr(
        access.hmac, "compare_digest", lambda a, b: calls.append("compare") or real_compare(a, b)
    )
    for probe in (f"kvp_{key_id}_wrongsecret", "kvp_0123456789abcdef_wrongsecret"):
        calls.clear()
        assert login(db_session, probe) is None
        assert calls == ["hash", "compare"], probe
