"""The service: one model, its tenants' slots, the reuse ladder, publication and counters.

- request / completion: a CompletionRequest (prompt tokens with the chat template
  applied, max tokens, sampling, stop ids and stop strings, tenant namespace) becomes a
  Completion (generated ids and text, finish reason, which tier served how many cached
  tokens, restore and prefill seconds). The server and the Python API both speak these.
- complete(): the ladder installs the deepest available state (kvpack/tiers/ladder.py),
  the engine prefills the rest in absolute aligned steps, then decodes. Publication rides
  along (kvpack/service/publication.py): a snapshot at every aligned boundary the
  prefill crosses while the slot is cold, encoded and held in the background; its
  durable cuts are published once the request is served (at most `publish_max_defer_s`
  later), or not at all with publication off (`publish=False`).
- text: generated ids become text as they come (kvpack/service/detok.py); a stop string
  ends the generation at once and is not part of the text.
- steps: `steps()` is a request as a generator of engine steps; each `next()` does one
  unit of work and yields its kind: "lookup" (the ladder, restore included), "prefill"
  (one aligned step of at most A tokens), "decode" (one token). The generator's return
  value is the Completion. `complete()` runs it to the end; the server's scheduler
  (kvpack/service/scheduler.py) interleaves the steps of different tenants' requests.
- tenant namespace: the identity's salt. Each namespace gets its own slot pool over the
  same weights (its identity differs only in the namespace component) and its own
  chunk-id key, so no lookup crosses tenants; every counter carries it as a label.

complete() and the steps are synchronous and not thread-safe: callers run them on one
thread, and one request of a tenant at a time (its requests share the tenant's slots).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
from sqlalchemy.exc import SQLAlchemyError

from cas.chunks import DEFAULT_CONCURRENCY
from catalog.chain import TokenChain
from engine.errors import InvalidRequest
from engine.models import LoadedModel, load_model
from engine.sampling import GREEDY, Drawn, Sampling
from engine.slots import Slot, SlotPool
from engine.state import Snapshot
from kvpack.accounting.counters import Accounting
from kvpack.accounting.economics import summarize
from kvpack.accounting.pairing import PrefillClock
from kvpack.background import DEFAULT_CAPACITY, Background
from kvpack.config import Settings
from kvpack.remote.exporter import Exporter
from kvpack.remote.importer import RemoteTier
from kvpack.remote.peers import Peer, load_peers
from kvpack.remote.quarantine import Quarantine
from kvpack.service.detok import TextStream
from kvpack.service.publication import (
    DEFAULT_MAX_DEFER_S,
    DURABLE_EVERY,
    Publication,
    RequestPublication,
)
from kvpack.service.restores import RestoreMeter
from kvpack.tiers.durable import DurableTier
from kvpack.tiers.ladder import Ladder
from kvpack.tiers.resident import DEFAULT_BUDGET_BYTES, ResidentTier
from kvpack.tiers.session import Tenant
from kvpack.vault import DEFAULT_TIMEOUT_S, Vault

Step = Literal["lookup", "prefill", "decode"]
RESERVE_CAP = 2 << 30  # the default restore reserve's ceiling (a big model's full context)
FRAME_ROOM = 64 << 10  # a frame's head and digest: a few hundred bytes on the demo model
PAIRING = (
    "a local prefill from depth 0 pairs once with the first later hit on the same cut "
    "(same identity, same tokens) in the same process"
)


@dataclass(frozen=True)
class CompletionRequest:
    tokens: list[int]  # prompt, chat template already applied
    max_tokens: int
    sampling: Sampling = GREEDY
    stop: tuple[int, ...] = ()  # stop token ids, beside the model's end-of-sequence ids
    stop_strings: tuple[str, ...] = ()  # text that ends the generation (not returned)
    namespace: str = "default"  # tenant namespace (the server takes it from the API key)
    top_logprobs: int | None = None  # None: no logprobs; n: each token's and n alternatives


@dataclass(frozen=True)
class Completion:
    tokens: list[int]  # generated ids (stop token excluded)
    text: str  # their text, cut before any stop string
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    cached_tokens: int  # tokens not prefilled because a tier served them
    tier: str  # "session" | "resident" | "durable" | "remote" | "none"
    restore_seconds: float
    prefill_seconds: float
    logprobs: tuple[Drawn, ...] | None = None  # one per generated token, when asked for


def run_steps(steps: Generator[Step, None, Completion]) -> Completion:
    """Run a request's steps to the end on this thread."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _published(
    publication: Publication,
    steps: Callable[[RequestPublication], Generator[Step, None, Completion]],
) -> Generator[Step, None, Completion]:
    """A request's steps with its publication: its durable cuts may go once it ends."""
    pub = publication.request()
    try:
        return (yield from steps(pub))
    finally:  # served, cancelled, failed or abandoned
        pub.served()


def block_bytes(loaded: LoadedModel) -> int:
    """A full block's part: its caches' bytes and room for its frame's head and digest
    (what the durable reader's scratch buffer for one chunk holds)."""
    return loaded.layout.cache_bytes(loaded.alignment) + FRAME_ROOM


def default_reserve(loaded: LoadedModel) -> int:
    """What a durable hit at the model's full context allocates before its response ends,
    at most RESERVE_CAP: the slot's caches it restores, the copy of them the slot makes at
    its first write while the promotion holds the restored ones (publication.py), and the
    durable reader's scratch buffers (a block per chunk in flight)."""
    caches = loaded.layout.cache_bytes(loaded.context_length)
    return min(2 * caches + DEFAULT_CONCURRENCY * block_bytes(loaded), RESERVE_CAP)


class Service:
    def __init__(
        self,
        *,
        loaded: LoadedModel,
        vault: Vault,
        num_slots: int = 1,
        resident: ResidentTier | None = None,
        durable_every: int = DURABLE_EVERY,
        background_capacity: int = DEFAULT_CAPACITY,
        close_vault: bool = False,
        publish: bool = True,
        publish_max_defer_s: float = DEFAULT_MAX_DEFER_S,
        restore_reserve: int | None = None,
        preload: int = 0,
    ) -> None:
        """`close_vault`: close() closes the vault too (Service.open sets it for a vault it
        opened itself; a vault several services share is closed by whoever opened it).
        `publish`: whether cold prefills publish their cuts; `publish_max_defer_s`: the
        longest a durable cut waits for its request to be served; `restore_reserve`: the
        bytes the warm start maps for the first restore (None: `default_reserve`;
        engine/memory.py); `preload`: the bytes of recently used cuts the warm start reads
        into the page cache (Vault.preload)."""
        if durable_every < 1 or durable_every % loaded.alignment:
            raise InvalidRequest(
                "durable_every", f"must be a positive multiple of {loaded.alignment}"
            )
        self.loaded = loaded
        self.num_slots = num_slots
        self.restore_reserve = (
            default_reserve(loaded) if restore_reserve is None else restore_reserve
        )
        self.preload = preload
        self.vault = vault
        self.resident = resident if resident is not None else ResidentTier()
        self.accounting = Accounting(per_namespace=True)  # counters per tenant
        self.background = Background(capacity=background_capacity)
        self.clock = PrefillClock()
        self.durable = DurableTier(vault, accounting=self.accounting)
        self.publication = Publication(
            resident=self.resident,
            vault=vault,
            background=self.background,
            accounting=self.accounting,
            durable_every=durable_every,
            enabled=publish,
            max_defer_s=publish_max_defer_s,
        )
        self.ladder = Ladder(
            authority=self.durable,
            caches=[self.resident],
            accounting=self.accounting,
            background=self.background,
            clock=self.clock,
            record_timing=vault.record_timing,
        )
        self.quarantine = Quarantine(vault)
        self.exporter = Exporter(vault)
        self._tenants: dict[str, Tenant] = {}
        self._tenants_lock = threading.Lock()
        self._closed = False
        self._close_vault = close_vault
        self.restores: RestoreMeter | None = None  # kvpack serve --measure-restores
        self.tenant(loaded.identity.namespace)

    @classmethod
    def open(
        cls,
        settings: Settings,
        *,
        model: str,
        vault: Vault | None = None,
        resident: ResidentTier | None = None,
        num_slots: int = 1,
        resident_budget_bytes: int = DEFAULT_BUDGET_BYTES,
        durable_every: int = DURABLE_EVERY,
        background_capacity: int = DEFAULT_CAPACITY,
        io_timeout_s: float = DEFAULT_TIMEOUT_S,
        adapter: str | Path | None = None,
        hf_cache: str | Path | None = None,
    ) -> Service:
        """The service the settings describe: its vault opened (catalog migrated), the
        model loaded (`adapter`, `hf_cache`: as load_model takes them), and the configured
        peers used. `vault` / `resident`: ones to share with other services (several
        models on one vault); a shared vault stays open when this service closes."""
        loaded = load_model(
            model,
            alignment=settings.alignment,
            namespace=settings.namespace,
            adapter=adapter,
            hf_cache=hf_cache,
        )
        if settings.mlx_cache_limit is not None:
            # Process-wide: freed buffers up to the limit are reused by the next restore
            # instead of fresh zero-filled pages.
            mx.set_cache_limit(settings.mlx_cache_limit)
        own = vault is None
        if vault is None:
            vault = Vault.open(settings, timeout_s=io_timeout_s)
        try:
            service = cls(
                loaded=loaded,
                vault=vault,
                num_slots=num_slots,
                resident=resident if resident is not None else ResidentTier(resident_budget_bytes),
                durable_every=durable_every,
                background_capacity=background_capacity,
                close_vault=own,
                publish=settings.publish,
                publish_max_defer_s=settings.publish_max_defer_s,
                restore_reserve=settings.restore_reserve,
                preload=settings.preload,
            )
            peers = load_peers(settings.peers_path)
        except BaseException:
            if own:
                vault.close()
            raise
        if peers:
            service.use_peers(peers, timeout_s=settings.peer_timeout_s)
        return service

    @property
    def remote(self) -> RemoteTier | None:
        return next((t for t in self.ladder.peers if isinstance(t, RemoteTier)), None)

    def use_peers(self, peers: Sequence[Peer], *, timeout_s: float) -> RemoteTier:
        """Import from `peers` (in order) whenever one could beat the best local cut."""
        tier = RemoteTier(
            peers=peers,
            vault=self.vault,
            quarantine=self.quarantine,
            accounting=self.accounting,
            timeout_s=timeout_s,
        )
        self.ladder.peers = [tier]
        return tier

    def tenant(self, namespace: str) -> Tenant:
        """The tenant of `namespace`, created on first use (same weights, salted identity)."""
        if not isinstance(namespace, str) or not namespace:
            raise InvalidRequest("namespace", "must be a non-empty string")
        with self._tenants_lock:
            tenant = self._tenants.get(namespace)
            if tenant is None:
                loaded = self.loaded.with_namespace(namespace)
                tenant = self._tenants[namespace] = Tenant(
                    SlotPool(loaded, num_slots=self.num_slots)
                )
            return tenant

    # -- a request ----------------------------------------------------------------------

    def complete(
        self,
        req: CompletionRequest,
        *,
        on_text: Callable[[str], None] | None = None,
        on_token: Callable[[Drawn], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> Completion:
        """Serve one request; `on_text` receives the text as it is generated, `on_token`
        each drawn token (before its text)."""
        return run_steps(self.steps(req, on_text=on_text, on_token=on_token, cancel=cancel))

    def steps(
        self,
        req: CompletionRequest,
        *,
        on_text: Callable[[str], None] | None = None,
        on_token: Callable[[Drawn], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> Generator[Step, None, Completion]:
        """`complete` one engine step at a time (see the module docstring). The request is
        checked before the first step; `cancel` is checked before each step."""
        if not isinstance(req.max_tokens, int) or req.max_tokens < 0:
            raise InvalidRequest("max_tokens", f"must be an int >= 0, got {req.max_tokens!r}")
        tenant = self.tenant(req.namespace)
        tokens = tenant.pool.check_tokens(req.tokens)
        if not tokens:
            raise InvalidRequest("tokens", "the prompt is empty")
        return _published(
            self.publication,
            lambda pub: self._steps(tenant, tokens, req, on_text, on_token, cancel, pub),
        )

    def _steps(
        self,
        tenant: Tenant,
        tokens: list[int],
        req: CompletionRequest,
        on_text: Callable[[str], None] | None,
        on_token: Callable[[Drawn], None] | None,
        cancel: threading.Event | None,
        pub: RequestPublication,
    ) -> Generator[Step, None, Completion]:
        def cancelled() -> bool:
            return cancel is not None and cancel.is_set()

        base: dict[str, Any] = {
            "prompt_tokens": len(tokens),
            "cached_tokens": 0,
            "tier": "none",
            "restore_seconds": 0.0,
            "prefill_seconds": 0.0,
        }
        if cancelled():  # gone before its first step: nothing to look up
            return Completion(tokens=[], text="", finish_reason="cancelled", **base)
        chain = tenant.scope.chain(tokens)
        started = time.perf_counter()
        serve = partial(self.ladder.serve, tenant, tokens, after_served=pub.after_served)
        installed = serve() if self.restores is None else self.restores.measure(serve)
        slot = installed.slot
        yield "lookup"
        base.update(cached_tokens=installed.depth, tier=installed.tier,
                    restore_seconds=installed.restore_seconds)  # fmt: skip
        base["prefill_seconds"] = yield from self._prefill(tenant, slot, tokens, chain, cancel, pub)
        if slot.depth < len(tokens):  # cancelled mid-prefill
            return Completion(tokens=[], text="", finish_reason="cancelled", **base)
        text = TextStream(self.loaded.tokenizer.decode, req.stop_strings)
        first_token = True
        # Nothing is published while decoding: a decoded token's K/V differ in the last
        # bits from the same token prefilled (see kvpack/service/publication.py).
        decoding = slot.decoding(
            max_tokens=req.max_tokens,
            sampling=req.sampling,
            stop=req.stop,
            top_logprobs=req.top_logprobs,
        )
        drawn_tokens: list[Drawn] = []
        while not decoding.done:
            if text.stopped or cancelled():
                decoding.cancel()
                break
            drawn = decoding.draw()  # fed once sent: a first token waits for no forward
            if drawn is not None:
                if first_token:  # time to first token, for the dashboards and the status page
                    first_token = False
                    self.accounting.observe_first_token(
                        seconds=time.perf_counter() - started, tier=installed.tier,
                        prompt_tokens=len(tokens), namespace=tenant.namespace,
                    )  # fmt: skip
                drawn_tokens.append(drawn)
                if on_token is not None:
                    on_token(drawn)
                delta = text.push(drawn.token)
                if delta and on_text is not None:
                    on_text(delta)
            yield "decode"
            # The last token is sent, never run: nothing draws from its logits, and a
            # session that continues prefills it with its next turn's tokens, in one batch.
            if not decoding.done:
                decoding.feed()
        rest = text.finish()
        if rest and on_text is not None:
            on_text(rest)
        gen = decoding.generation
        finish = "stop" if text.stopped else gen.finish_reason
        logprobs = tuple(drawn_tokens) if req.top_logprobs is not None else None
        return Completion(
            tokens=gen.tokens, text=text.text, finish_reason=finish, logprobs=logprobs, **base
        )

    def _prefill(
        self,
        tenant: Tenant,
        slot: Slot,
        tokens: list[int],
        chain: TokenChain,
        cancel: threading.Event | None,
        pub: RequestPublication,
    ) -> Generator[Step, None, float]:
        """Prefill tokens[slot.depth:] one aligned step per yield, publishing at boundaries;
        returns the compute seconds (this request's steps only, publication excluded)."""
        start = slot.depth
        if start == len(tokens):
            return 0.0
        scope, every = tenant.scope, self.publication.durable_every
        compute = 0.0  # seconds of this request's finished prefill steps
        step_started = 0.0
        publication = 0.0  # seconds of the current step spent in on_boundary
        last: tuple[int, Snapshot, bool] | None = None  # (depth, snapshot, sent to durable)

        def on_boundary(depth: int) -> None:
            nonlocal publication, last
            if not slot.cold:  # a continued session holds decoded K/V: not a cold cut
                return
            t = time.perf_counter()
            if start == 0:
                seconds = compute + t - step_started - publication
                self.clock.record(identity=scope.identity, chain=chain.at(depth), seconds=seconds)
            if not self.publication.enabled:
                return
            snap = slot.export()
            durable = depth % every == 0
            pub.cut(scope, tokens[:depth], snap, resident=True, durable=durable)
            last = (depth, snap, durable)
            publication += time.perf_counter() - t

        steps = slot.prefill_steps(tokens[start:], on_boundary=on_boundary)
        while cancel is None or not cancel.is_set():
            step_started, publication = time.perf_counter(), 0.0
            if next(steps, None) is None:
                break
            compute += time.perf_counter() - step_started - publication
            yield "prefill"
        self.accounting.count_prefill(
            seconds=compute, tokens=slot.depth - start, namespace=tenant.namespace
        )
        if slot.depth < len(tokens):
            return compute
        # The prompt boundary: its last aligned cut and its exact cut go durable too.
        if last is not None and not last[2]:
            depth, snap, _ = last
            pub.cut(scope, tokens[:depth], snap, resident=False, durable=True)
        if not chain.aligned and slot.cold:
            if start == 0:
                self.clock.record(identity=scope.identity, chain=chain.digest, seconds=compute)
            if self.publication.enabled:
                pub.cut(scope, tokens, slot.export(), resident=True, durable=True)
        return compute

    # -- reporting ----------------------------------------------------------------------

    def economics(self) -> dict[str, Any]:
        """The economics summary (GET /v1/economics): measured/mock labels on every value."""
        with self._tenants_lock:
            identities = [t.scope.identity for t in self._tenants.values()]
        try:
            pairs = self.vault.timings(identities)
            source = "catalog economics_ledger"
        except SQLAlchemyError:
            pairs, source = [], "unavailable (catalog unreachable)"
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
        """Wait for queued background work (publication included: a request not served yet
        holds its durable cuts up to the max defer) to finish; False if `timeout` passed."""
        return self.publication.flush(timeout)

    def close(self, timeout: float = 30.0) -> int:
        """Drain background work (bounded wait), then release the store, loop and database
        when this service opened the vault; returns how many background jobs did not
        finish in time. Closing twice is a no-op."""
        if self._closed:
            return 0
        self._closed = True
        try:
            unfinished = (
                0
                if self.publication.close(timeout)
                else self.background.stats()["queued"] + self.publication.deferred.stats()["queued"]
            )
            if self.remote is not None:
                self.remote.close()
        finally:
            if self._close_vault:
                self.vault.close()
        return unfinished
