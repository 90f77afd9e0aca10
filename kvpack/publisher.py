"""Publication, off the response path (DESIGN flow step 5).

- job: one piece of background work — encode a cut's planes and hold it in the resident
  tier and/or publish it to the durable tier, promote a durable hit into the resident
  tier, mark a catalog hit, persist a paired timing.
- Publisher: one worker thread running jobs in submission order from a bounded queue.
  `submit` never blocks: when the queue is full the job is dropped and counted (a lost
  publication costs a future hit, never a response). A failed job is logged and counted.
  Durable publication is idempotent through the catalog's idempotency key, so the same
  history submitted twice is one pack.

The service thread takes snapshots (cheap views of evaluated arrays; a snapshot stays
valid while the slot decodes on); encoding them into plane bytes happens here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from catalog.ledger import LedgerEntry
from catalog.publish import LoadedCut
from engine import planes
from engine.snapshot import Snapshot
from kvpack.durable import DurableTier
from kvpack.resident import CutTooLarge, ResidentTier

if TYPE_CHECKING:
    from kvpack.ladder import Tenant

log = logging.getLogger(__name__)
DEFAULT_CAPACITY = 64


class Publisher:
    def __init__(
        self, *, resident: ResidentTier, durable: DurableTier, capacity: int = DEFAULT_CAPACITY
    ) -> None:
        if capacity < 1:
            raise ValueError(f"publication queue capacity must be >= 1, got {capacity}")
        self.resident = resident
        self.durable = durable
        self.capacity = capacity
        self.done = self.failed = self.dropped = 0
        self._jobs: deque[tuple[str, Callable[[], None]]] = deque()
        self._pending = 0  # queued + running
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvpack-publisher", daemon=True)
        self._thread.start()

    # -- the jobs ---------------------------------------------------------------------

    def cut(
        self,
        tenant: Tenant,
        tokens: Sequence[int],
        snap: Snapshot,
        *,
        resident: bool,
        durable: bool,
    ) -> bool:
        """Encode `snap` (the state after `tokens`) and hold/publish it where asked."""
        tokens = tuple(tokens)

        def job() -> None:
            layout, parts = planes.encode(snap)
            if resident:
                self._hold(tenant, tokens, layout, parts, snap.logits_witnessed)
            if durable:
                self.durable.publish(
                    namespace=tenant.namespace,
                    identity=tenant.identity,
                    tokens=tokens,
                    layout=layout,
                    parts=parts,
                    logits_witnessed=snap.logits_witnessed,
                )

        return self.submit(f"cut@{len(tokens)}", job)

    def promote(self, tenant: Tenant, tokens: Sequence[int], loaded: LoadedCut) -> bool:
        """Hold a verified durable cut in the resident tier (the next hit stays in memory)."""
        tokens = tuple(tokens)
        m = loaded.manifest
        parts = [(role, bytes(data)) for role, data in loaded.planes]
        return self.submit(
            f"promote@{m.depth}",
            lambda: self._hold(tenant, tokens, dict(m.layout), parts, m.logits_witnessed),
        )

    def hit(self, manifest_id: str) -> bool:
        return self.submit("hit", lambda: self.durable.record_hit(manifest_id))

    def pair(self, entry: LedgerEntry) -> bool:
        return self.submit("pair", lambda: self.durable.record_pair(entry))

    def _hold(self, tenant: Tenant, tokens, layout, parts, logits_witnessed: bool) -> None:
        # A cut larger than the whole resident budget stays durable only, by design.
        with contextlib.suppress(CutTooLarge):
            self.resident.insert(
                identity=tenant.identity.digest,
                tokens=tokens,
                alignment=self.durable.alignment,
                layout=layout,
                parts=parts,
                logits_witnessed=logits_witnessed,
            )

    # -- the worker -------------------------------------------------------------------

    def submit(self, name: str, job: Callable[[], None]) -> bool:
        """Queue `job`; False (and counted as dropped) when the queue is full or closing."""
        with self._cond:
            if self._closing or len(self._jobs) >= self.capacity:
                self.dropped += 1
                return False
            self._jobs.append((name, job))
            self._pending += 1
            self._cond.notify_all()
            return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job has run; False if `timeout` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Stop taking jobs, run the queued ones (bounded wait); True if all ran."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "queued": self._pending,
                "done": self.done,
                "failed": self.failed,
                "dropped": self.dropped,
            }

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closing)
                if not self._jobs:
                    return
                name, job = self._jobs.popleft()
            failed = False
            try:
                job()
            except Exception:  # noqa: BLE001 - a failed publication never reaches a response
                log.exception("publication job %s failed", name)
                failed = True
            with self._cond:
                self._pending -= 1
                if failed:
                    self.failed += 1
                else:
                    self.done += 1
                self._cond.notify_all()
