"""Catalog queries for remote trust: trusted producer keys, accepted generations and
quarantine rows. Keyword-only; they never commit (the caller owns the transaction).

Words:
- trusted key: a producer public key whose signatures a remote import accepts.
  Pinned by an operator (`kvpack keys trust`) or endorsed by a key already trusted.
  A revoked key keeps its row (revoked_at) so an endorsement cannot bring it back.
- accepted generation: the newest statement generation accepted per producer and
  identity; accept_generation is one compare-and-set, so two importers racing on
  the same producer and identity cannot both accept the same or an older one.
- import: one quarantine row. States: pending (bytes arriving or being checked),
  refused (with its reason; never served), promoted (copied into the durable tier).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from catalog.ids import IdentityDigest
from catalog.models import AcceptedGenerationRow, QuarantineRow, TrustedKeyRow
from catalog.queries import affected_rows, dialect_insert
from catalog.signing import Bundle

STATES = ("pending", "refused", "promoted")


class KeyConflict(ValueError):
    """A key id is already trusted for this producer with a different public key."""


# -- trusted keys ----------------------------------------------------------------------


def trust_keys(
    *,
    session: Session,
    producer: str,
    keys: Sequence[tuple[str, bytes, str | None]],
    now: datetime,
) -> list[str]:
    """Trust (key id, public key, endorsed by) for `producer`; returns the ids added.
    A revoked key stays revoked: trusting it again needs `untrust` undone by hand."""
    added = []
    for kid, public, endorsed_by in keys:
        row = session.get(TrustedKeyRow, (producer, kid))
        if row is not None:
            if row.public_key != public.hex():
                raise KeyConflict(f"key {kid} of {producer!r} is trusted with another public key")
            continue
        session.add(
            TrustedKeyRow(
                producer=producer,
                key_id=kid,
                public_key=public.hex(),
                endorsed_by=endorsed_by,
                added_at=now,
            )
        )
        added.append(kid)
    session.flush()
    return added


def trusted_keys(*, session: Session, producer: str) -> dict[str, bytes]:
    """Unrevoked key id -> public key for `producer`."""
    rows = session.scalars(
        select(TrustedKeyRow).where(
            TrustedKeyRow.producer == producer, TrustedKeyRow.revoked_at.is_(None)
        )
    )
    return {r.key_id: bytes.fromhex(r.public_key) for r in rows}


def key_owner(*, session: Session, key_id: str) -> tuple[str, bytes] | None:
    """(producer, public key) of an unrevoked trusted key id. Ids are digests of the
    public key, so one id names one key whichever producer listed it."""
    row = session.scalars(
        select(TrustedKeyRow)
        .where(TrustedKeyRow.key_id == key_id, TrustedKeyRow.revoked_at.is_(None))
        .limit(1)
    ).first()
    return None if row is None else (row.producer, bytes.fromhex(row.public_key))


def trust_bundle(*, session: Session, bundle: Bundle, now: datetime) -> list[str]:
    """Pin every key of a checked bundle (the operator trusts this producer)."""
    bundle.check()
    keys = [(k.id, k.public, k.endorsed_by) for k in bundle.keys]
    return trust_keys(session=session, producer=bundle.producer, keys=keys, now=now)


def known_key_ids(*, session: Session, producer: str) -> set[str]:
    """Every key id on record for `producer`, revoked ones included."""
    return set(
        session.scalars(select(TrustedKeyRow.key_id).where(TrustedKeyRow.producer == producer))
    )


def revoke_keys(*, session: Session, producer: str, key_id: str | None, now: datetime) -> list[str]:
    """Revoke one key of `producer`, or all of them (key_id None); returns the ids."""
    query = select(TrustedKeyRow).where(
        TrustedKeyRow.producer == producer, TrustedKeyRow.revoked_at.is_(None)
    )
    if key_id is not None:
        query = query.where(TrustedKeyRow.key_id == key_id)
    rows = list(session.scalars(query))
    for r in rows:
        r.revoked_at = now
    session.flush()
    return [r.key_id for r in rows]


def all_trusted(*, session: Session) -> list[TrustedKeyRow]:
    return list(
        session.scalars(
            select(TrustedKeyRow).order_by(TrustedKeyRow.producer, TrustedKeyRow.added_at)
        )
    )


# -- generations -----------------------------------------------------------------------


def accepted_generation(*, session: Session, producer: str, identity: IdentityDigest) -> int | None:
    return session.scalar(
        select(AcceptedGenerationRow.generation).where(
            AcceptedGenerationRow.producer == producer,
            AcceptedGenerationRow.identity == identity.hex,
        )
    )


def accept_generation(
    *, session: Session, producer: str, identity: IdentityDigest, generation: int, now: datetime
) -> bool:
    """Record `generation` as the newest accepted; False (nothing written) unless it is
    strictly newer than the one on record."""
    values = {"producer": producer, "identity": identity.hex}
    inserted = session.execute(
        dialect_insert(session, AcceptedGenerationRow)
        .values(**values, generation=generation, accepted_at=now)
        .on_conflict_do_nothing(index_elements=["producer", "identity"])
        .returning(AcceptedGenerationRow.generation)
    ).scalar_one_or_none()
    if inserted is not None:
        return True
    changed = affected_rows(
        session,
        update(AcceptedGenerationRow)
        .where(
            AcceptedGenerationRow.producer == producer,
            AcceptedGenerationRow.identity == identity.hex,
            AcceptedGenerationRow.generation < generation,
        )
        .values(generation=generation, accepted_at=now),
    )
    return changed == 1


# -- quarantine ------------------------------------------------------------------------


def open_import(
    *, session: Session, import_id: str, peer: str, identity: IdentityDigest, now: datetime
) -> None:
    session.add(
        QuarantineRow(
            import_id=import_id,
            peer=peer,
            identity=identity.hex,
            state="pending",
            created_at=now,
            updated_at=now,
        )
    )


def update_import(*, session: Session, import_id: str, now: datetime, **fields: Any) -> None:
    state = fields.get("state")
    if state is not None and state not in STATES:
        raise ValueError(f"quarantine state must be one of {STATES}, not {state!r}")
    session.execute(
        update(QuarantineRow)
        .where(QuarantineRow.import_id == import_id)
        .values(**fields, updated_at=now)
    )


def get_import(*, session: Session, import_id: str) -> QuarantineRow | None:
    return session.get(QuarantineRow, import_id)


def list_imports(
    *, session: Session, state: str | None = None, limit: int = 100
) -> list[QuarantineRow]:
    query = select(QuarantineRow).order_by(QuarantineRow.created_at.desc()).limit(limit)
    if state is not None:
        query = query.where(QuarantineRow.state == state)
    return list(session.scalars(query))


def imports_before(*, session: Session, before: datetime, limit: int = 500) -> list[str]:
    """Import ids last updated before `before` (GC: every state ages out of quarantine)."""
    return list(
        session.scalars(
            select(QuarantineRow.import_id)
            .where(QuarantineRow.updated_at < before)
            .order_by(QuarantineRow.updated_at)
            .limit(limit)
        )
    )


def delete_import(*, session: Session, import_id: str) -> bool:
    statement = delete(QuarantineRow).where(QuarantineRow.import_id == import_id)
    return affected_rows(session, statement) == 1
