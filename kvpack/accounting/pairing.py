"""Paired timings without paying for a second prefill (invariant 8).

- prefill clock: when this process prefills a prompt from depth 0 it notes, at every
  aligned boundary and at the prompt's end, how long the local prefill of exactly that
  cut took (the publication work done at earlier boundaries is subtracted). The key is
  (identity, chain digest of the cut), so it names the very tokens prefilled.
- pairing: the first later hit in this process that restores the same cut under the
  same identity takes that measurement and becomes one paired timing (restore seconds
  from the hit's receipt: fetch + verify + decode + swap). Each prefill measurement
  pairs at most once, so no prefill is counted twice and nothing is extrapolated; a hit
  on a cut this process never prefilled (say, after a restart) yields no pair.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from catalog.ids import ChainDigest, IdentityDigest
from catalog.ledger import PairedTiming
from kvpack.accounting.counters import CommittedRestore

DEFAULT_CAPACITY = 4096


class PrefillClock:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._seconds: OrderedDict[tuple[IdentityDigest, ChainDigest], float] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, *, identity: IdentityDigest, chain: ChainDigest, seconds: float) -> None:
        if seconds <= 0:
            return
        key = (identity, chain)
        with self._lock:
            self._seconds[key] = seconds
            self._seconds.move_to_end(key)
            while len(self._seconds) > self.capacity:
                self._seconds.popitem(last=False)

    def pair(
        self, *, identity: IdentityDigest, chain: ChainDigest, receipt: CommittedRestore
    ) -> PairedTiming | None:
        """The paired timing for this hit, if this process prefilled the same cut."""
        with self._lock:
            prefill = self._seconds.pop((identity, chain), None)
        if prefill is None or receipt.restore_seconds <= 0:
            return None
        return PairedTiming(
            identity=identity,
            tier=receipt.tier,
            depth=receipt.depth,
            restore_seconds=receipt.restore_seconds,
            prefill_seconds=prefill,
        )
