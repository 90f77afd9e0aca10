"""Sizes and durations as operators write them (kvpack/units.py)."""

from __future__ import annotations

import pytest

from kvpack.units import format_duration, format_size, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1048576", 1048576),
        ("500MB", 500_000_000),
        ("50GiB", 50 * 1024**3),
        ("1.5kib", 1536),
        ("2 TB", 2 * 1000**4),
        (4096, 4096),
    ],
)
def test_sizes_take_decimal_and_binary_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-1", "12XB", "GiB", "1.2.3MB", True, -5])
def test_bad_sizes_are_refused_naming_the_input(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("30s", 30.0), ("15m", 900.0), ("7d", 604800.0), ("1h30m", 5400.0), ("2.5", 2.5),
     ("1w", 604800.0), (0, 0.0)],
)  # fmt: skip
def test_durations_take_units_and_pairs(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "-1s", "5y", "m", "1h 3", "nan", float("inf")])
def test_bad_durations_are_refused_naming_the_input(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_formatting_reads_back():
    assert format_size(1536) == "1.5 KiB" and format_size(512) == "512 B"
    assert format_size(None) == "-"
    assert format_duration(90) == "1m30s" and format_duration(86400) == "1d"
    assert parse_duration(format_duration(5400)) == 5400
