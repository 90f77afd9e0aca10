"""Quarantine: where a peer's answer waits while it is checked (docs/architecture.md: step 3).

- import: one answer from one peer: a catalog row (catalog/trust.py) and its bytes
  under the object-store prefix quarantine/<import id>/ (the statement, then the
  planes). The bytes are sealed at rest like everything else in the store (cas/sealed.py:
  the chunk seal, bound to the object key) and are never read back by anything that
  serves requests.
- import id: 32 lowercase hex characters (16 random bytes).
- refused: the row keeps the reason and the bytes stay for inspection (`kvpack
  quarantine show`) until dropped by an operator or aged out by collect().
- promoted: the bytes were copied into the durable tier; the quarantine copy is
  deleted at once, the row stays as a record until collect() ages it out.
"""

from __future__ import annotations

import logging
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from cas.layout import object_key
from catalog import trust
from catalog.ids import IdentityDigest
from catalog.models import QuarantineRow
from kvpack.vault import Vault

log = logging.getLogger(__name__)
NAMES = ("statement", "planes")
DEFAULT_RETENTION = timedelta(days=7)
IMPORT_ID = re.compile(r"[0-9a-f]{32}")


class BadImportId(ValueError):
    """An import id that is not 32 lowercase hex characters (checked before any lookup)."""

    def __init__(self, import_id: str) -> None:
        super().__init__(f"import id must be 32 lowercase hex characters: {import_id!r:.80}")
        self.import_id = import_id


def check_import_id(import_id: str) -> str:
    if not isinstance(import_id, str) or not IMPORT_ID.fullmatch(import_id):
        raise BadImportId(str(import_id))
    return import_id


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

    def to_json(self) -> dict[str, Any]:
        doc = dict(self.__dict__)
        doc["created_at"] = self.created_at.isoformat()
        doc["updated_at"] = self.updated_at.isoformat()
        return doc


class Quarantine:
    def __init__(self, vault: Vault) -> None:
        self.vault = vault

    @staticmethod
    def key(import_id: str, name: str) -> str:
        return object_key("quarantine", check_import_id(import_id), name)

    # -- an import's life ---------------------------------------------------------------

    def open(self, *, peer: str, identity: IdentityDigest) -> str:
        import_id = secrets.token_hex(16)
        with self.vault.transaction() as s:
            trust.open_import(
                session=s, import_id=import_id, peer=peer, identity=identity, now=_now()
            )
        return import_id

    def put(self, import_id: str, name: str, data: bytes | memoryview) -> None:
        self.vault.run(self.vault.sealed.put(self.key(import_id, name), data))

    def get(self, import_id: str, name: str) -> bytes:
        """An import's bytes, opened; ObjectMissing, ObjectCorrupt or UnknownKey otherwise."""
        return self.vault.run(self.vault.sealed.get(self.key(import_id, name)))

    def note(self, import_id: str, **fields: Any) -> None:
        """Record what the answer claims (producer, generation, depth)."""
        with self.vault.transaction() as s:
            trust.update_import(session=s, import_id=import_id, now=_now(), **fields)

    def refuse(self, import_id: str, reason: str) -> None:
        log.warning("remote import %s refused: %s", import_id, reason)
        self.note(import_id, state="refused", reason=reason)

    def promoted(self, import_id: str, manifest: str) -> None:
        self.note(import_id, state="promoted", manifest=manifest, reason=None)
        self._delete_objects(import_id)

    def discard(self, import_id: str) -> None:
        """Forget an import that received nothing worth keeping (the peer had no cut)."""
        with self.vault.transaction() as s:
            trust.delete_import(session=s, import_id=import_id)

    # -- operators ----------------------------------------------------------------------

    def list(self, *, state: str | None = None, limit: int = 100) -> list[ImportRecord]:
        return self.vault.read(
            lambda s: [ImportRecord.of(r) for r in trust.list_imports(session=s, state=state,
                                                                     limit=limit)]
        )  # fmt: skip

    def show(self, import_id: str) -> ImportRecord | None:
        check_import_id(import_id)
        row = self.vault.read(lambda s: trust.get_import(session=s, import_id=import_id))
        return ImportRecord.of(row) if row is not None else None

    def drop(self, import_id: str) -> bool:
        """Delete an import's bytes, then its row; False (nothing deleted) if there is no
        such import. BadImportId before any lookup for an id of the wrong shape."""
        if self.show(import_id) is None:
            return False
        self._delete_objects(import_id)
        with self.vault.transaction() as s:
            return trust.delete_import(session=s, import_id=import_id)

    def collect(
        self, *, retention: timedelta = DEFAULT_RETENTION, now: datetime | None = None
    ) -> int:
        """Drop every import last updated more than `retention` ago; returns how many."""
        before = (now or _now()) - retention
        ids = self.vault.read(lambda s: trust.imports_before(session=s, before=before))
        return sum(self.drop(import_id) for import_id in ids)

    def _delete_objects(self, import_id: str) -> None:
        for name in NAMES:
            self.vault.run(self.vault.sealed.delete(self.key(import_id, name)))


def _now() -> datetime:
    return datetime.now(UTC)
