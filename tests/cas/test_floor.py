"""cas/floor.py: the floor measures read, open and hash of exactly the bytes asked for,
and leaves nothing behind."""

from __future__ import annotations

import pytest

from cas.floor import Floor, measure_floor


def test_floor_of_given_sizes(tmp_path):
    """One Floor for all the chunks: their plaintext bytes, a time for each step, a rate
    that is bytes over their sum; the temporary files are gone afterwards."""
    sizes = [3 << 20, 3 << 20, 1000, 0]
    floor = measure_floor(sizes, directory=tmp_path, repeats=2)
    assert isinstance(floor, Floor) and floor.bytes == sum(sizes)
    assert min(floor.read_s, floor.open_s, floor.hash_s) > 0
    assert floor.seconds == floor.read_s + floor.open_s + floor.hash_s
    assert floor.rate == floor.bytes / floor.seconds
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sizes, repeats", [([], 1), ([-1], 1), ([0, 0], 1), ([10], 0)])
def test_floor_refuses_bad_arguments(sizes, repeats, tmp_path):
    """No bytes, a negative size or no repeat: ValueError."""
    with pytest.raises(ValueError):
        measure_floor(sizes, directory=tmp_path, repeats=repeats)
