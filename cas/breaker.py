"""Circuit breaker: stop calling a dependency that keeps failing, and probe it to come back.

- failure: one call the dependency could not answer (a transport error, a timeout, a
  5xx); a verdict it did answer (not found, refused) is a success here.
- closed: calls go through; `threshold` failures in a row open the breaker.
- open: calls are refused at once for the backoff window, so an outage costs a caller
  nothing instead of a timeout or a retry schedule. Each time the breaker opens again
  without a success in between, the window doubles, up to `max_backoff_s`.
- half-open: after the window one call goes through as the probe (the others are still
  refused); its success closes the breaker, its failure opens it again. A probe that
  never reports (its caller was cancelled) is replaced after another window. `admit`
  tells a call it is the probe, so that a caller able to (the object store's door,
  cas/s3.py) lets the probe's answer reach the breaker even once nobody waits for it:
  a probe cancelled because a sibling call was refused would otherwise keep the
  breaker open for as long as calls come in pairs.

Thread-safe: the object store calls it from its event loop, the catalog from threads.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

State = Literal["closed", "open", "half-open"]
DEFAULT_THRESHOLD = 3
DEFAULT_BACKOFF_S = 5.0
DEFAULT_MAX_BACKOFF_S = 60.0


class Admission(enum.Enum):
    REFUSED = "refused"
    CALL = "call"  # the breaker is closed
    PROBE = "probe"  # the one call of a half-open breaker


@dataclass(frozen=True)
class BreakerState:
    """What a readiness probe reports about one dependency."""

    name: str
    state: State
    failures: int  # in a row
    retry_in_s: float  # until the next probe may go (0 when closed)
    skipped: int  # calls refused while open, since start

    @property
    def up(self) -> bool:
        return self.state == "closed"


class Breaker:
    def __init__(
        self,
        name: str,
        *,
        threshold: int = DEFAULT_THRESHOLD,
        backoff_s: float = DEFAULT_BACKOFF_S,
        max_backoff_s: float = DEFAULT_MAX_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold < 1:
            raise ValueError(f"breaker threshold must be >= 1, got {threshold!r}")
        if not 0 < backoff_s <= max_backoff_s < math.inf:
            raise ValueError(
                f"breaker backoff must satisfy 0 < backoff_s <= max_backoff_s < inf, got "
                f"{backoff_s!r} and {max_backoff_s!r}"
            )
        self.name = name
        self.threshold, self.backoff_s, self.max_backoff_s = threshold, backoff_s, max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._window = backoff_s
        self._open_until: float | None = None  # None: closed
        self._probe_until: float | None = None  # a probe is out until then
        self.skipped = 0

    def allow(self) -> bool:
        """Whether a call may go now (False: refuse it without calling)."""
        return self.admit() is not Admission.REFUSED

    def admit(self) -> Admission:
        """allow(), telling a call that may go whether it is the probe."""
        with self._lock:
            if self._open_until is None:
                return Admission.CALL
            now = self._clock()
            probing = self._probe_until is not None and now < self._probe_until
            if now < self._open_until or probing:
                self.skipped += 1
                return Admission.REFUSED
            self._probe_until = now + self._window  # this call is the probe
            return Admission.PROBE

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            self._window = self.backoff_s
            self._open_until = self._probe_until = None

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            now = self._clock()
            if self._probe_until is not None:  # the probe failed: open again, for longer
                self._window = min(self.max_backoff_s, self._window * 2)
                self._open_until, self._probe_until = now + self._window, None
            elif self._open_until is None and self._failures >= self.threshold:
                self._open_until = now + self._window
            # else: a call that started before the breaker opened; the window stands

    def state(self) -> BreakerState:
        with self._lock:
            if self._open_until is None:
                return BreakerState(self.name, "closed", self._failures, 0.0, self.skipped)
            retry = self._open_until - self._clock()
            state: State = "open" if retry > 0 else "half-open"
            return BreakerState(self.name, state, self._failures, max(0.0, retry), self.skipped)
