"""Hit accounting: receipts gate hits, other events have their own counters, /metrics text."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from kvpack.accounting.counters import (
    Accounting,
    AccountingInputError,
    CommittedRestore,
    ReceiptAlreadyRecorded,
    ReceiptForged,
    commit_restore,
)

MANIFEST_BYTES = 12_345


def durable_receipt(depth=256, *, namespace=None):
    _, receipt = commit_restore(
        lambda: None,
        tier="durable",
        depth=depth,
        manifest_bytes=MANIFEST_BYTES,
        namespace=namespace,
    )
    return receipt


def parse(acc):
    text, content_type = acc.render()
    assert content_type.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    return families, samples


def test_receipt_cannot_be_built_without_a_swap():
    """Branch: constructing CommittedRestore directly (no seal) raises ReceiptForged."""
    with pytest.raises(ReceiptForged):
        CommittedRestore(
            tier="durable",
            depth=256,
            restore_seconds=0.1,
            manifest_bytes=1,
            estimated_bytes=None,
            namespace=None,
            _seal=object(),
        )


def test_failed_swap_yields_no_receipt_and_no_hit():
    """Branch: a swap that raises propagates its error; nothing is returned to record."""
    acc = Accounting()

    def swap():
        raise RuntimeError("shape gate refused")

    with pytest.raises(RuntimeError, match="shape gate"):
        commit_restore(swap, tier="durable", depth=256, manifest_bytes=MANIFEST_BYTES)
    assert acc.value("kvpack_hits_total", tier="durable") == 0


def test_commit_restore_returns_swap_result_and_runs_it_once():
    """Branch: the swap runs exactly once, before the receipt exists, and its value returns."""
    calls = []
    result, receipt = commit_restore(
        lambda: calls.append(1) or "slot-3", tier="resident", depth=512, estimated_bytes=99
    )
    assert result == "slot-3" and calls == [1]
    assert (receipt.tier, receipt.depth, receipt.estimated_bytes) == ("resident", 512, 99)


def test_count_hit_refuses_anything_but_a_receipt():
    """Branch: a duck-typed object with the receipt's fields is not a hit."""
    acc = Accounting()
    fake = dataclasses.make_dataclass(
        "Fake",
        ["tier", "depth", "restore_seconds", "manifest_bytes", "estimated_bytes", "namespace"],
    )("durable", 256, 0.1, 10, None, None)
    for thing in (fake, {"tier": "durable"}, None):
        with pytest.raises(AccountingInputError):
            acc.count_hit(thing)
    assert acc.value("kvpack_hits_total", tier="durable") == 0


def test_a_receipt_counts_once_even_when_copied():
    """Branch: recording the same receipt (or a copy/replace of it) again raises."""
    acc = Accounting()
    receipt = durable_receipt()
    acc.count_hit(receipt)
    for again in (receipt, copy.copy(receipt), dataclasses.replace(receipt, depth=9)):
        with pytest.raises(ReceiptAlreadyRecorded):
            acc.count_hit(again)
    assert acc.value("kvpack_hits_total", tier="durable") == 1


def test_counter_alibi_hits_advance_by_exactly_n():
    """Branch (invariant 4 alibi): one cold request (a miss + prefill) then n committed
    durable restores: hits advance by n, prefills and misses do not move, bytes served is
    n x the manifest's bytes."""
    acc = Accounting()
    acc.count_miss()
    acc.count_prefill(seconds=0.5, tokens=256)
    before = acc.snapshot()
    n = 5
    for _ in range(n):
        acc.count_hit(durable_receipt())
    after = acc.snapshot()
    assert after["kvpack_hits_total:durable"] - before["kvpack_hits_total:durable"] == n
    assert after["kvpack_misses_total"] == before["kvpack_misses_total"] == 1
    assert after["kvpack_prefill_seconds_count"] == before["kvpack_prefill_seconds_count"] == 1
    assert after["kvpack_prefill_tokens_total"] == 256
    assert acc.value("kvpack_bytes_served_total", tier="durable") == n * MANIFEST_BYTES
    assert acc.value("kvpack_restored_tokens_total", tier="durable") == n * 256
    assert acc.value("kvpack_restore_seconds_count", tier="durable") == n
    assert after["kvpack_hits_total:resident"] == after["kvpack_hits_total:remote"] == 0


def test_session_continuations_and_remote_prefills_never_move_hits():
    """Branch (invariant 4): continuations, remote prefills, misses and verification
    failures each have their own counter and leave every hit counter at zero."""
    acc = Accounting()
    acc.count_session_continuation()
    acc.count_session_continuation()
    acc.count_remote_prefill()
    acc.count_miss()
    acc.count_verification_failure(tier="durable")
    snap = acc.snapshot()
    assert snap["kvpack_session_continuations_total"] == 2
    assert snap["kvpack_remote_prefills_total"] == 1
    assert snap["kvpack_misses_total"] == 1
    assert snap["kvpack_verification_failures_total:durable"] == 1
    assert all(snap[f"kvpack_hits_total:{t}"] == 0 for t in ("resident", "durable", "remote"))


def test_resident_bytes_are_an_estimate_under_their_own_name():
    """Branch (invariant 7): a resident hit adds to the *estimate* metric and never to the
    manifest-billed bytes served."""
    acc = Accounting()
    _, receipt = commit_restore(lambda: None, tier="resident", depth=256, estimated_bytes=4096)
    acc.count_hit(receipt)
    assert acc.value("kvpack_resident_bytes_served_estimate_total") == 4096
    assert acc.value("kvpack_bytes_served_total", tier="durable") == 0
    assert acc.value("kvpack_bytes_served_total", tier="resident") == 0
    assert acc.value("kvpack_hits_total", tier="resident") == 1


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"tier": "session", "manifest_bytes": 1}, "tier"),
        ({"tier": "resident", "manifest_bytes": 1}, "bytes"),
        ({"tier": "resident", "manifest_bytes": 1, "estimated_bytes": 1}, "bytes"),
        ({"tier": "durable", "estimated_bytes": 1}, "bytes"),
        ({"tier": "remote"}, "bytes"),
        ({"tier": "durable", "manifest_bytes": -1}, "manifest_bytes"),
        ({"tier": "durable", "manifest_bytes": 1, "depth": 0}, "depth"),
    ],
)
def test_commit_restore_rejects_bad_tier_and_byte_basis(kwargs, what):
    """Branch: a session tier, a manifest-less durable/remote bill, or a resident bill that
    claims a manifest are refused before the swap runs."""
    ran = []
    kwargs = {"depth": 256, **kwargs}
    with pytest.raises(AccountingInputError) as e:
        commit_restore(lambda: ran.append(1), **kwargs)
    assert e.value.what == what
    assert ran == []


def test_restore_seconds_span_from_started_at_through_the_swap():
    """Branch: with started_at the receipt times fetch + swap; without it, the swap alone."""
    ticks = iter([5.0, 7.5])
    _, receipt = commit_restore(
        lambda: None,
        tier="durable",
        depth=256,
        manifest_bytes=1,
        started_at=2.0,
        clock=lambda: next(ticks),
    )
    assert receipt.restore_seconds == 3.0  # 5.0 (after the swap) - 2.0 (started_at)
    assert next(ticks) == 7.5  # the clock was read once: started_at replaced the first read
    ticks = iter([5.0, 7.5])
    _, receipt = commit_restore(
        lambda: None, tier="durable", depth=256, manifest_bytes=1, clock=lambda: next(ticks)
    )
    assert receipt.restore_seconds == 2.5
    acc = Accounting()
    acc.count_hit(receipt)
    assert acc.value("kvpack_restore_seconds_sum", tier="durable") == 2.5


def test_prometheus_text_parses_with_expected_samples():
    """Branch: the exposition parses with prometheus_client's parser and carries every
    counter family, zero series for each tier before traffic, and the recorded values."""
    acc = Accounting()
    families, samples = parse(acc)
    for tier in ("resident", "durable", "remote"):
        assert samples[("kvpack_hits_total", (("tier", tier),))] == 0
    acc.count_hit(durable_receipt())
    acc.count_session_continuation()
    acc.count_prefill(seconds=0.02, tokens=300)
    families, samples = parse(acc)
    assert families["kvpack_hits"].type == "counter"
    assert families["kvpack_restore_seconds"].type == "histogram"
    assert families["kvpack_prefill_seconds"].type == "histogram"
    assert families["kvpack_resident_bytes_served_estimate"].type == "counter"
    assert samples[("kvpack_hits_total", (("tier", "durable"),))] == 1
    assert samples[("kvpack_bytes_served_total", (("tier", "durable"),))] == MANIFEST_BYTES
    assert samples[("kvpack_session_continuations_total", ())] == 1
    assert samples[("kvpack_prefill_seconds_count", ())] == 1
    assert samples[("kvpack_prefill_seconds_bucket", (("le", "0.025"),))] == 1
    assert samples[("kvpack_prefill_seconds_bucket", (("le", "0.01"),))] == 0
    assert samples[("kvpack_prefill_tokens_total", ())] == 300
    assert {"kvpack_misses", "kvpack_remote_prefills", "kvpack_verification_failures"} <= set(
        families
    )


def test_each_service_has_its_own_registry():
    """Branch: two Accounting instances in one process neither collide nor share counts,
    and the global default registry is untouched."""
    a, b = Accounting(), Accounting()
    a.count_hit(durable_receipt())
    assert a.value("kvpack_hits_total", tier="durable") == 1
    assert b.value("kvpack_hits_total", tier="durable") == 0
    assert REGISTRY.get_sample_value("kvpack_hits_total", {"tier": "durable"}) is None


def test_per_namespace_labels_split_tenants():
    """Branch: with per_namespace the namespace label separates tenants; None is 'default'."""
    acc = Accounting(per_namespace=True)
    acc.count_hit(durable_receipt(namespace="acme"))
    acc.count_hit(durable_receipt(namespace="acme"))
    acc.count_hit(durable_receipt())
    acc.count_miss(namespace="zeta")
    _, samples = parse(acc)
    key = "kvpack_hits_total"
    assert samples[(key, (("namespace", "acme"), ("tier", "durable")))] == 2
    assert samples[(key, (("namespace", "default"), ("tier", "durable")))] == 1
    assert samples[("kvpack_misses_total", (("namespace", "zeta"),))] == 1
    with pytest.raises(AccountingInputError):
        acc.count_miss(namespace="")


def test_total_sums_the_series_that_carry_the_given_labels():
    """Branch: total() adds every series of a name whose labels include the given ones
    (all tenants, or one), where value() needs every label of one series."""
    acc = Accounting(per_namespace=True)
    acc.count_hit(durable_receipt(depth=256, namespace="acme"))
    acc.count_hit(durable_receipt(depth=128, namespace="zeta"))
    name = "kvpack_restored_tokens_total"
    assert acc.total(name) == 384 and acc.total(name, tier="durable") == 384
    assert acc.total(name, namespace="zeta") == 128 and acc.total(name, tier="resident") == 0
    assert acc.value(name, tier="durable") == 0  # no series has the tier label alone


def test_bad_recording_inputs_raise():
    """Branch: a negative prefill time, a non-int token count or a session-tier verification
    failure is refused with a typed error."""
    acc = Accounting()
    with pytest.raises(AccountingInputError):
        acc.count_prefill(seconds=-1.0, tokens=1)
    with pytest.raises(AccountingInputError):
        acc.count_prefill(seconds=float("nan"), tokens=1)
    with pytest.raises(AccountingInputError):
        acc.count_prefill(seconds=1.0, tokens=1.5)
    with pytest.raises(AccountingInputError):
        acc.count_verification_failure(tier="session")
