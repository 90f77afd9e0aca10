"""The vault: the durable side of kvpack, opened once from the settings.

- Vault: the catalog (SQLAlchemy engine), the object store, the vault keyring, this
  vault's producer keys (which sign every manifest it seals and every statement it
  exports) and the IoLoop every storage coroutine runs on. `kvpack serve`, the operator
  commands and the tests open it the same way (`Vault.open(settings)`); its methods are
  synchronous and raise cas's and catalog's typed errors unchanged, so callers decide
  what is a verification failure and what is an outage.
- chunk store: one per tenant namespace (chunk ids are keyed per namespace).
- opening migrates the catalog to head (Alembic), for the embedded SQLite default and
  for an external database alike; the service never calls create_all.
- catalog breaker: reads and transactions go through a circuit breaker (cas/breaker.py):
  after a call the catalog did not answer (catalog/db.py's timeouts) it is skipped for a
  backoff window (CatalogUnavailable, at once) until a probe is answered, so a catalog
  outage costs a request a recompute, not a timeout each time.
- reads: one Reader (catalog/db.py): a lookup is one statement's round trip on a reused
  connection (PostgreSQL: autocommit, no pre-ping), retried once on a fresh connection
  when the pooled one had died (PostgreSQL restarted, a proxy cut it).
- readiness: check_catalog and check_store ask each dependency one cheap question.
- reading a cut (read_cut): from a remote store, the manifest object and the chunks its
  catalog row lists are fetched at once, so a durable restore waits one round trip
  before its bytes flow, not two; the chunks open only into destinations the engine
  hands over once the manifest verified and named the same chunks. Measured
  (`benchmarks/restore_phases.py --depth 256 --s3 --latency-ms 20`: SeaweedFS, 20 ms
  added to every store read), a restore's phases took 72.9 / 74.9 ms before, 47.8 /
  49.1 ms after; on loopback without the delay, within the noise. On a local directory
  early reads only slowed the manifest's open (2,048 tokens: 0.7–0.8 → 3.4–6.1 ms), so
  there the chunks follow it.
- the chunk list comes with the lookup: from a remote store, find's one statement
  brings the found cut's list too, so no catalog call stands between a restore's start
  and its first chunk read.
- opened manifests (`opened`, catalog/opened.py): every manifest this vault opens or
  seals is held, verified, by its object key (objects never change), and read_cut takes
  a held one instead of reading it again, still checked against the cut's row; the
  warm start opens those of the most recently used cuts (preload_manifests). A
  restore's reads are then only its chunks' (measured in kvpack/service/warm.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from cas.breaker import DEFAULT_BACKOFF_S, DEFAULT_MAX_BACKOFF_S, Breaker
from cas.chunks import ChunkRef, ChunkStore, bounded, halves
from cas.errors import ObjectMissing, StoreUnavailable
from cas.ids import ChunkId
from cas.keys import Keyring
from cas.sealed import SealedObjects
from cas.store import ObjectStore
from catalog import ledger, queries
from catalog.chain import TokenChain
from catalog.condemn import Condemned, condemn
from catalog.db import UNREACHABLE, Reader
from catalog.errors import ManifestInvalid, StaleGeneration
from catalog.forget import ForgetReport, Selector, forget
from catalog.gc import GcReport, collect
from catalog.ids import IdentityDigest, ManifestId
from catalog.ledger import PairedTiming
from catalog.manifest import Manifest, SealedManifest
from catalog.opened import OpenedManifests
from catalog.publish import (
    ChunkTally,
    LoadedCut,
    check_row,
    load_cut,
    open_cut,
    open_mapped_cut,
    publish,
)
from catalog.queries import Cut
from catalog.scope import Scope
from catalog.signing import MANIFEST_DOMAIN, Bundle, ProducerKeys
from catalog.stats import VaultStats, vault_stats
from catalog.tx import Checkpoint
from catalog.verify import Progress, VerifyReport, verify_vault
from kvpack.config import Settings
from kvpack.io import IoLoop
from migrations import migrate

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 60.0
READY_PROBE_KEY = "ready/probe"  # never written: a stat answering "missing" is an answer
READY_PROBE_TIMEOUT_S = 10.0
PRELOAD_IN_FLIGHT = 8  # manifests read at once by preload_manifests (a few KiB each)


class CatalogUnavailable(SQLAlchemyError):
    """The catalog is skipped: its breaker opened after calls it did not answer."""

    def __init__(self, retry_in_s: float) -> None:
        super().__init__(f"the catalog is not answering; next probe in {retry_in_s:.1f} s")
        self.retry_in_s = retry_in_s


class Vault:
    def __init__(
        self,
        *,
        db: Engine,
        objects: ObjectStore,
        keyring: Keyring,
        producer_keys: ProducerKeys,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        outage_backoff_s: float = DEFAULT_BACKOFF_S,
    ) -> None:
        self.db = db
        self.objects = objects
        self.keyring = keyring
        self.producer_keys = producer_keys
        self.timeout_s = timeout_s
        self.io = IoLoop()
        self.sealed = SealedObjects(objects, keyring)
        self.catalog_breaker = Breaker(
            "catalog",
            threshold=1,  # one call past the catalog timeout is an outage already
            backoff_s=outage_backoff_s,
            max_backoff_s=max(outage_backoff_s, DEFAULT_MAX_BACKOFF_S),
        )
        self.opened = OpenedManifests()  # manifests verified once (catalog/opened.py)
        self._chunks: dict[str, ChunkStore] = {}
        self._lock = threading.Lock()

    @classmethod
    def open(
        cls,
        settings: Settings,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        objects: ObjectStore | None = None,
    ) -> Vault:
        """Migrate the catalog, then open the store and the keys the settings name;
        `objects` in place of that store (benches and fault tests wrap the real one)."""
        settings.ensure_data_dir()
        migrate(settings.database_url)
        return cls(
            db=settings.make_engine(),
            objects=objects if objects is not None else settings.open_store(),
            keyring=settings.keyring(),
            producer_keys=settings.producer_keys(),
            timeout_s=timeout_s,
            outage_backoff_s=settings.outage_backoff_s,
        )

    @property
    def db(self) -> Engine:
        return self._db

    @db.setter
    def db(self, engine: Engine) -> None:
        self._db, self._read = engine, Reader(engine)  # reads follow the engine

    @property
    def producer(self) -> str:
        return self.producer_keys.producer

    def chunks(self, namespace: str) -> ChunkStore:
        with self._lock:
            store = self._chunks.get(namespace)
            if store is None:
                store = self._chunks[namespace] = ChunkStore(
                    self.objects, self.keyring, namespace=namespace
                )
            return store

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = -1.0) -> T:
        """Run a storage coroutine on the vault's loop (default: the vault's timeout)."""
        return self.io.run(coro, self.timeout_s if timeout == -1.0 else timeout)

    @contextmanager
    def _catalog(self) -> Iterator[None]:
        """One call through the catalog breaker."""
        if not self.catalog_breaker.allow():
            raise CatalogUnavailable(self.catalog_breaker.state().retry_in_s)
        try:
            yield
        except UNREACHABLE:
            self.catalog_breaker.failure()
            raise
        self.catalog_breaker.success()

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A catalog session inside one committed transaction."""
        with self._catalog(), Session(self.db) as session, session.begin():
            yield session

    def read(self, query: Callable[[Session], T]) -> T:
        """One read-only catalog query."""
        with self._catalog():
            return self._read(query)

    # -- readiness ----------------------------------------------------------------------

    def check_catalog(self) -> dict[str, Any]:
        """Whether the catalog answers one trivial query (through the breaker)."""
        try:
            self.read(lambda s: s.execute(text("SELECT 1")).scalar())
        except SQLAlchemyError as e:
            return {"up": False, "detail": _first_line(e), **_breaker(self.catalog_breaker)}
        return {"up": True, **_breaker(self.catalog_breaker)}

    def check_store(self) -> dict[str, Any]:
        """Whether the object store answers a stat of a key that is never written."""
        breaker = getattr(self.objects, "breaker", None)
        state = _breaker(breaker) if isinstance(breaker, Breaker) else {}
        try:
            self.run(self.objects.stat(READY_PROBE_KEY), READY_PROBE_TIMEOUT_S)
        except ObjectMissing:
            pass  # an answer
        except (StoreUnavailable, TimeoutError) as e:
            return {"up": False, "detail": _first_line(e), **state}
        return {"up": True, **state}

    # -- cuts -------------------------------------------------------------------------

    def find(
        self, scope: Scope, chain: TokenChain, *, deeper_than: int = 0, at_most: int | None = None
    ) -> Cut | None:
        """The deepest cut that can serve this chain (one indexed catalog query). From a
        remote store it carries its chunk list, read by the same query, so that read_cut
        starts its chunk reads without another catalog call."""
        return self.read(
            lambda s: queries.find_deepest(
                session=s,
                identity=scope.identity,
                chain=chain,
                deeper_than=deeper_than,
                at_most=at_most,
                with_chunks=self.objects.remote,
            )
        )

    def get_cut(self, manifest_id: ManifestId) -> Cut | None:
        return self.read(lambda s: queries.get_cut(session=s, manifest_id=manifest_id))

    def load(self, cut: Cut, scope: Scope) -> LoadedCut:
        """The cut's manifest and parts, every chunk fetched concurrently and verified."""
        coro = load_cut(
            chunks=self.chunks(scope.namespace), keyring=self.keyring, cut=cut,
            identity=scope.identity, opened=self.opened,
        )  # fmt: skip
        return self.run(coro)

    def open_cut(self, cut: Cut, scope: Scope) -> SealedManifest:
        """The cut's manifest object, its MAC and its agreement with the row, verified;
        no chunk is read (catalog/publish.py open_cut)."""
        return self.run(open_cut(self.objects, self.keyring, cut, scope.identity, self.opened))

    def warm_reads(self, namespace: str, size: int) -> None:
        """Set up the namespace's chunk reads ahead, for chunks of up to `size` bytes (cas
        ChunkStore.warm: scratch buffers, worker threads, store connections)."""
        chunks = self.chunks(namespace)
        self.run(chunks.warm(size, probe_key=READY_PROBE_KEY), READY_PROBE_TIMEOUT_S)

    def warm_chunk(self, scope: Scope, recent: Sequence[Cut]) -> bool:
        """The first chunk of the scope's first cut among `recent` (the most recently used
        first, as `preload_manifests` returns them) whose manifest is held, read from a
        remote store the way a durable hit reads it (from S3 the direct GET, opened behind
        the read on its thread) into two halves of a buffer that is then dropped
        (kvpack/service/warm.py). False where there is none, and from a store that maps
        its objects: its openers already mapped and opened a sample (ChunkStore.warm),
        and which chunk files come back into memory is the preload setting's to say."""
        chunks = self.chunks(scope.namespace)
        if chunks.maps:
            return False
        for cut in recent:
            held = self.opened.get(cut.object_key)
            if cut.identity != scope.identity or held is None:
                continue
            refs = check_row(held, cut, scope.identity).manifest.chunk_refs
            if not refs:
                continue
            out = halves(memoryview(bytearray(refs[0].size)))
            self.run(chunks.get_into(refs[:1], [out]), self.timeout_s)
            return True
        return False

    def preload(self, budget: int, seconds: float) -> tuple[int, int]:
        """The chunks of the most recently used cuts, up to `budget` bytes, read into the
        page cache from a store that keeps them in files on this machine (a local
        directory): a restarted server's first durable hits then read memory, not the
        disk (kvpack/service/warm.py). Neither a chunk nor the catalog's next batch of
        cuts is started after `seconds`. (chunks, bytes) read; (0, 0) from another store,
        whose cache is its own."""
        preload = getattr(self.objects, "preload", None)
        if preload is None or budget <= 0:
            return 0, 0
        until = time.monotonic() + seconds
        chunks = self.read(lambda s: queries.recent_chunks(session=s, budget=budget, until=until))
        keys = (ChunkStore.key(ChunkId.from_hex(chunk)) for chunk, _ in chunks)
        return preload(keys, until=until)

    def preload_manifests(self, count: int, seconds: float) -> list[Cut]:
        """The manifests of the `count` most recently used cuts (last hit, else published)
        opened into `opened`, PRELOAD_IN_FLIGHT at a time, for at most `seconds`: a
        restarted server's first durable hits then read only their chunks
        (kvpack/service/warm.py). A manifest that does not open is skipped: the hit that
        needs it reads it again and refuses it there. The cuts whose manifests are held,
        the most recently used first."""
        if count <= 0:
            return []
        cuts = self.read(lambda s: queries.recent_cuts(session=s, limit=count))

        async def one(cut: Cut) -> None:
            with suppress(ManifestInvalid, StaleGeneration):
                await open_cut(self.objects, self.keyring, cut, cut.identity, self.opened)

        with suppress(TimeoutError):  # what was read by then stays held
            self.run(bounded([partial(one, cut) for cut in cuts], PRELOAD_IN_FLIGHT), seconds)
        return [cut for cut in cuts if cut.object_key in self.opened]

    def read_cut(self, cut: Cut, scope: Scope) -> ChunkReading:
        """The cut's manifest opened and verified as open_cut does, and its chunks on
        their way (into scratch buffers, or mapped: cas ChunkStore). From a remote store
        they are fetched as the catalog lists them (the list find read with the cut, else
        one catalog call) while the manifest is still arriving, so the reader pays one
        round trip, not the manifest's and then the chunks' (a manifest whose parts are
        not that list is ManifestInvalid: the row and the object disagree); from a local
        one, once the manifest named them, since early reads there only compete with the
        manifest's open. From one that maps its objects (MappedReading), the manifest is
        opened on this thread and the chunks once the destinations exist: a local file
        needs no trip through the event loop. A manifest this vault opened or sealed before
        is not read again (catalog/opened.py): the chunks start at once. Hand the
        destinations to `into`, or `cancel` it."""
        chunks = self.chunks(scope.namespace)
        if chunks.maps:
            sealed = open_mapped_cut(self.objects, self.keyring, cut, scope.identity, self.opened)
            mapped = MappedReading(chunks, list(sealed.manifest.chunk_refs))
            mapped.manifest = sealed.manifest
            return mapped
        deadline = time.monotonic() + self.timeout_s
        held = self.opened.get(cut.object_key)
        if held is not None:
            manifest = check_row(held, cut, scope.identity).manifest
            reading = Reading.start(self.io, chunks, list(manifest.chunk_refs), deadline)
            reading.manifest = manifest
            return reading
        opening = self.io.start(
            open_cut(self.objects, self.keyring, cut, scope.identity, self.opened)
        )
        early: Reading | None = None
        try:
            if chunks.objects.remote:
                early = Reading.start(self.io, chunks, self._listed_chunks(cut), deadline)
            sealed = self.io.wait(opening, max(0.0, deadline - time.monotonic()))
            refs = sealed.manifest.chunk_refs
            if early is not None and early.refs != refs:
                raise ManifestInvalid(
                    f"manifest object {cut.object_key} does not list its catalog row's chunks"
                )
        except BaseException:
            opening.cancel()
            if early is not None:
                early.cancel()
            raise
        reading = early or Reading.start(self.io, chunks, refs, deadline)
        reading.manifest = sealed.manifest
        return reading

    def _listed_chunks(self, cut: Cut) -> list[ChunkRef]:
        listed: Sequence[tuple[str, int]] | None = cut.chunks
        if listed is None:  # a cut that did not come from find: its list is one more call
            listed = self.read(
                lambda s: queries.manifest_chunk_refs(session=s, manifest_id=cut.manifest_id)
            )
        return [ChunkRef(ChunkId.from_hex(c), size) for c, size in listed]

    def publish(
        self,
        scope: Scope,
        tokens: Sequence[int],
        *,
        layout: Mapping[str, Any],
        parts: Sequence[tuple[str, bytes | memoryview]],
        logits_witnessed: bool,
        producer: str | None = None,
        provenance: str = "local",
        tally: ChunkTally | None = None,
    ) -> Manifest:
        """Publish the cut after `tokens` (idempotent: the same history is one manifest).
        A promoted remote import names its producer and its provenance ("peer:<name>");
        this vault's key signs every envelope it seals either way. `tally` counts the
        chunks sealed and the ones already stored (not sealed again)."""
        coro = publish(
            chunks=self.chunks(scope.namespace),
            db=self.db,
            keyring=self.keyring,
            scope=scope,
            tokens=tokens,
            parts=parts,
            layout=layout,
            logits_witnessed=logits_witnessed,
            producer=producer or self.producer,
            provenance=provenance,
            sign=lambda body: self.producer_keys.sign(MANIFEST_DOMAIN, body),
            tally=tally,
            opened=self.opened,
        )
        return self.run(coro)

    def touch_cut(self, manifest_id: ManifestId) -> None:
        """Stamp a served cut as just hit (GC evicts the least recently hit first)."""
        with self.transaction() as s:
            queries.touch_cut(session=s, manifest_id=manifest_id)

    def identity_components(self, identity: IdentityDigest) -> dict[str, Any] | None:
        return self.read(lambda s: queries.identity_components(session=s, identity=identity))

    # -- keeping the vault ------------------------------------------------------------

    def collect(
        self,
        *,
        budget_bytes: int | None,
        grace: timedelta,
        orphans: bool = False,
        checkpoint: Checkpoint | None = None,
    ) -> GcReport:
        """GC (catalog/gc.py): evict each tenant down to its quota and everyone down to
        `budget_bytes`, reclaim unreferenced chunks older than `grace`, and with `orphans`
        delete objects no row names."""
        coro = collect(
            objects=self.objects, db=self.db, budget_bytes=budget_bytes, grace=grace,
            orphans=orphans, checkpoint=checkpoint,
        )  # fmt: skip
        return self.run(coro, None)

    def condemn(
        self, manifest_id: ManifestId, *, kind: str, reason: str, chunk: ChunkId | None = None
    ) -> list[Condemned]:
        """Take a cut that failed verification out of the catalog and its broken bytes out
        of the store (catalog/condemn.py); a broken chunk takes every cut using it."""
        coro = condemn(objects=self.objects, db=self.db, manifest_id=manifest_id, kind=kind,
                       reason=reason, chunk=chunk)  # fmt: skip
        return self.run(coro)

    def forget(
        self, selector: Selector, *, dry_run: bool = False, progress: Progress | None = None
    ) -> ForgetReport:
        """Make every cut the selector names unreachable now (catalog/forget.py)."""
        coro = forget(objects=self.objects, db=self.db, selector=selector, dry_run=dry_run,
                      progress=progress)  # fmt: skip
        return self.run(coro, None)

    def verify(
        self,
        *,
        read_data: bool = False,
        sample: float = 1.0,
        repair: bool = False,
        progress: Progress | None = None,
    ) -> VerifyReport:
        """Check every cut's manifest, signature and chunks (catalog/verify.py)."""
        coro = verify_vault(
            objects=self.objects, db=self.db, keyring=self.keyring,
            public_keys=self.producer_keys.public_keys(), read_data=read_data, sample=sample,
            repair=repair, progress=progress,
        )  # fmt: skip
        return self.run(coro, None)

    def stats(self) -> VaultStats:
        return self.read(lambda s: vault_stats(session=s))

    def rotate_producer_key(self, path: Path) -> Bundle:
        """A new signing key endorsed by the current one, saved to `path` before use."""
        keys = self.producer_keys.rotate()
        keys.save(path)
        self.producer_keys = keys
        return keys.bundle()

    # -- the economics ledger ---------------------------------------------------------

    def record_timing(self, timing: PairedTiming) -> None:
        with self.transaction() as s:
            ledger.insert_timing(session=s, timing=timing)

    def timings(self, identities: Sequence[IdentityDigest]) -> list[PairedTiming]:
        return self.read(lambda s: ledger.timings(session=s, identities=identities))

    def close(self) -> None:
        try:
            self.run(self.objects.aclose())
        finally:
            self.io.close()
            self.db.dispose()


class Reading:
    """Chunks on their way into destinations still to be made (Vault.read_cut), for the
    verified `manifest`: `into` hands them their destinations and waits for every chunk,
    verified and decrypted there."""

    manifest: Manifest  # set by read_cut once it is verified

    def __init__(
        self,
        io: IoLoop,
        refs: list[ChunkRef],
        loading: Future[None],
        made: Future[Sequence[Sequence[memoryview]]],
        deadline: float,
    ) -> None:
        self.refs = refs
        self._io, self._loading, self._made, self._deadline = io, loading, made, deadline

    @classmethod
    def start(
        cls, io: IoLoop, chunks: ChunkStore, refs: list[ChunkRef], deadline: float
    ) -> Reading:
        """Every chunk of `refs` fetched on `io`'s loop, opened once `into` has run."""
        made: Future[Sequence[Sequence[memoryview]]] = Future()

        async def destinations() -> Sequence[Sequence[memoryview]]:
            # Bounded, so a reading nobody fills lets go of its scratch buffers.
            remaining = max(0.0, deadline - time.monotonic())
            return await asyncio.wait_for(asyncio.wrap_future(made), remaining)

        return cls(io, refs, io.start(chunks.get_into(refs, destinations())), made, deadline)

    def into(
        self,
        destinations: Callable[[], Sequence[Sequence[memoryview]]],
        meanwhile: Callable[[], object] | None = None,
    ) -> None:
        """`destinations()` (each part's segments, in manifest order) runs on the calling
        thread while the chunks land (the engine allocates its intake there); what it
        raises propagates and the fetch is cancelled (it never had the destinations).
        `meanwhile()` runs there too, once the fetch has them, before the wait."""
        try:
            outs = destinations()
        except BaseException:
            self.cancel()
            raise
        if self._made.set_running_or_notify_cancel():  # False: the fetch failed and gave up
            self._made.set_result(outs)
        try:
            if meanwhile is not None:
                meanwhile()
        finally:  # the fetch writes into the destinations until it has ended
            self._io.wait(self._loading, max(0.0, self._deadline - time.monotonic()))

    def cancel(self) -> None:
        """Stop the fetch if no destinations were handed over (else a no-op)."""
        if not self._made.done():
            self._loading.cancel()


class MappedReading:
    """The chunks of a store that maps its objects (a local directory), for the verified
    `manifest` (Vault.read_cut). Nothing is fetched ahead: a mapping costs next to
    nothing, and `into` hands the destinations straight to the chunk store's opener
    threads (cas ChunkStore.open_mapped), with no event loop between the allocation and
    the opens (measured in docs/measurements.md). No deadline applies: the opens are
    this machine's own work on its own files."""

    manifest: Manifest  # set by read_cut once it is verified

    def __init__(self, chunks: ChunkStore, refs: list[ChunkRef]) -> None:
        self.chunks, self.refs = chunks, refs

    def into(
        self,
        destinations: Callable[[], Sequence[Sequence[memoryview]]],
        meanwhile: Callable[[], object] | None = None,
    ) -> None:
        """As Reading.into: `destinations()` on the calling thread, then every chunk
        opened into them, `meanwhile()` run here as they are."""
        self.chunks.open_mapped(self.refs, destinations(), meanwhile)

    def cancel(self) -> None:
        """Nothing to stop: nothing is read before `into`."""


ChunkReading = Reading | MappedReading


def _breaker(breaker: Breaker) -> dict[str, Any]:
    s = breaker.state()
    return {"breaker": s.state, "failures": s.failures, "retry_in_s": round(s.retry_in_s, 3)}


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
