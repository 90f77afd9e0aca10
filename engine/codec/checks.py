"""Checks the cache kinds share.

- layout entry: a mapping in the layout with a string `role` naming one part, plus integer
  fields; `entry` and `integers` refuse anything else with PlanesInvalid (decode is strict,
  so the gate and install may index entries without guarding).
- `expect`: a gate's comparison of what the engine needs with what a cut holds;
  ShapeMismatch when they differ.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from engine.errors import PlanesInvalid, ShapeMismatch


def entry(value: object, *ints: str) -> Mapping[str, Any]:
    """`value` as a layout entry with integer fields `ints`."""
    if not isinstance(value, Mapping) or not isinstance(value.get("role"), str):
        raise PlanesInvalid(None, f"layout entry without a role: {value!r}")
    integers(value["role"], value, ints)
    return value


def integers(where: str | None, mapping: Mapping[str, Any], keys: Iterable[str]) -> None:
    for key in keys:
        value = mapping.get(key)
        # bool is an int to Python, never to the format.
        if not isinstance(value, int) or isinstance(value, bool):
            raise PlanesInvalid(where, f"{key} must be an int, got {value!r}")


def listed(where: str | None, value: object) -> list[Any]:
    """A JSON list of the layout (a tuple too, for layouts built in memory)."""
    if not isinstance(value, list | tuple):
        raise PlanesInvalid(where, f"expected a list, got {type(value).__name__}")
    return list(value)


def expect(what: str, expected: object, got: object) -> None:
    if expected != got:
        raise ShapeMismatch(what, expected, got)
