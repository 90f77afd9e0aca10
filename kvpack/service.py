"""The service: one model, its tenants' slots, the reuse ladder, publication and counters.

- request / result: CompletionRequest (prompt tokens with the chat template applied,
  max_tokens, sampling, stop ids, tenant namespace) and CompletionResult (generated ids,
  finish reason, which tier served how many cached tokens, restore and prefill seconds).
- complete(): the ladder installs the deepest available state (kvpack/ladder.py), the
  engine prefills the rest in absolute aligned steps, then decodes. Publication rides
  along: a snapshot at every aligned boundary the session crosses goes to the resident
  tier; the cuts at durable_every-token multiples (2,048 by default) and at the prompt's
  end (exact, logits witnessed, plus the last aligned cut before it) also go to the
  durable tier — all encoded and stored by the background Publisher, never on the
  response path. Only prefill publishes: decoded K/V differ in the last bits from
  prefilled K/V, so a cut taken while decoding would break bit-identity with a cold run.
- tenant namespace: the identity's salt. Each namespace gets its own engine over the
  same weights (its identity differs only in the namespace component) and its own
  chunk-id key, so no lookup crosses tenants; every counter carries it as a label.
- opening: the catalog schema is upgraded to head (Alembic) for the embedded SQLite
  default and for an external database alike; the object store is opened from the
  settings' URL (S3 endpoint and credentials from `s3` or the environment).

complete() is synchronous and not thread-safe: callers serialise it on one thread.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from cas.open import open_object_store
from cas.s3 import S3Config
from catalog.chain import TokenChain, token_chain
from engine.errors import InvalidRequest
from engine.identity import Identity
from engine.models import LoadedModel, load_model
from engine.slots import GREEDY, Engine, Sampling, Slot
from engine.snapshot import Snapshot, snapshot
from kvpack.accounting import Accounting
from kvpack.config import Settings
from kvpack.durable import DurableTier, IoLoop, upgrade_catalog
from kvpack.economics import PairedTiming, summarize
from kvpack.export import Exporter
from kvpack.ladder import Ladder, NoPeers, RemoteTier, Tenant
from kvpack.pairing import PrefillClock
from kvpack.peers import Peer, load_peers
from kvpack.publisher import DEFAULT_CAPACITY, Publisher
from kvpack.quarantine import Quarantine
from kvpack.remote import PeerTier
from kvpack.resident import DEFAULT_BUDGET_BYTES, ResidentTier

DURABLE_EVERY = 2048
PAIRING = (
    "a local prefill from depth 0 pairs once with the first later hit on the same cut "
    "(same identity, same tokens) in the same process"
)


@dataclass(frozen=True)
class CompletionRequest:
    tokens: list[int]  # prompt, chat template already applied
    max_tokens: int
    sampling: Sampling = GREEDY
    stop: tuple[int, ...] = ()
    namespace: str = "default"  # tenant namespace (the server takes it from the API key)


@dataclass(frozen=True)
class CompletionResult:
    tokens: list[int]  # generated ids (stop token excluded)
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    cached_tokens: int  # tokens not prefilled because a tier served them
    tier: str  # "session" | "resident" | "durable" | "remote" | "none"
    restore_seconds: float
    prefill_seconds: float


class Service:
    def __init__(
        self,
        *,
        loaded: LoadedModel,
        num_slots: int,
        durable: DurableTier,
        resident: ResidentTier,
        remote: RemoteTier,
        durable_every: int,
        publish_queue: int,
    ) -> None:
        if durable_every < 1 or durable_every % loaded.alignment:
            raise InvalidRequest(
                "durable_every", f"must be a positive multiple of {loaded.alignment}"
            )
        self.loaded = loaded
        self.num_slots = num_slots
        self.alignment = loaded.alignment
        self.durable_every = durable_every
        self.durable = durable
        self.resident = resident
        self.accounting = Accounting(per_namespace=True)  # counters per tenant
        self.publisher = Publisher(resident=resident, durable=durable, capacity=publish_queue)
        self.clock = PrefillClock()
        self.ladder = Ladder(
            resident=resident,
            durable=durable,
            remote=remote,
            publisher=self.publisher,
            accounting=self.accounting,
            clock=self.clock,
        )
        self.quarantine = Quarantine(
            db=durable.db,
            objects=durable.objects,
            keyring=durable.keyring,
            io=durable.io,
            timeout_s=durable.timeout_s,
        )
        self.exporter = Exporter(durable)
        self._tenants: dict[str, Tenant] = {}
        self._tenants_lock = threading.Lock()
        self._closed = False
        self.tenant(loaded.identity.components["namespace"])

    @classmethod
    def open(
        cls,
        settings: Settings,
        *,
        model: str,
        num_slots: int = 1,
        s3: S3Config | None = None,
        resident_budget_bytes: int = DEFAULT_BUDGET_BYTES,
        remote: RemoteTier | None = None,
        durable_every: int = DURABLE_EVERY,
        publish_queue: int = DEFAULT_CAPACITY,
        io_timeout_s: float = 60.0,
    ) -> Service:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        upgrade_catalog(settings.database_url)
        loaded = load_model(model, alignment=settings.alignment, namespace=settings.namespace)
        io = IoLoop()
        durable = DurableTier(
            db=settings.make_engine(),
            objects=open_object_store(settings.store_url, s3=s3),
            keyring=settings.keyring(),
            alignment=settings.alignment,
            producer_keys=settings.producer_keys(),
            io=io,
            timeout_s=io_timeout_s,
        )
        try:
            service = cls(
                loaded=loaded,
                num_slots=num_slots,
                durable=durable,
                resident=ResidentTier(resident_budget_bytes),
                remote=remote or NoPeers(),
                durable_every=durable_every,
                publish_queue=publish_queue,
            )
            peers = load_peers(settings.peers_path)
        except BaseException:
            durable.close()
            raise
        if remote is None and peers:
            service.use_peers(peers, timeout_s=settings.peer_timeout_s)
        return service

    def use_peers(self, peers: Sequence[Peer], *, timeout_s: float) -> PeerTier:
        """Import from `peers` (in order) when no local tier can serve."""
        tier = PeerTier(
            peers=peers,
            durable=self.durable,
            quarantine=self.quarantine,
            accounting=self.accounting,
            timeout_s=timeout_s,
        )
        self.ladder.remote = tier
        return tier

    def tenant(self, namespace: str) -> Tenant:
        """The tenant of `namespace`, created on first use (same weights, salted identity)."""
        if not isinstance(namespace, str) or not namespace:
            raise InvalidRequest("namespace", "must be a non-empty string")
        with self._tenants_lock:
            tenant = self._tenants.get(namespace)
            if tenant is None:
                identity = Identity.of({**self.loaded.identity.components, "namespace": namespace})
                loaded = dataclasses.replace(self.loaded, identity=identity)
                engine = Engine(loaded, num_slots=self.num_slots, alignment=self.alignment)
                tenant = self._tenants[namespace] = Tenant(namespace, identity, engine)
            return tenant

    # -- a request ----------------------------------------------------------------------

    def complete(
        self,
        req: CompletionRequest,
        *,
        on_token: Callable[[int], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> CompletionResult:
        if not isinstance(req.max_tokens, int) or req.max_tokens < 0:
            raise InvalidRequest("max_tokens", f"must be an int >= 0, got {req.max_tokens!r}")
        tenant = self.tenant(req.namespace)
        tokens = tenant.engine.check_tokens(req.tokens)
        if not tokens:
            raise InvalidRequest("tokens", "the prompt is empty")
        chain = token_chain(tokens, alignment=self.alignment)
        served = self.ladder.serve(tenant, tokens, chain)
        slot = served.slot
        prefill_seconds = self._prefill(tenant, slot, tokens, chain, cancel)
        base = {
            "prompt_tokens": len(tokens),
            "cached_tokens": served.depth,
            "tier": served.tier,
            "restore_seconds": served.restore_seconds,
            "prefill_seconds": prefill_seconds,
        }
        if slot.depth < len(tokens):  # cancelled mid-prefill
            return CompletionResult(tokens=[], finish_reason="cancelled", **base)
        gen = self._generate(slot, req, on_token, cancel)
        return CompletionResult(tokens=gen.tokens, finish_reason=gen.finish_reason, **base)

    def _prefill(
        self,
        tenant: Tenant,
        slot: Slot,
        tokens: list[int],
        chain: TokenChain,
        cancel: threading.Event | None,
    ) -> float:
        """Prefill tokens[slot.depth:], publishing at boundaries; returns compute seconds."""
        start = slot.depth
        if start == len(tokens):
            return 0.0
        digest = tenant.identity.digest
        publication = 0.0  # seconds spent in on_boundary, not prefilling
        last: tuple[int, Snapshot, bool] | None = None  # (depth, snapshot, sent to durable)
        t0 = time.perf_counter()

        def on_boundary(depth: int) -> None:
            nonlocal publication, last
            if not slot.cold:  # a continued session holds decoded K/V: not a cold cut
                return
            t = time.perf_counter()
            if start == 0:
                seconds = t - t0 - publication
                self.clock.record(identity=digest, chain_digest=chain.at(depth), seconds=seconds)
            snap = snapshot(slot)
            durable = depth % self.durable_every == 0
            self.publisher.cut(tenant, tokens[:depth], snap, resident=True, durable=durable)
            last = (depth, snap, durable)
            publication += time.perf_counter() - t

        slot.prefill(tokens[start:], on_boundary=on_boundary, cancel=cancel)
        seconds = time.perf_counter() - t0 - publication
        self.accounting.record_prefill(
            seconds=seconds, tokens=slot.depth - start, namespace=tenant.namespace
        )
        if slot.depth < len(tokens):
            return seconds
        # The prompt boundary: its last aligned cut and its exact cut go durable too.
        if last is not None and not last[2]:
            depth, snap, _ = last
            self.publisher.cut(tenant, tokens[:depth], snap, resident=False, durable=True)
        if not chain.aligned and slot.cold:
            if start == 0:
                self.clock.record(identity=digest, chain_digest=chain.digest, seconds=seconds)
            self.publisher.cut(tenant, tokens, snapshot(slot), resident=True, durable=True)
        return seconds

    def _generate(
        self,
        slot: Slot,
        req: CompletionRequest,
        on_token: Callable[[int], None] | None,
        cancel: threading.Event | None,
    ):
        """Decode. Nothing is published from here: a decoded token's K/V differ in the last
        bits from the same token prefilled, so a cut taken while decoding would not restore
        to what a cold run of that history computes. Publication rides on prefill only."""
        return slot.generate(
            max_tokens=req.max_tokens,
            sampling=req.sampling,
            stop=req.stop,
            on_token=on_token,
            cancel=cancel,
        )

    # -- reporting ----------------------------------------------------------------------

    def economics(self) -> dict[str, Any]:
        """The economics summary (GET /v1/economics): measured/mock labels on every value."""
        with self._tenants_lock:
            identities = [t.identity.digest for t in self._tenants.values()]
        try:
            entries = self.durable.ledger(identities)
            source = "catalog economics_ledger"
        except SQLAlchemyError:
            entries, source = [], "unavailable (catalog unreachable)"
        pairs = [
            PairedTiming(
                identity=e.identity,
                depth=e.restored_tokens,
                tier=e.tier,
                restore_seconds=e.restore_seconds,
                prefill_seconds=e.prefill_seconds,
                measured_at=e.measured_at,
            )
            for e in entries
        ]
        restored = self.accounting.total("kvpack_restored_tokens_total")  # every tier, tenant
        summary = summarize(pairs, num_params=self.loaded.num_params, restored_tokens=int(restored))
        return {
            "model": self.loaded.name,
            "identity": self.loaded.identity.hex,
            "ledger": source,
            "pairing": PAIRING,
            **summary,
        }

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued publication to finish; False if `timeout` passed first."""
        return self.publisher.flush(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Drain publication (bounded wait), then release the store, loop and database.
        Closing twice is a no-op."""
        if self._closed:
            return
        self._closed = True
        try:
            self.publisher.close(timeout)
            if isinstance(self.ladder.remote, PeerTier):
                self.ladder.remote.close()
        finally:
            self.durable.close()
