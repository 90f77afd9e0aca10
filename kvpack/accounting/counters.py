"""Hit accounting: counters that prove what the vault served, in Prometheus text format.

Words (see docs/architecture.md):
- hit: authenticated state restored and committed into an engine slot (invariant 4),
  or built through the same gate into the mlx-lm caches the Python API hands out
  (kvpack/service/interop.py). Nothing else is a hit, so `Accounting.count_hit` takes
  only a `CommittedRestore`.
- committed-restore receipt (`CommittedRestore`): proof that a swap returned. Its only
  public producer is `commit_restore(swap, ...)`, which runs the swap callable and hands
  back a receipt only if it returned without raising; the class refuses direct
  construction. A receipt counts once: recording it twice raises `ReceiptAlreadyRecorded`.
  (Python cannot make forgery impossible — the rule is that nothing but the code that
  performs the swap calls `commit_restore`; the API shape makes that the only easy path.)
- session continuation: the live slot's history was a prefix of the request. It has its
  own counter and never moves hits.
- remote prefill: a peer computed state for us; its own counter, never a hit.
- remote import: a peer's cut promoted into the durable tier or refused in quarantine
  (`kvpack_remote_imports_total{outcome}`); the hit, if any, is the restore after it.
- miss: no tier served; the request was prefilled from scratch (a verification failure
  that falls through to recompute is counted as a verification failure *and* a miss).
- bytes served: billed from the manifest for durable and remote (`kvpack_bytes_served_total`);
  the resident tier has no manifest, so its figure is an estimate under a distinct name
  (`kvpack_resident_bytes_served_estimate_total`) — invariant 7.
- condemned cut: a durable cut taken out of the vault because it failed verification
  (`kvpack_condemned_cuts_total{reason}`; catalog/condemn.py names the reasons).
- published chunks: the distinct chunks a durable publication sealed and uploaded
  (`kvpack_chunks_sealed_total`) and the ones it found stored already and skipped
  (`kvpack_chunks_already_stored_total`); the first is the chunks new to the store.
- first token: seconds from a request reaching the service to its first generated token,
  by the tier that served its prefix ("none": cold) (`kvpack_first_token_seconds`); the
  most recent ones are kept for the status page's plot (`recent_first_tokens`). A
  request that generates no token (its first is a stop token) records none.

Each service instance owns one `CollectorRegistry` (never the global default), so tests
and two services in one process never collide. With `per_namespace=True` every metric
carries a `namespace` label (the tenant); otherwise namespaces are aggregated.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

HIT_TIERS = ("resident", "durable", "remote")
IMPORT_OUTCOMES = ("promoted", "refused")
Tier = Literal["resident", "durable", "remote"]
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
DEFAULT_NAMESPACE = "default"
SERVED_BY = ("none", "session", *HIT_TIERS)  # what served a request's prefix
RECENT_FIRST_TOKENS = 200


@dataclass(frozen=True, slots=True)
class FirstToken:
    at: float  # Unix time
    tier: str  # one of SERVED_BY
    seconds: float
    prompt_tokens: int


T = TypeVar("T")


class AccountingError(Exception):
    """Base of every error accounting raises."""


class ReceiptForged(AccountingError, TypeError):
    """Someone built a CommittedRestore without performing a swap."""

    def __init__(self) -> None:
        super().__init__("CommittedRestore is only produced by commit_restore() after a swap")


class ReceiptAlreadyRecorded(AccountingError):
    """A receipt was offered twice; one commit is one hit."""

    def __init__(self, receipt: CommittedRestore) -> None:
        super().__init__(
            f"receipt for a {receipt.tier} restore of depth {receipt.depth} was already recorded"
        )
        self.receipt = receipt


class AccountingInputError(AccountingError, ValueError):
    """A bad argument; `what` names it."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"accounting: bad {what}: {reason}")
        self.what, self.reason = what, reason


_SEAL = object()  # only commit_restore holds it


class _Claim:
    """The one-shot latch a receipt carries; mutable inside a frozen receipt."""

    __slots__ = ("_lock", "spent")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spent = False

    def take(self) -> bool:
        with self._lock:
            if self.spent:
                return False
            self.spent = True
            return True


@dataclass(frozen=True)
class CommittedRestore:
    """Proof that restored state was swapped into a slot. Build it with commit_restore()."""

    tier: Tier
    depth: int  # tokens restored
    restore_seconds: float
    manifest_bytes: int | None  # durable and remote: billed from the manifest
    estimated_bytes: int | None  # resident: an estimate, labelled so
    namespace: str | None
    _seal: object = field(repr=False, compare=False)
    _claim: _Claim = field(default_factory=_Claim, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._seal is not _SEAL:
            raise ReceiptForged()


def _check_count(what: str, value: object, *, positive: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (1 if positive else 0):
        bound = "> 0" if positive else ">= 0"
        raise AccountingInputError(what, f"must be an int {bound}, got {value!r}")
    return value


def _check_seconds(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AccountingInputError(what, f"must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise AccountingInputError(what, f"must be finite and >= 0, got {value!r}")
    return float(value)


def commit_restore(
    swap: Callable[[], T],
    *,
    tier: Tier,
    depth: int,
    manifest_bytes: int | None = None,
    estimated_bytes: int | None = None,
    namespace: str | None = None,
    started_at: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[T, CommittedRestore]:
    """Run `swap` (the engine's restore that commits KV and logits) and return its result
    with a receipt. If `swap` raises, the exception propagates and no receipt exists.

    Restore seconds run from `started_at` (a `clock()` reading taken before the fetch, so
    fetch + verify + swap are all counted) or, without it, around the swap alone.
    Resident restores pass `estimated_bytes`; durable and remote pass `manifest_bytes`.
    """
    if tier not in HIT_TIERS:
        raise AccountingInputError("tier", f"a hit comes from one of {HIT_TIERS}, not {tier!r}")
    _check_count("depth", depth, positive=True)
    if tier == "resident":
        if manifest_bytes is not None or estimated_bytes is None:
            raise AccountingInputError(
                "bytes", "the resident tier has no manifest: pass estimated_bytes only"
            )
        _check_count("estimated_bytes", estimated_bytes)
    else:
        if estimated_bytes is not None or manifest_bytes is None:
            raise AccountingInputError(
                "bytes", f"the {tier} tier bills from the manifest: pass manifest_bytes only"
            )
        _check_count("manifest_bytes", manifest_bytes)
    start = clock() if started_at is None else started_at
    result = swap()
    seconds = _check_seconds("restore_seconds", clock() - start)
    receipt = CommittedRestore(
        tier=tier,
        depth=depth,
        restore_seconds=seconds,
        manifest_bytes=manifest_bytes,
        estimated_bytes=estimated_bytes,
        namespace=namespace,
        _seal=_SEAL,
    )
    return result, receipt


class Accounting:
    """The counters of one service instance, on its own registry."""

    def __init__(self, *, per_namespace: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.per_namespace = per_namespace
        ns = ("namespace",) if per_namespace else ()
        r = self.registry
        self._hits = Counter(
            "kvpack_hits", "Restores committed into a slot, by tier.", ("tier", *ns), registry=r
        )
        self._restored_tokens = Counter(
            "kvpack_restored_tokens",
            "Tokens of state restored by committed hits, by tier.",
            ("tier", *ns),
            registry=r,
        )
        self._continuations = Counter(
            "kvpack_session_continuations",
            "Requests continued from the live slot's history (never a hit).",
            ns,
            registry=r,
        )
        self._remote_prefills = Counter(
            "kvpack_remote_prefills", "Prefills computed by a peer (never a hit).", ns, registry=r
        )
        self._remote_imports = Counter(
            "kvpack_remote_imports",
            "Remote imports by outcome: promoted into the durable tier, or refused and left "
            "in quarantine (an import is not a hit; the restore that follows may be).",
            ("outcome", *ns),
            registry=r,
        )
        self._misses = Counter(
            "kvpack_misses", "Requests no tier served (prefilled from scratch).", ns, registry=r
        )
        self._verify_failures = Counter(
            "kvpack_verification_failures",
            "State refused by a verification step, by tier (each falls through to recompute).",
            ("tier", *ns),
            registry=r,
        )
        self._bytes = Counter(
            "kvpack_bytes_served",
            "Bytes served by committed hits, billed from the manifest (durable, remote).",
            ("tier", *ns),
            registry=r,
        )
        self._resident_bytes = Counter(
            "kvpack_resident_bytes_served_estimate",
            "ESTIMATED bytes served by resident hits (payload lengths; no manifest to bill).",
            ns,
            registry=r,
        )
        self._restore_seconds = Histogram(
            "kvpack_restore_seconds",
            "Seconds from the start of a restore to its committed swap, by tier.",
            ("tier", *ns),
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self._prefill_seconds = Histogram(
            "kvpack_prefill_seconds",
            "Seconds spent prefilling tokens locally.",
            ns,
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self._prefill_tokens = Counter(
            "kvpack_prefill_tokens", "Tokens prefilled locally.", ns, registry=r
        )
        self._condemned = Counter(
            "kvpack_condemned_cuts",
            "Durable cuts condemned (taken out of the vault) after failing verification, "
            "by reason.",
            ("reason", *ns),
            registry=r,
        )
        self._chunks_sealed = Counter(
            "kvpack_chunks_sealed",
            "Chunks durable publication sealed and uploaded (new to the store).",
            ns,
            registry=r,
        )
        self._chunks_stored = Counter(
            "kvpack_chunks_already_stored",
            "Chunks durable publication found stored already, so neither sealed nor uploaded.",
            ns,
            registry=r,
        )
        self._first_token = Histogram(
            "kvpack_first_token_seconds",
            "Seconds from a request reaching the service to its first generated token, by "
            "the tier that served its prefix (none: a cold prefill).",
            ("tier", *ns),
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self._recent: deque[FirstToken] = deque(maxlen=RECENT_FIRST_TOKENS)
        self._recent_lock = threading.Lock()
        if not per_namespace:
            # Zero series exist from the start, so a scrape before traffic shows every tier.
            for tier in HIT_TIERS:
                for metric in (self._hits, self._restored_tokens, self._verify_failures):
                    metric.labels(tier=tier)
                self._restore_seconds.labels(tier=tier)
            for tier in ("durable", "remote"):
                self._bytes.labels(tier=tier)

    def _ns(self, namespace: str | None) -> dict[str, str]:
        if not self.per_namespace:
            return {}
        if namespace is not None and (not isinstance(namespace, str) or not namespace):
            raise AccountingInputError("namespace", "must be a non-empty string or None")
        return {"namespace": namespace or DEFAULT_NAMESPACE}

    def _labelled(self, metric: Any, namespace: str | None, **labels: str) -> Any:
        labels.update(self._ns(namespace))
        return metric.labels(**labels) if labels else metric

    # -- counting ---------------------------------------------------------------

    def count_hit(self, commit: CommittedRestore) -> None:
        """Count one hit. Only a committed-restore receipt counts, and only once."""
        if not isinstance(commit, CommittedRestore):
            raise AccountingInputError(
                "commit", f"a hit needs a CommittedRestore receipt, got {type(commit).__name__}"
            )
        if not commit._claim.take():
            raise ReceiptAlreadyRecorded(commit)
        ns, tier = commit.namespace, commit.tier
        self._labelled(self._hits, ns, tier=tier).inc()
        self._labelled(self._restored_tokens, ns, tier=tier).inc(commit.depth)
        self._labelled(self._restore_seconds, ns, tier=tier).observe(commit.restore_seconds)
        if commit.tier == "resident":
            self._labelled(self._resident_bytes, ns).inc(commit.estimated_bytes or 0)
        else:
            self._labelled(self._bytes, ns, tier=tier).inc(commit.manifest_bytes or 0)

    def count_session_continuation(self, *, namespace: str | None = None) -> None:
        self._labelled(self._continuations, namespace).inc()

    def count_remote_prefill(self, *, namespace: str | None = None) -> None:
        self._labelled(self._remote_prefills, namespace).inc()

    def count_remote_import(self, *, outcome: str, namespace: str | None = None) -> None:
        if outcome not in IMPORT_OUTCOMES:
            raise AccountingInputError("outcome", f"must be one of {IMPORT_OUTCOMES}")
        self._labelled(self._remote_imports, namespace, outcome=outcome).inc()

    def count_miss(self, *, namespace: str | None = None) -> None:
        self._labelled(self._misses, namespace).inc()

    def count_verification_failure(self, *, tier: Tier, namespace: str | None = None) -> None:
        if tier not in HIT_TIERS:
            raise AccountingInputError("tier", f"must be one of {HIT_TIERS}, not {tier!r}")
        self._labelled(self._verify_failures, namespace, tier=tier).inc()

    def count_prefill(self, *, seconds: float, tokens: int, namespace: str | None = None) -> None:
        """Local prefill work, whatever tier served the prefix (the suffix is prefilled too)."""
        seconds = _check_seconds("seconds", seconds)
        _check_count("tokens", tokens)
        self._labelled(self._prefill_seconds, namespace).observe(seconds)
        self._labelled(self._prefill_tokens, namespace).inc(tokens)

    def count_condemned(self, *, reason: str, cuts: int = 1, namespace: str | None = None) -> None:
        if not isinstance(reason, str) or not reason:
            raise AccountingInputError("reason", "must be a non-empty string")
        _check_count("cuts", cuts, positive=True)
        self._labelled(self._condemned, namespace, reason=reason).inc(cuts)

    def count_published_chunks(
        self, *, sealed: int, stored: int, namespace: str | None = None
    ) -> None:
        self._labelled(self._chunks_sealed, namespace).inc(_check_count("sealed", sealed))
        self._labelled(self._chunks_stored, namespace).inc(_check_count("stored", stored))

    def observe_first_token(
        self, *, seconds: float, tier: str, prompt_tokens: int, namespace: str | None = None
    ) -> None:
        if tier not in SERVED_BY:
            raise AccountingInputError("tier", f"must be one of {SERVED_BY}, not {tier!r}")
        seconds = _check_seconds("seconds", seconds)
        self._labelled(self._first_token, namespace, tier=tier).observe(seconds)
        with self._recent_lock:
            self._recent.append(FirstToken(time.time(), tier, seconds, prompt_tokens))

    def recent_first_tokens(self) -> list[FirstToken]:
        """The latest first-token times, oldest first (at most RECENT_FIRST_TOKENS)."""
        with self._recent_lock:
            return list(self._recent)

    # -- reading ------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type, for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def snapshot(self) -> dict[str, float]:
        """Every counter summed over labels, JSON-able (the bench's before/after counters)."""
        out: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created") or sample.name.endswith("_bucket"):
                    continue
                key = sample.name
                if "tier" in sample.labels:
                    key = f"{sample.name}:{sample.labels['tier']}"
                out[key] = out.get(key, 0.0) + sample.value
        return out

    def value(self, name: str, **labels: str) -> float:
        """One sample's value (0.0 when the series does not exist yet)."""
        got = self.registry.get_sample_value(name, labels)
        return 0.0 if got is None else got

    def total(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples whose labels include `labels` (e.g. every tenant's)."""
        return sum(
            s.value
            for family in self.registry.collect()
            for s in family.samples
            if s.name == name and labels.items() <= s.labels.items()
        )
