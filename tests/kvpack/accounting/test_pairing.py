"""Paired timings: one local prefill pairs once with the first later hit on the same cut."""

from __future__ import annotations

import pytest

from catalog.ids import ChainDigest, IdentityDigest
from kvpack.accounting.counters import commit_restore
from kvpack.accounting.pairing import PrefillClock

ID = IdentityDigest(bytes(32 * [1]))
CHAIN = ChainDigest(bytes(32 * [2]))


def receipt(depth: int = 256, seconds: float = 0.25):
    ticks = iter([10.0, 10.0 + seconds])
    _, r = commit_restore(
        lambda: None, tier="durable", depth=depth, manifest_bytes=1, clock=lambda: next(ticks)
    )
    return r


def test_a_prefill_pairs_with_the_first_hit_on_the_same_cut_only_once():
    """Branch: the hit takes the prefill measurement of its (identity, chain): one paired
    timing, with the receipt's tier, depth and restore seconds; a second hit on that cut
    pairs nothing (no prefill is counted twice)."""
    clock = PrefillClock()
    clock.record(identity=ID, chain=CHAIN, seconds=3.0)
    timing = clock.pair(identity=ID, chain=CHAIN, receipt=receipt())
    assert timing is not None
    assert (timing.identity, timing.tier, timing.depth) == (ID, "durable", 256)
    assert timing.restore_seconds == pytest.approx(0.25) and timing.prefill_seconds == 3.0
    assert clock.pair(identity=ID, chain=CHAIN, receipt=receipt()) is None


def test_a_hit_on_a_cut_this_process_never_prefilled_pairs_nothing():
    """Branch: another identity or another chain has no measurement: nothing is invented."""
    clock = PrefillClock()
    clock.record(identity=ID, chain=CHAIN, seconds=3.0)
    other = IdentityDigest(bytes(32 * [9]))
    assert clock.pair(identity=other, chain=CHAIN, receipt=receipt()) is None
    assert clock.pair(identity=ID, chain=ChainDigest(bytes(32)), receipt=receipt()) is None
    assert clock.pair(identity=ID, chain=CHAIN, receipt=receipt()) is not None


def test_the_clock_forgets_the_oldest_beyond_its_capacity_and_ignores_non_positive():
    clock = PrefillClock(capacity=2)
    chains = [ChainDigest(bytes([i]) * 32) for i in range(3)]
    for c in chains:
        clock.record(identity=ID, chain=c, seconds=1.0)
    clock.record(identity=ID, chain=ChainDigest(bytes(32 * [7])), seconds=0.0)  # not a measurement
    assert clock.pair(identity=ID, chain=chains[0], receipt=receipt()) is None
    assert all(clock.pair(identity=ID, chain=c, receipt=receipt()) for c in chains[1:])
