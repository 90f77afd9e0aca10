"""Derived economics: measured from paired timings, FLOPs as a floor, joules always mock."""

from __future__ import annotations

import json
import math

import pytest

from catalog.ids import IdentityDigest
from catalog.ledger import PairedTiming
from kvpack.accounting.economics import (
    MOCK_WATTS,
    Derived,
    EconomicsInputError,
    flops_avoided,
    joules_saved,
    restore_speedup,
    seconds_saved,
    summarize,
)

ID = IdentityDigest(bytes(32 * [7]))


def pair(depth=256, restore=0.1, prefill=0.5, tier="durable"):
    return PairedTiming(
        identity=ID, depth=depth, tier=tier, restore_seconds=restore, prefill_seconds=prefill
    )


def test_speedup_and_seconds_saved_are_measured_from_the_pair():
    """Branch: speedup = prefill / restore and saved = prefill - restore, basis measured."""
    p = pair(restore=0.1, prefill=0.5)
    speed, saved = restore_speedup(p), seconds_saved(p)
    assert speed.basis == saved.basis == "measured"
    assert math.isclose(speed.value, 5.0) and speed.unit == "x"
    assert math.isclose(saved.value, 0.4) and saved.unit == "s"


def test_a_slower_restore_reports_a_negative_saving():
    """Branch: seconds saved is not clamped at zero; a slow restore is reported as a loss."""
    p = pair(restore=0.5, prefill=0.2)
    assert math.isclose(seconds_saved(p).value, -0.3)
    assert restore_speedup(p).value < 1


def test_flops_avoided_is_the_floor():
    """Branch: FLOPs avoided is exactly 2 x params x restored tokens and says it is a floor."""
    d = flops_avoided(num_params=135_000_000, restored_tokens=2048)
    assert d.value == 2 * 135_000_000 * 2048
    assert d.basis == "measured" and d.unit == "FLOP" and "floor" in d.note
    assert flops_avoided(num_params=10, restored_tokens=0).value == 0
    with pytest.raises(EconomicsInputError):
        flops_avoided(num_params=0, restored_tokens=1)
    with pytest.raises(EconomicsInputError):
        flops_avoided(num_params=10, restored_tokens=-1)


def test_joules_are_always_mock_even_from_measured_seconds():
    """Branch: joules saved from a measured saving is still labelled mock with its watts."""
    saved = seconds_saved(pair(restore=0.1, prefill=0.5))
    j = joules_saved(saved, watts=50)
    assert saved.basis == "measured" and j.basis == "mock"
    assert math.isclose(j.value, 0.4 * 50) and j.unit == "J" and "50 W" in j.note
    assert joules_saved(saved).note.endswith(f"{MOCK_WATTS:g} W")
    assert joules_saved(Derived(None, "s", "measured")).value is None
    with pytest.raises(EconomicsInputError):
        joules_saved(Derived(1.0, "x", "measured"))
    with pytest.raises(EconomicsInputError):
        joules_saved(saved, watts=0)


def test_summary_without_pairs_derives_nothing_it_cannot_measure():
    """Branch: with no paired timings speedup and seconds saved are null, never guessed."""
    s = summarize([], num_params=100, restored_tokens=512)
    assert s["pairs"] == 0
    assert s["speedup"]["value"] is None and s["speedup"]["basis"] == "measured"
    assert s["seconds_saved"]["value"] is None
    assert s["joules_saved"] == {**s["joules_saved"], "value": None, "basis": "mock"}
    assert s["flops_avoided"]["value"] == 2 * 100 * 512  # counted tokens need no pairing


def test_summary_aggregates_pairs_and_is_json():
    """Branch: the summary sums paired legs, splits them by tier, uses the paired tokens for
    FLOPs unless told the hit tokens, and every derived value carries its basis."""
    pairs = [
        pair(depth=256, restore=0.1, prefill=0.4),
        pair(depth=512, restore=0.2, prefill=0.8, tier="resident"),
    ]
    s = summarize(pairs, num_params=1000)
    json.dumps(s)
    assert s["pairs"] == 2 and s["paired_tokens"] == 768
    assert math.isclose(s["speedup"]["value"], 1.2 / 0.3)
    assert math.isclose(s["seconds_saved"]["value"], 0.9)
    assert s["flops_avoided"]["value"] == 2 * 1000 * 768
    assert s["by_tier"]["resident"]["tokens"] == 512 and s["by_tier"]["durable"]["pairs"] == 1
    for key in ("speedup", "seconds_saved", "flops_avoided"):
        assert s[key]["basis"] == "measured"
    assert s["joules_saved"]["basis"] == "mock"
    s2 = summarize(pairs, num_params=1000, restored_tokens=10_000)
    assert s2["flops_avoided"]["value"] == 2 * 1000 * 10_000
    with pytest.raises(EconomicsInputError):
        summarize([{"depth": 1}], num_params=1)
