"""API keys: who may ask the vault for what (keyword-only queries that never commit).

The caller owns the transaction (`with Session(engine) as s, s.begin(): ...`).

Words:
- API key: one api_keys row: a random id, the SHA-256 of its secret (the secret itself
  is never stored), a role, a namespace and an optional label. Revoking sets
  revoked_at and keeps the row, so an id is never reused.
- token: what a client sends as `Authorization: Bearer <token>`: `kvp_<id>_<secret>`.
  It exists once, in create_key's answer; nobody can read it back.
- role: tenant (completions in its own namespace), peer (the vault-to-vault API of
  another vault), admin (GC, key rotation, quarantine release, every tenant's counters).
- namespace: the tenant namespace the key completes in: the identity's salt, so two
  tenants never share state. "*" (peer and admin keys only) means every namespace.
  Admin keys are global: they act on every tenant (counters, GC, quarantine), so an
  admin key names "*" and no other namespace; a row that says otherwise (written by
  hand, or by a version that allowed it) does not authenticate.
- principal: who a valid, unrevoked token says the caller is (key id, role, namespace).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import exists, insert, select, update
from sqlalchemy.orm import Session

from catalog.models import ApiKeyRow

ROLES = ("tenant", "peer", "admin")
ALL_NAMESPACES = "*"
TOKEN_PREFIX = "kvp_"
MAX_NAMESPACE = 255  # api_keys.namespace's width
MAX_LABEL = 255
_TOKEN = re.compile(r"kvp_([0-9a-f]{16})_([A-Za-z0-9_-]{1,128})")
# Compared against when the key id is unknown, so both paths hash and compare alike.
_DUMMY_HASH = hashlib.sha256(b"kvpack: no such key").hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller a valid token names."""

    key_id: str
    role: str
    namespace: str  # a tenant namespace, or ALL_NAMESPACES


@dataclass(frozen=True, slots=True)
class ApiKey:
    """An API key as listed: everything but its secret (which is not stored anyway)."""

    key_id: str
    role: str
    namespace: str
    label: str | None
    created_at: datetime
    revoked_at: datetime | None


def _secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_token(token: str) -> tuple[str, str] | None:
    """(key id, secret) of a well-formed token; None for anything else."""
    m = _TOKEN.fullmatch(token)
    return (m[1], m[2]) if m else None


def check_key(*, role: str, namespace: str, label: str | None = None) -> None:
    """Raise ValueError naming the field when a key could not be created as asked."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
    if not isinstance(namespace, str) or not namespace.strip():
        raise ValueError(f"namespace must be a non-empty string; got {namespace!r}")
    if len(namespace) > MAX_NAMESPACE:
        raise ValueError(f"namespace must be at most {MAX_NAMESPACE} characters")
    if namespace == ALL_NAMESPACES and role == "tenant":
        raise ValueError(
            f"namespace {ALL_NAMESPACES!r} (every namespace) is for peer and admin keys; "
            "a tenant key names its one namespace"
        )
    if role == "admin" and namespace != ALL_NAMESPACES:
        raise ValueError(
            f"namespace of an admin key must be {ALL_NAMESPACES!r}, not {namespace!r}: admin "
            "keys are global (a tenant key scopes a caller to one namespace)"
        )
    if label is not None and len(label) > MAX_LABEL:
        raise ValueError(f"label must be at most {MAX_LABEL} characters")


def create_key(
    *,
    session: Session,
    role: str,
    namespace: str,
    label: str | None = None,
    now: datetime | None = None,
) -> str:
    """A new key; returns its token, the only time anyone sees it."""
    check_key(role=role, namespace=namespace, label=label)
    key_id, secret = secrets.token_hex(8), secrets.token_urlsafe(32)
    session.execute(
        insert(ApiKeyRow).values(
            id=key_id,
            secret_hash=_secret_hash(secret),
            role=role,
            namespace=namespace,
            label=label,
            created_at=now or datetime.now(UTC),
        )
    )
    return f"{TOKEN_PREFIX}{key_id}_{secret}"


def authenticate(*, session: Session, token: str) -> Principal | None:
    """The principal of a well-formed, known, unrevoked token whose secret matches; else
    None (the caller cannot tell which of these failed)."""
    parsed = parse_token(token)
    if parsed is None:
        return None
    key_id, secret = parsed
    row = session.get(ApiKeyRow, key_id, populate_existing=True)
    # Constant-time, and the same work for an unknown id: the duration says nothing about
    # whether the id exists or how much of the secret matched.
    matched = hmac.compare_digest(row.secret_hash if row else _DUMMY_HASH, _secret_hash(secret))
    if row is None or not matched or row.revoked_at is not None:
        return None
    if row.role == "admin" and row.namespace != ALL_NAMESPACES:
        return None  # admin keys are global; this row is not one this version creates
    return Principal(key_id=row.id, role=row.role, namespace=row.namespace)


def revoke_key(*, session: Session, key_id: str, now: datetime | None = None) -> bool:
    """Revoke a key (its first revocation time is kept); False when no such key exists."""
    if session.get(ApiKeyRow, key_id) is None:
        return False
    session.execute(
        update(ApiKeyRow)
        .where(ApiKeyRow.id == key_id, ApiKeyRow.revoked_at.is_(None))
        .values(revoked_at=now or datetime.now(UTC))
    )
    return True


def list_keys(*, session: Session, namespace: str | None = None) -> list[ApiKey]:
    """Every key (revoked ones too), oldest first; only `namespace`'s when given."""
    k = ApiKeyRow
    query = select(k.id, k.role, k.namespace, k.label, k.created_at, k.revoked_at)
    if namespace is not None:
        query = query.where(k.namespace == namespace)
    rows = session.execute(query.order_by(k.created_at, k.id))
    return [
        ApiKey(
            key_id=r.id,
            role=r.role,
            namespace=r.namespace,
            label=r.label,
            created_at=r.created_at,
            revoked_at=r.revoked_at,
        )
        for r in rows
    ]


def any_active_key(*, session: Session) -> bool:
    """Whether at least one unrevoked key exists (a server with none refuses everyone)."""
    return bool(session.scalar(select(exists().where(ApiKeyRow.revoked_at.is_(None)))))
