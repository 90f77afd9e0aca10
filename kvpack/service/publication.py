"""Publication: the cuts a cold prefill crosses, kept for later requests
(docs/architecture.md: step 4).

- resident: every aligned boundary the prefill crosses is held in the resident tier, as
  soon as it is encoded.
- durable: the cuts at `durable_every`-token multiples (2,048 by default), and at the
  prompt's end its exact cut (logits witnessed) and its last aligned cut, are published
  to the vault: chunks first, then the manifest object, then the catalog rows. A chunk
  the vault already stores is neither sealed nor uploaded again (catalog/publish.py);
  the chunks sealed and the ones found stored are counted
  (`kvpack_chunks_sealed_total`, `kvpack_chunks_already_stored_total`).
- only cold state is published: a session whose history holds decoded tokens has K/V
  that differ in the last bits from a cold prefill of the same tokens, so its cuts are
  never offered as if a cold run had computed them.
- request publication (`Publication.request()`): one per prefill. Its Encoder
  (engine/format.py) encodes each cut with the earlier cuts' whole blocks reused, so a
  boundary costs its new block, the ring and the logits, not the whole prefix.
- deferral: durable publication yields to serving. A request's durable cuts wait until
  the request is served (`served()`, when its steps end: decoded, cancelled or failed)
  or `max_defer_s` has passed since the cut was taken, whichever comes first, so sealing
  and uploading do not compete with its own decode. They run one at a time in the order
  taken, so a cut may also wait behind an earlier request's (each bounded the same way).
- promotion: a hit a slower tier served is held in the resident tier once its request is
  served (`after_served`, which the ladder also hands a hit's catalog stamp and paired
  timing). The cut it holds is views of the slot's caches, so the slot's first write
  copies them (kvpack/tiers/ladder.py); the resident tier's own copy then follows the
  response instead of racing that copy for memory. Measured (demo model, 7,936 tokens,
  local directory, a fresh process per run): a durable hit's second token took
  0.57-2.01 s with the copy at once, 0.19-0.26 s with it after the request
  (docs/measurements.md).
- publication off (`enabled=False`, the `publish` setting, `kvpack serve
  --no-publish`): nothing is encoded, held or published; the ladder still reads. For
  A/B measurements (`kvpack bench-publication`) and read-only replicas.

Threads: nothing here runs on the engine's thread but taking the snapshot. Encoding and
resident holding run on the service's background worker (one thread: the only thread
besides the engine's that touches MLX arrays, reading evaluated ones); durable
publication runs on a second worker of its own (`deferred`), on bytes only, so a deferred
publish never holds up a resident hold or a hit's promotion.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from catalog.publish import ChunkTally
from catalog.scope import Scope
from engine.format import Encoder
from engine.state import Planes, Snapshot
from kvpack.accounting.counters import Accounting
from kvpack.background import Background
from kvpack.tiers.resident import ResidentTier
from kvpack.vault import Vault

DURABLE_EVERY = 2048
DEFAULT_MAX_DEFER_S = 30.0


class Publication:
    def __init__(
        self,
        *,
        resident: ResidentTier,
        vault: Vault,
        background: Background,
        accounting: Accounting | None = None,
        durable_every: int = DURABLE_EVERY,
        enabled: bool = True,
        max_defer_s: float = DEFAULT_MAX_DEFER_S,
    ) -> None:
        if not max_defer_s >= 0:
            raise ValueError(f"max_defer_s must be >= 0, got {max_defer_s!r}")
        self.resident = resident
        self.vault = vault
        self.background = background
        self.accounting = accounting
        self.durable_every = durable_every
        self.enabled = enabled
        self.max_defer_s = max_defer_s
        self.deferred = Background(capacity=background.capacity)
        self._waiting: set[threading.Event] = set()  # gates of requests not served yet
        self._lock = threading.Lock()

    def request(self) -> RequestPublication:
        """The publication of one request's prefill (see the module words)."""
        served = threading.Event()
        with self._lock:
            self._waiting.add(served)
        return RequestPublication(self, served)

    def stats(self) -> dict[str, int]:
        """Both workers' queues together (queued, done, failed, dropped): /healthz."""
        ours, deferred = self.background.stats(), self.deferred.stats()
        return {k: ours[k] + deferred[k] for k in ours}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued cut is held and published; False if `timeout` passed."""
        return _in_turn(timeout, self.background.flush, self.deferred.flush)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Stop taking cuts and drain both workers (bounded); True if all ran. A cut still
        deferred is published at once."""
        return _in_turn(timeout, self.background.close, self._release, self.deferred.close)

    def _release(self, timeout: float | None = None) -> bool:
        with self._lock:
            waiting, self._waiting = self._waiting, set()
        for served in waiting:
            served.set()
        return True

    def _served(self, served: threading.Event) -> None:
        with self._lock:
            self._waiting.discard(served)
        served.set()

    def _publish(
        self,
        scope: Scope,
        tokens: tuple[int, ...],
        planes: Planes,
        served: threading.Event,
        deadline: float,
    ) -> None:
        served.wait(max(0.0, deadline - time.monotonic()))
        tally = ChunkTally()
        self.vault.publish(
            scope,
            tokens,
            layout=planes.layout,
            parts=planes.parts,
            logits_witnessed=planes.logits_witnessed,
            tally=tally,
        )
        if self.accounting is not None:
            self.accounting.count_published_chunks(
                sealed=tally.sealed, stored=tally.stored, namespace=scope.namespace
            )


class RequestPublication:
    """One request's cuts: encoded with one Encoder, durable ones deferred until served."""

    def __init__(self, publication: Publication, served: threading.Event) -> None:
        self._pub = publication
        self._served = served
        self._after: list[tuple[str, Callable[[], object]]] = []  # the engine thread's
        # Both used by the background worker only, one job at a time.
        self._encoder = Encoder()
        self._last: tuple[Snapshot, Planes] | None = None  # a cut offered twice is encoded once

    def cut(
        self, scope: Scope, tokens: Sequence[int], snap: Snapshot, *, resident: bool, durable: bool
    ) -> bool:
        """Encode `snap` (the state after `tokens`) and hold/publish it where asked;
        False when a queue was full (the cut is lost, never the response)."""
        pub = self._pub
        if not pub.enabled:
            return True
        tokens = tuple(tokens)
        deadline = time.monotonic() + pub.max_defer_s  # the bound counts from the cut

        def job() -> None:
            if self._last is not None and self._last[0] is snap:
                planes = self._last[1]
            else:
                planes = self._encoder.encode(snap)
                self._last = (snap, planes)
            if resident:
                pub.resident.hold(scope, tokens, planes)
            if durable:
                pub.deferred.submit(
                    f"publish@{len(tokens)}",
                    lambda: pub._publish(scope, tokens, planes, served, deadline),
                )

        served = self._served
        return pub.background.submit(f"cut@{len(tokens)}", job)

    def after_served(self, name: str, job: Callable[[], object]) -> bool:
        """Queue `job` for the background worker once the request is served (a hit's
        promotion); held whether or not publication is on."""
        if self._served.is_set():
            return self._pub.background.submit(name, job)
        self._after.append((name, job))
        return True

    def served(self) -> None:
        """The request is served (or gone): its durable cuts may be published now, and
        its promotions run."""
        self._pub._served(self._served)
        after, self._after = self._after, []
        for name, job in after:
            self._pub.background.submit(name, job)


def _in_turn(timeout: float | None, *steps: Callable[[float | None], bool]) -> bool:
    """Run each `step(timeout_left)` in order within one overall timeout; True if all did."""
    ends = None if timeout is None else time.monotonic() + timeout
    done = True
    for step in steps:
        left = None if ends is None else max(0.0, ends - time.monotonic())
        done = step(left) and done
    return done
