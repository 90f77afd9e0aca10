"""The OpenAI wire format: request bodies in, response bodies out (no I/O here).

- ApiRequest: one validated /v1/chat/completions or /v1/completions body, already
  tokenized (the chat template applied for chat), ready to become a CompletionRequest.
- ApiError: a request the server refuses; `status` (400 malformed, 401 no valid API key,
  403 a key whose role the route refuses, 404 unknown model, 413 too long for the context,
  422 a field of the wrong type or out of range) and the OpenAI error body naming the
  offending `param`.
- kvpack object: every response carries `kvpack: {tier, restore_seconds,
  prefill_seconds}` saying which tier served the prompt and what the restore cost;
  `usage.prompt_tokens_details.cached_tokens` counts the prompt tokens a tier served.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvpack.service.service import Completion

Kind = Literal["chat", "completion"]
DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 4
ROLES = ("system", "user", "assistant", "tool", "developer")
# Fields this server refuses rather than silently ignores, with the values that mean "off".
UNSUPPORTED = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
}


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
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


def bad_type(param: str, expected: str, got: Any) -> ApiError:
    return ApiError(
        422, f"{param} must be {expected}, got {type(got).__name__}", param=param, code="bad_type"
    )


def out_of_range(param: str, bound: str, got: Any) -> ApiError:
    return ApiError(422, f"{param} must be {bound}, got {got!r}", param=param, code="out_of_range")


@dataclass(frozen=True)
class ApiRequest:
    kind: Kind
    model: str
    tokens: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


@dataclass(frozen=True)
class Limits:
    """What this server's model accepts."""

    model: str
    context_length: int  # prompt + completion tokens
    max_tokens: int  # a ceiling on one completion


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return body


def parse_request(
    kind: Kind,
    body: Mapping[str, Any],
    *,
    limits: Limits,
    chat_tokens: Callable[[list[dict[str, str]]], list[int]],
    encode: Callable[[str], list[int]],
) -> ApiRequest:
    """Validate `body` and tokenize its prompt; raises ApiError naming what was wrong."""
    model = limits.model if body.get("model") is None else body["model"]
    if not isinstance(model, str):
        raise bad_type("model", "a string", model)
    if model != limits.model:
        raise ApiError(
            404,
            f"model {model!r} does not exist; this server serves {limits.model!r}",
            param="model",
            code="model_not_found",
        )
    tokens = chat_tokens(_messages(body)) if kind == "chat" else _prompt(body, encode)
    if not tokens:
        raise ApiError(400, "the prompt is empty", param="prompt" if kind == "completion" else None)
    room = limits.context_length - len(tokens)
    if room < 1:
        raise ApiError(
            413,
            f"the prompt is {len(tokens)} tokens; this model's context is "
            f"{limits.context_length} tokens",
            param="messages" if kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
    max_tokens = _max_tokens(body, limits, room, len(tokens))
    n = body.get("n")
    if n is not None and (n != 1 or isinstance(n, bool)):
        raise out_of_range("n", "1 (one choice per request)", n)
    for name, allowed in UNSUPPORTED.items():
        if body.get(name) not in allowed:
            raise ApiError(422, f"{name} is not supported by this server", param=name)
    stream = _typed(body, "stream", bool, "a boolean", False)
    options = _typed(body, "stream_options", dict, "an object", {}) or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad_type("stream_options.include_usage", "a boolean", include_usage)
    return ApiRequest(
        kind=kind,
        model=model,
        tokens=tokens,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, lo=0.0, hi=2.0),
        top_p=_number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        seed=_seed(body),
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
    )


def _typed(body: Mapping[str, Any], name: str, kind: type, expected: str, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise bad_type(name, expected, value)
    return value


def _messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    if body.get("messages") is None:
        raise ApiError(400, "messages is required", param="messages", code="missing_field")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise bad_type("messages", "an array of message objects", messages)
    if not messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_type(where, "an object", message)
        role = message.get("role")
        if role not in ROLES:
            raise out_of_range(f"{where}.role", f"one of {ROLES}", role)
        out.append({"role": role, "content": _content(message.get("content"), where)})
    return out


def _content(content: Any, where: str) -> str:
    """A string, or an array of {"type": "text", "text": ...} parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise ApiError(
                    422,
                    f"{where}.content[{j}]: only text parts are supported",
                    param=f"{where}.content",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_type(f"{where}.content[{j}].text", "a string", text)
            texts.append(text)
        return "".join(texts)
    raise bad_type(f"{where}.content", "a string or an array of text parts", content)


def _prompt(body: Mapping[str, Any], encode: Callable[[str], list[int]]) -> list[int]:
    """A string, an array of token ids, or a one-element array of either."""
    if body.get("prompt") is None:
        raise ApiError(400, "prompt is required", param="prompt", code="missing_field")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return list(prompt)
    raise bad_type("prompt", "a string or an array of token ids (one prompt)", prompt)


def _max_tokens(body: Mapping[str, Any], limits: Limits, room: int, prompt_len: int) -> int:
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    value = _typed(body, name, int, "an integer", None)
    if value is None:
        return min(DEFAULT_MAX_TOKENS, limits.max_tokens, room)
    if not 1 <= value <= limits.max_tokens:
        raise out_of_range(name, f"between 1 and {limits.max_tokens}", value)
    if value > room:
        raise ApiError(
            413,
            f"{name}={value} plus the {prompt_len}-token prompt exceeds this model's "
            f"context of {limits.context_length} tokens",
            param=name,
            code="context_length_exceeded",
        )
    return value


def _number(
    body: Mapping[str, Any],
    name: str,
    default: float,
    *,
    lo: float,
    hi: float,
    lo_open: bool = False,
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_type(name, "a number", value)
    if not (lo < value if lo_open else lo <= value) or value > hi:
        raise out_of_range(name, f"in {'(' if lo_open else '['}{lo}, {hi}]", value)
    return float(value)


def _seed(body: Mapping[str, Any]) -> int:
    seed = _typed(body, "seed", int, "an integer", None)
    if seed is None:
        return secrets.randbits(32)  # as OpenAI: without a seed, sampling differs per request
    if not 0 <= seed < 2**63:
        raise out_of_range("seed", "in [0, 2**63)", seed)
    return seed


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_type("stop", "a string or an array of strings", stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise out_of_range("stop", f"at most {MAX_STOP_STRINGS} strings", len(stops))
    return tuple(stops)


# -- responses ----------------------------------------------------------------------------


def usage(c: Completion) -> dict[str, Any]:
    completion = len(c.tokens)
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": c.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": c.cached_tokens},
    }


def kvpack_object(c: Completion) -> dict[str, Any]:
    """Which tier served the prompt and what the restore cost (in every response)."""
    return {
        "tier": c.tier,
        "cached_tokens": c.cached_tokens,
        "restore_seconds": c.restore_seconds,
        "prefill_seconds": c.prefill_seconds,
    }


def headers(c: Completion) -> dict[str, str]:
    return {
        "X-Kvpack-Tier": c.tier,
        "X-Kvpack-Cached-Tokens": str(c.cached_tokens),
        "X-Kvpack-Restore-Seconds": f"{c.restore_seconds:.6f}",
        "X-Kvpack-Prefill-Seconds": f"{c.prefill_seconds:.6f}",
    }


class Envelope:
    """id, object names and timestamps shared by every body of one response."""

    def __init__(self, kind: Kind, model: str, fingerprint: str) -> None:
        self.kind, self.model, self.fingerprint = kind, model, fingerprint
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    def _choice(self, text: str, finish_reason: str | None, *, delta: bool) -> dict[str, Any]:
        if self.kind == "completion":
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if delta:
            return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                    "finish_reason": finish_reason}  # fmt: skip
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}  # fmt: skip

    def full(self, c: Completion) -> dict[str, Any]:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {
            **self._base(obj),
            "choices": [self._choice(c.text, c.finish_reason, delta=False)],
            "usage": usage(c),
            "kvpack": kvpack_object(c),
        }

    def chunk(self, text: str, *, first: bool = False) -> dict[str, Any]:
        body = self._base(self._chunk_object())
        choice = self._choice(text, None, delta=True)
        if first and self.kind == "chat":
            choice["delta"] = {"role": "assistant", "content": text}
        body["choices"] = [choice]
        return body

    def last_chunk(self, c: Completion) -> dict[str, Any]:
        """The chunk with the finish reason; it also carries the kvpack object."""
        body = self._base(self._chunk_object())
        body["choices"] = [self._choice("", c.finish_reason, delta=True)]
        body["kvpack"] = kvpack_object(c)
        return body

    def usage_chunk(self, c: Completion) -> dict[str, Any]:
        """stream_options.include_usage: a last chunk with no choices and the usage."""
        return {**self._base(self._chunk_object()), "choices": [], "usage": usage(c)}

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"


def sse(payload: Mapping[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
