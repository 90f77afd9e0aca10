"""The maintainer: the vault kept without being asked, in `kvpack serve` (docs/architecture.md
and the README's "Operating a vault").

On one background thread ("kvpack-maintainer"), every `gc_interval_s`:
1. take the catalog lease "gc" (catalog/lease.py); if another instance of the fleet
   holds it, skip this pass (one collector at a time);
2. GC (catalog/gc.py): each tenant down to its quota, everyone down to the budget,
   chunks unreferenced for the grace period, and every ORPHAN_EVERY passes (the first
   included) the objects no row names; the lease is renewed at every GC checkpoint, and
   a collector that has lost it stops there;
3. quarantined imports older than the retention (kvpack/remote/quarantine.py);
4. record the pass in the catalog (catalog/runs.py: the fleet's last GC) and release
   the lease.
Every `verify_interval_s` (0: never) it verifies the vault's manifests and chunk sizes
(catalog/verify.py, no data read) under the lease "verify", and records that too.
Every `stats_interval_s` it reads the vault's stats and the last runs into the gauges
(kvpack/accounting/gauges.py) that /metrics and the status page show.

A maintainer that dies mid-pass leaves its lease to expire (LEASE_TTL) and its
half-done GC for the next collector to finish (catalog/gc.py). `collect_once` and
`verify_once` are also what `kvpack vault gc` and the tests call.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import EllipsisType
from typing import Any

from catalog import lease, runs
from catalog.gc import GcReport
from catalog.stats import vault_stats
from catalog.tx import run_tx
from catalog.verify import VerifyReport
from kvpack.accounting.counters import Accounting
from kvpack.accounting.gauges import VaultGauges, VaultSnapshot
from kvpack.remote.quarantine import Quarantine
from kvpack.vault import Vault

log = logging.getLogger(__name__)
LEASE_TTL = timedelta(minutes=5)
DEFAULT_STATS_INTERVAL_S = 30.0
ORPHAN_EVERY = 12  # passes between orphan sweeps (each lists the whole store)
GC_LEASE, VERIFY_LEASE = "gc", "verify"
Checkpoint = Callable[[str], Awaitable[None]]


class LeaseLost(Exception):
    """The collector's lease expired and another instance took it: it stops at once."""


@dataclass(frozen=True)
class Pass:
    """One maintenance pass: what it did, or who held the lease instead."""

    kind: str  # "gc" | "verify"
    outcome: str  # "ok" | "problems" | "failed" | "skipped"
    holder: str  # who ran it, or (skipped) who holds the lease
    report: GcReport | VerifyReport | None = None
    quarantine_dropped: int = 0
    error: str | None = None


def holder_id(vault: Vault) -> str:
    """Who this instance is, in leases and run records."""
    return f"{vault.producer}@{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Maintainer:
    def __init__(
        self,
        *,
        vault: Vault,
        quarantine: Quarantine | None = None,
        accounting: Accounting | None = None,
        budget_bytes: int | None = None,
        gc_interval_s: float = 300.0,
        grace_s: float = 3600.0,
        quarantine_retention_s: float = 7 * 86400.0,
        verify_interval_s: float = 0.0,
        stats_interval_s: float = DEFAULT_STATS_INTERVAL_S,
        lease_ttl: timedelta = LEASE_TTL,
        holder: str | None = None,
    ) -> None:
        for name, value in (
            ("gc_interval_s", gc_interval_s),
            ("grace_s", grace_s),
            ("verify_interval_s", verify_interval_s),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.vault = vault
        self.quarantine = quarantine if quarantine is not None else Quarantine(vault)
        self.budget_bytes = budget_bytes
        self.gc_interval_s = gc_interval_s
        self.grace = timedelta(seconds=grace_s)
        self.retention = timedelta(seconds=quarantine_retention_s)
        self.verify_interval_s = verify_interval_s
        self.stats_interval_s = stats_interval_s
        self.lease_ttl = lease_ttl
        self.holder = holder or holder_id(vault)
        self.gauges = VaultGauges(accounting.registry) if accounting is not None else None
        self.passes = 0  # GC passes this maintainer ran (not the skipped ones)
        self.last: Pass | None = None
        self._passed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the thread -----------------------------------------------------------------

    def start(self, *, refreshed: bool = False) -> None:
        """Start the thread. `refreshed`: the caller has just filled the gauges
        (`refresh`), so the first stats refresh waits an interval instead of running at
        once (`kvpack serve` fills them before it reports ready: the first refresh pays
        for its queries' first use, 50-75 ms measured here, which would otherwise fall on
        the first requests)."""
        self._thread = threading.Thread(
            target=self._loop, args=(refreshed,), name="kvpack-maintainer", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop after the pass in progress (bounded wait)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def wait_passes(self, n: int, timeout: float) -> bool:
        """Wait until this maintainer has run `n` GC passes; False if `timeout` passed."""
        with self._passed:
            return self._passed.wait_for(lambda: self.passes >= n, timeout)

    def _loop(self, refreshed: bool) -> None:
        now = time.monotonic()
        next_gc = now + self.gc_interval_s if self.gc_interval_s else None
        next_verify = now + self.verify_interval_s if self.verify_interval_s else None
        next_stats = now + self.stats_interval_s if refreshed else now
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if next_gc is not None and now >= next_gc:
                    self.collect_once()
                    next_gc = time.monotonic() + self.gc_interval_s
                    next_stats = now
                if next_verify is not None and now >= next_verify:
                    done = self.verify_once()
                    if done.outcome == "problems" and isinstance(done.report, VerifyReport):
                        log.error(
                            "verify: %d broken object(s), %d cut(s) affected: run `kvpack "
                            "vault verify --repair`", len(done.report.problems),
                            len(done.report.broken_cuts),
                        )  # fmt: skip
                    next_verify = time.monotonic() + self.verify_interval_s
                    next_stats = now
                if now >= next_stats:
                    self.refresh()
                    next_stats = time.monotonic() + self.stats_interval_s
            except Exception:  # noqa: BLE001 - the maintainer outlives a bad pass
                log.exception("maintenance failed; trying again next interval")
                next_stats = time.monotonic() + self.stats_interval_s
            due = [t for t in (next_gc, next_verify, next_stats) if t is not None]
            self._stop.wait(max(0.0, min(due) - time.monotonic()))

    # -- passes -----------------------------------------------------------------------

    def collect_once(
        self,
        *,
        budget_bytes: int | None | EllipsisType = ...,
        grace: timedelta | None = None,
        orphans: bool | None = None,
        checkpoint: Checkpoint | None = None,
    ) -> Pass:
        """One GC pass under the lease; outcome "skipped" when another instance holds it.
        Arguments left out take the maintainer's own settings."""
        budget = self.budget_bytes if isinstance(budget_bytes, EllipsisType) else budget_bytes
        sweep = self.passes % ORPHAN_EVERY == 0 if orphans is None else orphans
        started = _now()
        held = self._acquire(GC_LEASE)
        if held is not None:
            return self._skipped("gc", held)

        async def keep(name: str) -> None:
            if not await run_tx(self.vault.db, self._renewer(GC_LEASE)):
                raise LeaseLost(f"lease {GC_LEASE!r} lost at {name}")
            if checkpoint is not None:
                await checkpoint(name)

        try:
            report = self.vault.collect(
                budget_bytes=budget,
                grace=grace if grace is not None else self.grace,
                orphans=sweep,
                checkpoint=keep,
            )
            dropped = self.quarantine.collect(retention=self.retention)
        except Exception as e:  # noqa: BLE001 - recorded, then raised
            self._record("gc", started, "failed", {"error": f"{type(e).__name__}: {e}"})
            self._release(GC_LEASE)
            self.last = Pass("gc", "failed", self.holder, error=f"{type(e).__name__}: {e}")
            raise
        details = {**report.to_json(), "quarantine_dropped": dropped, "budget_bytes": budget}
        self._record("gc", started, "ok", details)
        self._release(GC_LEASE)
        log.info(
            "gc: footprint %d -> %d bytes, %d cuts evicted, %d chunks deleted",
            report.footprint_before,
            report.footprint_after,
            len(report.evicted),
            len(report.deleted_chunks),
        )
        self.last = Pass("gc", "ok", self.holder, report, dropped)
        with self._passed:
            self.passes += 1
            self._passed.notify_all()
        return self.last

    def verify_once(
        self,
        *,
        read_data: bool = False,
        sample: float = 1.0,
        repair: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> Pass:
        """One verify pass (manifests and chunk sizes; `read_data`: every byte too, or a
        `sample` fraction) under its lease, recorded; `repair` condemns what is broken."""
        started = _now()
        held = self._acquire(VERIFY_LEASE)
        if held is not None:
            return self._skipped("verify", held)
        try:
            report = self.vault.verify(
                read_data=read_data, sample=sample, repair=repair, progress=progress
            )
        except Exception as e:  # noqa: BLE001 - recorded, then raised
            self._record("verify", started, "failed", {"error": f"{type(e).__name__}: {e}"})
            self._release(VERIFY_LEASE)
            raise
        outcome = "ok" if report.ok else "problems"
        self._record("verify", started, outcome, verify_summary(report))
        self._release(VERIFY_LEASE)
        self.last = Pass("verify", outcome, self.holder, report)
        return self.last

    def refresh(self) -> VaultSnapshot:
        """Read the vault's stats and last runs into the gauges."""
        with self.vault.transaction() as s:
            snapshot = VaultSnapshot(
                taken_at=time.time(),
                stats=vault_stats(session=s),
                budget_bytes=self.budget_bytes,
                last_gc=runs.last(session=s, kind="gc"),
                last_verify=runs.last(session=s, kind="verify"),
            )
        if self.gauges is not None:
            self.gauges.update(snapshot)
        return snapshot

    # -- the lease and the record -----------------------------------------------------

    def _acquire(self, name: str) -> str | None:
        """None when we hold the lease now; else who does."""
        with self.vault.transaction() as s:
            got = lease.acquire(
                session=s, name=name, holder=self.holder, ttl=self.lease_ttl, now=_now()
            )
            if got is not None:
                return None
            other = lease.holder_of(session=s, name=name)
            return other.holder if other is not None else "?"

    def _renewer(self, name: str) -> Callable[[Any], bool]:
        return lambda s: lease.renew(
            session=s, name=name, holder=self.holder, ttl=self.lease_ttl, now=_now()
        )

    def _release(self, name: str) -> None:
        with self.vault.transaction() as s:
            lease.release(session=s, name=name, holder=self.holder)

    def _skipped(self, kind: str, holder: str) -> Pass:
        log.info("%s: skipped, %s holds the lease", kind, holder)
        self.last = Pass(kind, "skipped", holder)
        return self.last

    def _record(self, kind: str, started: datetime, outcome: str, details: dict) -> None:
        with self.vault.transaction() as s:
            runs.record(
                session=s,
                kind=kind,
                holder=self.holder,
                started_at=started,
                finished_at=_now(),
                outcome=outcome,
                details=details,
            )


def verify_summary(report: VerifyReport) -> dict[str, Any]:
    """What a run record keeps of a verify report (counts, and the first problems)."""
    doc = report.to_json()
    return {
        **{k: v for k, v in doc.items() if k not in ("problems", "repaired")},
        "problems": len(report.problems),
        "repaired": len(report.repaired),
        "first_problems": doc["problems"][:20],
    }


def _now() -> datetime:
    return datetime.now(UTC)
