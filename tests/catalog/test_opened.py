"""OpenedManifests (catalog/opened.py): held by object key, the least recently used
dropped first once the held envelopes pass the budget."""

from __future__ import annotations

import pytest

from catalog.manifest import SealedManifest
from catalog.opened import OpenedManifests


def sealed(name: str) -> SealedManifest:
    # Only held and handed back, never read: any object of the type will do.
    return SealedManifest(manifest=None, key_id=name, signature=b"", body=name.encode())  # type: ignore[arg-type]


def test_held_manifests_are_dropped_least_recently_used_first_within_the_budget():
    opened = OpenedManifests(budget=100)
    a, b, c = sealed("a"), sealed("b"), sealed("c")
    opened.put("a", a, 40)
    opened.put("b", b, 40)
    assert opened.get("a") is a  # now the most recent: b goes first
    opened.put("c", c, 40)
    assert opened.get("b") is None and opened.get("a") is a and opened.get("c") is c
    assert len(opened) == 2 and opened.held_bytes == 80
    opened.put("c", c, 10)  # held again under its new size, not twice
    assert len(opened) == 2 and opened.held_bytes == 50


def test_an_envelope_larger_than_the_budget_is_not_held():
    opened = OpenedManifests(budget=100)
    opened.put("a", sealed("a"), 60)
    opened.put("big", sealed("big"), 101)
    assert "big" not in opened and "a" in opened and opened.held_bytes == 60
    nothing = OpenedManifests(budget=0)
    nothing.put("a", sealed("a"), 1)
    assert len(nothing) == 0


def test_bad_sizes_are_refused_by_name():
    with pytest.raises(ValueError, match="budget"):
        OpenedManifests(budget=-1)
    with pytest.raises(ValueError, match="size"):
        OpenedManifests().put("a", sealed("a"), -1)
