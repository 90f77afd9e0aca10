"""ApiError: a request the server refuses, as an HTTP status and an OpenAI error body.

Statuses: 400 a malformed body or field (wrong type, out of range, not finite, unknown,
or a parameter this server does not implement), 401 no valid API key, 403 a key whose
role the route refuses, 404 no such model or object, 413 a body or prompt too large for
the limits or the context, 429 the tenant's queue is full (with Retry-After), 503 a
dependency that must answer (the key check) is unavailable. `param` names the field.
Nothing a client sends is answered with a 5xx; a 500 is a bug.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SHOWN = 80  # characters of a refused value quoted in a message


class ApiError(Exception):
    """A refused request: HTTP `status` and an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})  # e.g. WWW-Authenticate on a 401

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 429:
            kind = "rate_limit_error"
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


def shown(value: Any) -> str:
    """A refused value as a message quotes it: its repr, cut short."""
    if isinstance(value, list | dict) and len(value) > 8:
        return f"a {type(value).__name__} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}..."


def bad_type(param: str, expected: str, got: Any) -> ApiError:
    kind = "null" if got is None else type(got).__name__
    return ApiError(400, f"{param} must be {expected}, got {kind}", param=param, code="bad_type")


def out_of_range(param: str, bound: str, got: Any) -> ApiError:
    message = f"{param} must be {bound}, got {shown(got)}"
    return ApiError(400, message, param=param, code="out_of_range")


def unsupported(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


def unknown_field(param: str, known: list[str]) -> ApiError:
    message = f"unknown field {shown(param)}; this server reads {', '.join(known)}"
    return ApiError(400, message, param=param, code="unknown_parameter")
