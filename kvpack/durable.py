"""The durable tier as the service sees it: object store + SQL catalog, the sole authority.

- IoLoop: one asyncio loop on a background thread. Every cas/ call (aiobotocore clients
  are bound to the loop that made them) runs there; the service thread blocks on
  `IoLoop.run(coro, timeout)`.
- DurableTier: the catalog engine, the object store, the keyring, this vault's producer
  id and one ChunkStore per tenant namespace (chunk ids are keyed per namespace). Its
  calls are synchronous; each raises the catalog's and cas's typed errors unchanged, so
  the ladder decides what is a verification failure and what is an outage.
- producer: a stable name for this vault, kept in `<data dir>/producer-id`; its Ed25519
  keys (catalog/signing.py) sign every manifest envelope the tier seals.
- catalog schema: `upgrade_catalog` runs Alembic `upgrade head` when the service opens,
  for the embedded SQLite default and for external URLs alike (the service never calls
  create_all).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

from alembic import command
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from cas.chunks import ChunkStore
from cas.keys import Keyring
from cas.store import ObjectStore
from catalog import ledger, queries
from catalog.chain import TokenChain
from catalog.gc import GcReport, collect
from catalog.manifest import Manifest
from catalog.models import ManifestRow
from catalog.publish import LoadedCut, load_cut, publish
from catalog.queries import Cut, find_deepest, record_hit
from catalog.signing import MANIFEST_DOMAIN, Bundle, ProducerKeys
from engine.identity import Identity
from migrations import alembic_config

T = TypeVar("T")
GC_NAMESPACE = "gc"  # any namespace: GC only deletes chunks by id


def upgrade_catalog(database_url: str) -> None:
    """Bring the catalog schema to head (idempotent; a no-op when already there)."""
    config = alembic_config(database_url)
    config.attributes["configure_logging"] = False
    command.upgrade(config, "head")


class IoLoop:
    """An asyncio loop running on its own daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvpack-io", daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T], timeout: float | None) -> T:
        """Run `coro` on the loop; TimeoutError (and cancellation) past `timeout` seconds."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class DurableTier:
    def __init__(
        self,
        *,
        db: Engine,
        objects: ObjectStore,
        keyring: Keyring,
        alignment: int,
        producer_keys: ProducerKeys,
        io: IoLoop,
        timeout_s: float,
    ) -> None:
        self.db = db
        self.objects = objects
        self.keyring = keyring
        self.alignment = alignment
        self.producer_keys = producer_keys
        self.producer = producer_keys.producer
        self.io = io
        self.timeout_s = timeout_s
        self._chunks: dict[str, ChunkStore] = {}
        self._lock = threading.Lock()

    def chunks(self, namespace: str) -> ChunkStore:
        with self._lock:
            store = self._chunks.get(namespace)
            if store is None:
                store = self._chunks[namespace] = ChunkStore(
                    self.objects, self.keyring, namespace=namespace
                )
            return store

    def deepest(self, *, identity: bytes, chain: TokenChain) -> Cut | None:
        """The deepest cut that can serve this prompt: an exact cut only with witnessed
        logits (invariant 3), else the deepest aligned ancestor below it."""
        with Session(self.db) as session:
            cut = find_deepest(session=session, identity=identity, chain=chain)
            if cut is not None and cut.exact and not cut.logits_witnessed:
                cut = find_deepest(
                    session=session, identity=identity, chain=chain, max_depth=cut.depth - 1
                )
            return cut

    def load(self, *, namespace: str, identity: bytes, cut: Cut) -> LoadedCut:
        """The cut's manifest and planes, every chunk fetched concurrently and verified."""
        coro = load_cut(
            chunks=self.chunks(namespace),
            db=self.db,
            keyring=self.keyring,
            cut=cut,
            identity=identity,
        )
        return self.io.run(coro, self.timeout_s)

    def publish(
        self,
        *,
        namespace: str,
        identity: Identity,
        tokens: Sequence[int],
        layout: dict,
        parts: Sequence[tuple[str, bytes | memoryview]],
        logits_witnessed: bool,
        producer: str | None = None,
        provenance: str = "local",
    ) -> Manifest:
        """Publish the cut after `tokens` (idempotent: the same history is one manifest).
        A promoted remote import names its producer and its provenance ("peer:<name>");
        this vault's key signs every envelope it seals either way."""
        coro = publish(
            chunks=self.chunks(namespace),
            db=self.db,
            keyring=self.keyring,
            identity=identity.digest,
            identity_components=identity.components,
            tokens=tokens,
            alignment=self.alignment,
            planes=parts,
            layout=layout,
            logits_witnessed=logits_witnessed,
            producer=producer or self.producer,
            provenance=provenance,
            sign=lambda body: self.producer_keys.sign(MANIFEST_DOMAIN, body),
        )
        return self.io.run(coro, self.timeout_s)

    def manifest_row(self, manifest_id: str) -> ManifestRow | None:
        with Session(self.db) as session:
            return queries.get_manifest_row(session=session, manifest_id=manifest_id)

    def identity_components(self, identity: bytes) -> dict | None:
        with Session(self.db) as session:
            return queries.identity_components(session=session, identity=identity)

    def collect(self, *, budget_bytes: int | None, grace: timedelta) -> GcReport:
        """GC (catalog/gc.py): evict down to `budget_bytes`, then reclaim unreferenced
        chunks older than `grace`. Chunk object keys do not depend on the namespace."""
        coro = collect(
            chunks=self.chunks(GC_NAMESPACE), db=self.db, budget_bytes=budget_bytes, grace=grace
        )
        return self.io.run(coro, None)

    def rotate_producer_key(self, path: Path) -> Bundle:
        """A new signing key endorsed by the current one, saved to `path` before use."""
        keys = self.producer_keys.rotate()
        keys.save(path)
        self.producer_keys = keys
        return keys.bundle()

    def record_hit(self, manifest_id: str) -> None:
        with Session(self.db) as session, session.begin():
            record_hit(session=session, manifest_id=manifest_id)

    def record_pair(self, entry: ledger.LedgerEntry) -> None:
        with Session(self.db) as session, session.begin():
            ledger.insert_entry(session=session, entry=entry)

    def ledger(self, identities: Sequence[bytes]) -> list[ledger.LedgerEntry]:
        with Session(self.db) as session:
            return ledger.entries(session=session, identities=identities)

    def close(self) -> None:
        try:
            self.io.run(self.objects.aclose(), self.timeout_s)
        finally:
            self.io.close()
            self.db.dispose()
