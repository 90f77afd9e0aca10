"""Quarantine: where a peer's answer waits while it is checked (DESIGN flow step 2).

- import: one answer from one peer: a catalog row (catalog/trust.py) and its bytes
  under the object-store prefix quarantine/<import id>/ (the statement, then the
  planes). The bytes are sealed at rest like everything else in the store
  (AES-256-GCM-SIV under the vault key, purpose "quarantine-seal", the object key
  as associated data) and are never read back by anything that serves requests.
- refused: the row keeps the reason and the bytes stay for inspection (`kvpack
  quarantine show`) until dropped by an operator or aged out by collect().
- promoted: the bytes were copied into the durable tier; the quarantine copy is
  deleted at once, the row stays as a record until collect() ages it out.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCMSIV
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from cas.keys import Keyring
from cas.layout import object_key
from cas.store import ObjectStore
from catalog import trust
from catalog.models import QuarantineRow
from kvpack.durable import IoLoop

log = logging.getLogger(__name__)
PURPOSE = "quarantine-seal"
NAMES = ("statement", "planes")
NONCE_SIZE = 12
DEFAULT_RETENTION = timedelta(days=7)


@dataclass(frozen=True)
class ImportRecord:
    import_id: str
    peer: str
    identity: str
    producer: str | None
    generation: int | None
    depth: int | None
    state: str
    reason: str | None
    manifest: str | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def of(cls, row: QuarantineRow) -> ImportRecord:
        return cls(**{f: getattr(row, f) for f in cls.__dataclass_fields__})

    def to_json(self) -> dict:
        doc = dict(self.__dict__)
        doc["created_at"] = self.created_at.isoformat()
        doc["updated_at"] = self.updated_at.isoformat()
        return doc


class Quarantine:
    def __init__(
        self, *, db: Engine, objects: ObjectStore, keyring: Keyring, io: IoLoop, timeout_s: float
    ) -> None:
        self.db = db
        self.objects = objects
        self.keyring = keyring
        self.io = io
        self.timeout_s = timeout_s

    def _key(self, import_id: str, name: str) -> str:
        return object_key("quarantine", import_id, name)

    # -- an import's life ---------------------------------------------------------------

    def open(self, *, peer: str, identity: bytes) -> str:
        import_id = secrets.token_hex(16)
        with Session(self.db) as s, s.begin():
            trust.open_import(
                session=s, import_id=import_id, peer=peer, identity=identity, now=_now()
            )
        return import_id

    def put(self, import_id: str, name: str, data: bytes) -> None:
        key = self._key(import_id, name)
        key_id, secret = self.keyring.subkey(PURPOSE)
        nonce = secrets.token_bytes(NONCE_SIZE)
        kid = key_id.encode()
        sealed = (
            bytes([len(kid)]) + kid + nonce + AESGCMSIV(secret).encrypt(nonce, data, key.encode())
        )
        self.io.run(self.objects.put_if_absent(key, sealed), self.timeout_s)

    def get(self, import_id: str, name: str) -> bytes:
        """An import's bytes, opened; ValueError if they fail their seal."""
        key = self._key(import_id, name)
        sealed = bytes(self.io.run(self.objects.get(key), self.timeout_s))
        kid_len = sealed[0]
        _, secret = self.keyring.subkey(PURPOSE, sealed[1 : 1 + kid_len].decode())
        nonce = sealed[1 + kid_len : 1 + kid_len + NONCE_SIZE]
        try:
            return AESGCMSIV(secret).decrypt(
                nonce, sealed[1 + kid_len + NONCE_SIZE :], key.encode()
            )
        except InvalidTag:
            raise ValueError(f"quarantined object {key} fails its seal") from None

    def note(self, import_id: str, **fields) -> None:
        """Record what the answer claims (producer, generation, depth)."""
        with Session(self.db) as s, s.begin():
            trust.update_import(session=s, import_id=import_id, now=_now(), **fields)

    def refuse(self, import_id: str, reason: str) -> None:
        log.warning("remote import %s refused: %s", import_id, reason)
        self.note(import_id, state="refused", reason=reason)

    def promoted(self, import_id: str, manifest: str) -> None:
        self.note(import_id, state="promoted", manifest=manifest, reason=None)
        self._delete_objects(import_id)

    def discard(self, import_id: str) -> None:
        """Forget an import that received nothing worth keeping (the peer had no cut)."""
        with Session(self.db) as s, s.begin():
            trust.delete_import(session=s, import_id=import_id)

    # -- operators ----------------------------------------------------------------------

    def list(self, *, state: str | None = None, limit: int = 100) -> list[ImportRecord]:
        with Session(self.db) as s:
            return [
                ImportRecord.of(r) for r in trust.list_imports(session=s, state=state, limit=limit)
            ]

    def show(self, import_id: str) -> ImportRecord | None:
        with Session(self.db) as s:
            row = trust.get_import(session=s, import_id=import_id)
            return ImportRecord.of(row) if row is not None else None

    def drop(self, import_id: str) -> bool:
        """Delete an import's bytes, then its row; False if there was no such import."""
        self._delete_objects(import_id)
        with Session(self.db) as s, s.begin():
            return trust.delete_import(session=s, import_id=import_id)

    def collect(
        self, *, retention: timedelta = DEFAULT_RETENTION, now: datetime | None = None
    ) -> int:
        """Drop every import last updated more than `retention` ago; returns how many."""
        before = (now or _now()) - retention
        with Session(self.db) as s:
            ids = trust.imports_before(session=s, before=before)
        for import_id in ids:
            self.drop(import_id)
        return len(ids)

    def _delete_objects(self, import_id: str) -> None:
        for name in NAMES:
            self.io.run(self.objects.delete(self._key(import_id, name)), self.timeout_s)


def _now() -> datetime:
    return datetime.now(UTC)
