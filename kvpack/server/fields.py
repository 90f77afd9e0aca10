"""Typed fields of a request body: each check names the field it refuses (ApiError 400).

Words:
- strict: a bool is not an integer or a number; a number is finite (JSON has no NaN or
  Infinity, yet Python's parser reads them, and 1e400 becomes infinity); an integer is
  an int (1.0 is not); a string is valid Unicode (no lone surrogate, which no encoder
  can write out) and, unless it is text a model reads, has no NUL.
- body: one JSON object of at most MAX_DEPTH levels. Its size is checked before it is
  read (kvpack/server/app.py read_body), its depth after it is parsed: a body too deep
  for the parser itself is refused the same way.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from kvpack.server.errors import ApiError, bad_type, out_of_range, shown, unknown_field

MAX_DEPTH = 32  # the deepest body a route reads: messages[i].content[j].text is 5
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json(raw: bytes) -> dict[str, Any]:
    """One JSON object, at most MAX_DEPTH deep; ApiError 400 for anything else."""
    try:
        body = json.loads(raw)
    except ValueError as e:  # not JSON, not UTF-8, or an integer of over 4,300 digits
        message = f"request body is not valid JSON: {str(e)[:200]}"
        raise ApiError(400, message, code="invalid_json") from None
    except RecursionError:
        raise too_deep(None) from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    for name, value in body.items():
        if _deeper_than(value, MAX_DEPTH - 1):
            raise too_deep(name)
    return body


def too_deep(param: str | None) -> ApiError:
    where = f"{param} is" if param else "the body is"
    return ApiError(400, f"{where} nested deeper than {MAX_DEPTH} levels", param=param,
                    code="too_deep")  # fmt: skip


def _deeper_than(value: Any, limit: int) -> bool:
    if not isinstance(value, dict | list):
        return False
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def known(body: Mapping[str, Any], names: frozenset[str] | set[str], *, where: str = "") -> None:
    """Every key of `body` is one of `names`; else 400 naming the first unknown one."""
    for name in body:
        if name not in names:
            raise unknown_field(f"{where}{name}"[:80], sorted(names))


def text(value: Any, param: str, *, max_chars: int | None = None, nul: bool = False) -> str:
    """A string: valid Unicode, at most `max_chars` characters, NUL only if allowed."""
    if not isinstance(value, str):
        raise bad_type(param, "a string", value)
    if max_chars is not None and len(value) > max_chars:
        raise out_of_range(param, f"at most {max_chars} characters", f"{len(value)} characters")
    if _SURROGATE.search(value):
        raise ApiError(400, f"{param} holds a lone surrogate (not valid Unicode)", param=param,
                       code="invalid_text")  # fmt: skip
    if not nul and "\x00" in value:
        raise ApiError(400, f"{param} must not contain NUL", param=param, code="invalid_text")
    return value


def integer(value: Any, param: str, *, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_type(param, "an integer", value)
    if not lo <= value <= hi:
        raise out_of_range(param, f"an integer in [{lo}, {hi}]", value)
    return value


def number(value: Any, param: str, *, lo: float, hi: float, lo_open: bool = False) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise bad_type(param, "a number", value)
    if isinstance(value, float) and not math.isfinite(value):
        raise out_of_range(param, "a finite number", value)
    # Compared before any conversion: an int of a thousand digits has no float.
    if not (lo < value if lo_open else lo <= value) or value > hi:
        raise out_of_range(param, f"in {'(' if lo_open else '['}{lo}, {hi}]", value)
    return float(value)


def boolean(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise bad_type(param, "a boolean", value)
    return value


def hex_id(value: Any, param: str, *, chars: int) -> str:
    """`chars` lowercase hex characters (checked before any lookup, SQL or store call)."""
    if not isinstance(value, str) or len(value) != chars or not _is_hex(value):
        raise ApiError(400, f"{param} must be {chars} lowercase hex characters, got "
                       f"{shown(value)}", param=param, code="bad_id")  # fmt: skip
    return value


def _is_hex(value: str) -> bool:
    return all(c in "0123456789abcdef" for c in value)
