"""Gauges of what the vault holds and how it is kept, for /metrics (beside the counters).

- snapshot (VaultSnapshot): the catalog's stats (catalog/stats.py), the budget, and the
  fleet's last GC and last verify (catalog/runs.py), taken by the maintainer
  (kvpack/maintainer.py) off the event loop. A scrape renders the latest snapshot and
  never touches storage; `kvpack_vault_snapshot_timestamp_seconds` says how old it is.
- VaultGauges: a Prometheus collector over the snapshot, registered on the service's
  own registry, so /metrics shows the counters and the gauges together.

Gauges (absent until the first snapshot):
  kvpack_vault_footprint_bytes, kvpack_vault_stored_bytes, kvpack_vault_cut_bytes,
  kvpack_vault_pending_bytes, kvpack_vault_manifests, kvpack_vault_chunks,
  kvpack_vault_dedup_ratio, kvpack_vault_budget_bytes (when a budget is set),
  kvpack_tenant_footprint_bytes{namespace}, kvpack_tenant_cuts{namespace},
  kvpack_tenant_quota_bytes{namespace} (tenants with a quota),
  kvpack_gc_last_run_timestamp_seconds, kvpack_gc_last_success, kvpack_gc_last_evicted_cuts,
  kvpack_gc_last_freed_bytes, kvpack_gc_last_deleted_chunks,
  kvpack_verify_last_run_timestamp_seconds, kvpack_verify_last_success,
  kvpack_verify_last_problems, kvpack_vault_snapshot_timestamp_seconds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from catalog.runs import Run
from catalog.stats import VaultStats


@dataclass(frozen=True)
class VaultSnapshot:
    taken_at: float  # Unix time
    stats: VaultStats
    budget_bytes: int | None
    last_gc: Run | None
    last_verify: Run | None


class VaultGauges:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._snapshot: VaultSnapshot | None = None
        self._lock = threading.Lock()
        registry.register(self)

    @property
    def snapshot(self) -> VaultSnapshot | None:
        with self._lock:
            return self._snapshot

    def update(self, snapshot: VaultSnapshot) -> None:
        with self._lock:
            self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # names are only known from a snapshot; nothing to check at register

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if snap is None:
            return
        st, total = snap.stats, snap.stats.total

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield gauge(
            "kvpack_vault_footprint_bytes",
            "Plaintext bytes of the distinct chunks the vault's cuts reference.",
            total.footprint,
        )
        yield gauge(
            "kvpack_vault_stored_bytes",
            "Sealed bytes of every stored chunk, referenced or not.",
            st.stored_bytes,
        )
        yield gauge(
            "kvpack_vault_cut_bytes",
            "Plaintext bytes of every cut, each counted whole.",
            total.cut_bytes,
        )
        yield gauge(
            "kvpack_vault_pending_bytes",
            "Sealed bytes of chunks no cut references (reclaimed after the grace period).",
            st.pending_bytes,
        )
        yield gauge("kvpack_vault_manifests", "Cuts (manifests) in the catalog.", total.cuts)
        yield gauge("kvpack_vault_chunks", "Distinct chunks the cuts reference.", total.chunks)
        yield gauge(
            "kvpack_vault_dedup_ratio",
            "Cut bytes / footprint (1 without sharing).",
            total.dedup_ratio or 0.0,
        )
        if snap.budget_bytes is not None:
            yield gauge(
                "kvpack_vault_budget_bytes",
                "The vault's byte budget (footprint).",
                snap.budget_bytes,
            )
        footprint = GaugeMetricFamily(
            "kvpack_tenant_footprint_bytes", "A tenant's footprint.", labels=["namespace"]
        )
        cuts = GaugeMetricFamily("kvpack_tenant_cuts", "A tenant's cuts.", labels=["namespace"])
        quota = GaugeMetricFamily(
            "kvpack_tenant_quota_bytes", "A tenant's byte quota.", labels=["namespace"]
        )
        for t in st.tenants:
            footprint.add_metric([t.namespace], t.footprint)
            cuts.add_metric([t.namespace], t.cuts)
            if t.quota is not None:
                quota.add_metric([t.namespace], t.quota)
        yield from (footprint, cuts, quota)
        yield from _run_gauges("gc", snap.last_gc)
        yield from _run_gauges("verify", snap.last_verify)
        yield gauge(
            "kvpack_vault_snapshot_timestamp_seconds",
            "When these vault gauges were read from the catalog.",
            snap.taken_at,
        )


def _run_gauges(kind: str, run: Run | None) -> Iterator[Metric]:
    if run is None:
        return
    details = run.details or {}
    yield GaugeMetricFamily(
        f"kvpack_{kind}_last_run_timestamp_seconds",
        f"When the fleet's last {kind} pass finished.",
        value=run.finished_at.timestamp(),
    )
    yield GaugeMetricFamily(
        f"kvpack_{kind}_last_success",
        f"1 if the last {kind} pass found nothing wrong, else 0.",
        value=1.0 if run.outcome == "ok" else 0.0,
    )
    if kind == "gc":
        for key, doc in (
            ("evicted", "Cuts the last GC pass evicted."),
            ("freed_bytes", "Bytes the last GC pass's evictions freed."),
            ("deleted_chunks", "Chunks the last GC pass deleted."),
        ):
            name = "evicted_cuts" if key == "evicted" else key
            yield GaugeMetricFamily(f"kvpack_gc_last_{name}", doc, value=details.get(key, 0))
    else:
        yield GaugeMetricFamily(
            "kvpack_verify_last_problems",
            "Broken objects the last verify pass found.",
            value=details.get("problems", 0),
        )
