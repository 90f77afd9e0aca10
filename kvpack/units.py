"""Sizes and durations as operators write them, and as kvpack prints them.

- size: bytes, with an optional unit: decimal (kB, MB, GB, TB: powers of 1000) or binary
  (KiB, MiB, GiB, TiB: powers of 1024), case-insensitive, a fraction allowed
  ("1.5GiB"); a bare number is bytes. "50GiB", "500MB", "0".
- duration: one or more number-unit pairs, s, m, h, d (and w), e.g. "30s", "15m",
  "7d", "1h30m"; a bare number is seconds.
Both refuse negatives, NaN and anything else with a ValueError that quotes the input.
"""

from __future__ import annotations

import math
import re

SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "pb": 1000**5,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
}
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.I)
_PAIR = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)", re.I)
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def parse_size(text: str | int) -> int:
    """Bytes of a size like "50GiB" or "500MB" (an int passes through, if >= 0)."""
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text}")
        return text
    match = _SIZE.fullmatch(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 50GiB, 500MB, 1048576)")
    return int(float(match.group(1)) * SIZE_UNITS[unit])


def parse_duration(text: str | float) -> float:
    """Seconds of a duration like "30s", "15m", "7d" or "1h30m" (numbers are seconds)."""
    if isinstance(text, bool):
        raise ValueError(f"not a duration: {text!r}")
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        raw = str(text).strip().replace(" ", "")
        try:
            seconds = float(raw)
        except ValueError:
            pairs = _PAIR.findall(raw)
            if not pairs or "".join(n + u for n, u in pairs) != raw:
                raise ValueError(f"not a duration: {text!r} (e.g. 30s, 15m, 7d, 1h30m)") from None
            if any(u.lower() not in DURATION_UNITS for _, u in pairs):
                raise ValueError(f"not a duration: {text!r} (units: s, m, h, d, w)") from None
            seconds = sum(float(n) * DURATION_UNITS[u.lower()] for n, u in pairs)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a duration is a finite number of seconds >= 0, got {text!r}")
    return seconds


def format_size(n: int | float | None) -> str:
    """1536 -> "1.5 KiB" (binary units; None -> "-")."""
    if n is None:
        return "-"
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_BINARY) - 1:
        value /= 1024
        unit += 1
    return f"{int(value)} B" if unit == 0 else f"{value:.1f} {_BINARY[unit]}"


def format_duration(seconds: float | None) -> str:
    """90 -> "1m30s", 86400 -> "1d" (None -> "-")."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.3g}s" if seconds < 10 else f"{seconds:.0f}s"
    out, rest = [], int(round(seconds))
    for unit in ("d", "h", "m", "s"):
        size = DURATION_UNITS[unit]
        if rest >= size:
            out.append(f"{rest // size}{unit}")
            rest %= size
    return "".join(out[:2])
