"""The OpenAI wire format: request bodies in, response bodies out (no I/O here).

- ApiRequest: one validated /v1/chat/completions or /v1/completions body, already
  tokenized (the chat template applied for chat), ready to become a CompletionRequest.
- fields: every field of OpenAI's two APIs is either implemented (model, messages or
  prompt, max_tokens / max_completion_tokens, temperature, top_p, seed, stop, stream,
  stream_options, presence_penalty, frequency_penalty, logit_bias, logprobs,
  top_logprobs, user; and the common extensions top_k, min_p, repetition_penalty, as
  engine/sampling.py defines them) or refused with a 400 naming it unless it carries
  the value that means "off" (n, best_of, echo, suffix, response_format, tools,
  tool_choice, functions, function_call). A field of neither kind is refused as
  unknown. `user` is accepted and not used: it names the caller for OpenAI's abuse
  monitoring, which this server does not do.
- size bound: a prompt's text is refused (413) before it is tokenized when it is longer
  than `Limits.max_prompt_chars`: the context length times the longest token's bytes,
  which no prompt that fits the context can exceed.
- kvpack object: every response carries `kvpack: {tier, cached_tokens,
  restore_seconds, prefill_seconds}` saying which tier served the prompt and what the
  restore cost; `usage.prompt_tokens_details.cached_tokens` counts the prompt tokens a
  tier served.
- logprobs: chat answers carry OpenAI's `logprobs.content` (token, logprob, bytes,
  top_logprobs), completions the legacy `tokens` / `token_logprobs` / `top_logprobs` /
  `text_offset`; a token's text is its own decoding (a byte of a multi-byte character
  decodes to U+FFFD).
Errors are ApiErrors (kvpack/server/errors.py).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from engine.sampling import Drawn, Sampling
from kvpack.server.errors import ApiError, bad_type, out_of_range, unsupported
from kvpack.server.fields import boolean, integer, known, number, text
from kvpack.service.service import Completion

Kind = Literal["chat", "completion"]
DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_USER_CHARS = 256
MAX_NAME_CHARS = 64
MAX_LOGIT_BIAS = 300
MAX_TOP_LOGPROBS = {"chat": 20, "completion": 5}  # OpenAI's limits
MAX_SEED = 2**63 - 1
ROLES = ("system", "user", "assistant", "tool", "developer")
COMMON_FIELDS = frozenset(
    {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
     "min_p", "seed", "stop", "stream", "stream_options", "n", "user", "presence_penalty",
     "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs"}
)  # fmt: skip
FIELDS: dict[Kind, frozenset[str]] = {
    "chat": COMMON_FIELDS | {"messages", "top_logprobs", "response_format", "tools",
                             "tool_choice", "parallel_tool_calls", "functions", "function_call"},
    "completion": COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"},
}  # fmt: skip
# Parameters this server does not implement, with the values that mean "off".
OFF: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "function_call": ("none",),
    "parallel_tool_calls": (True, False),  # it only means something with tools
    "response_format": ({"type": "text"},),
}
WHY_OFF = {
    "n": "one choice per request (n must be 1)",
    "best_of": "one choice per request (best_of must be 1)",
    "echo": "echoing the prompt is not supported",
    "suffix": "insertion (suffix) is not supported",
    "response_format": 'only {"type": "text"} is supported',
}
_TOKEN_ID = re.compile(r"[0-9]{1,10}")


@dataclass(frozen=True)
class ApiRequest:
    kind: Kind
    model: str
    tokens: list[int]
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    top_logprobs: int | None = None  # None: no logprobs; n: each token's and n others


@dataclass(frozen=True)
class Limits:
    """What this server's model accepts."""

    model: str
    context_length: int  # prompt + completion tokens
    max_tokens: int  # a ceiling on one completion
    vocab_size: int = 1 << 31  # prompt token ids and logit_bias keys are below it
    max_prompt_chars: int | None = None  # longer prompt text cannot fit the context


def parse_request(
    kind: Kind,
    body: Mapping[str, Any],
    *,
    limits: Limits,
    chat_tokens: Callable[[list[dict[str, str]]], list[int]],
    encode: Callable[[str], list[int]],
) -> ApiRequest:
    """Validate `body` and tokenize its prompt; raises ApiError naming what was wrong.
    Every cheap check runs before the prompt is tokenized."""
    known(body, FIELDS[kind])
    model = _model(body, limits)
    _refuse_unsupported(body)
    stream = boolean(body["stream"], "stream") if body.get("stream") is not None else False
    include_usage = _stream_options(body, stream)
    sampling = _sampling(body, limits)
    top_logprobs = _logprobs(body, kind)
    stop = _stop(body)
    if body.get("user") is not None:
        text(body["user"], "user", max_chars=MAX_USER_CHARS)
    max_tokens = _max_tokens_field(body, limits)
    if kind == "chat":
        tokens = chat_tokens(_messages(body, limits))
    else:
        tokens = _prompt(body, limits, encode)
    if not tokens:
        raise ApiError(400, "the prompt is empty", param="messages" if kind == "chat" else "prompt")
    room = limits.context_length - len(tokens)
    if room < 1:
        raise ApiError(
            413,
            f"the prompt is {len(tokens)} tokens; this model's context is "
            f"{limits.context_length} tokens",
            param="messages" if kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
    return ApiRequest(
        kind=kind,
        model=model,
        tokens=tokens,
        max_tokens=_fit(max_tokens, limits, room, len(tokens)),
        sampling=sampling,
        stop=stop,
        stream=stream,
        include_usage=include_usage,
        top_logprobs=top_logprobs,
    )


def _model(body: Mapping[str, Any], limits: Limits) -> str:
    model = limits.model if body.get("model") is None else body["model"]
    if not isinstance(model, str):
        raise bad_type("model", "a string", model)
    if model != limits.model:
        raise ApiError(
            404,
            f"model {text(model, 'model', max_chars=256)!r} does not exist; this server "
            f"serves {limits.model!r}",
            param="model",
            code="model_not_found",
        )
    return model


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    for name, allowed in OFF.items():
        value = body.get(name)
        if value is None or any(type(value) is type(ok) and value == ok for ok in allowed):
            continue
        raise unsupported(name, WHY_OFF.get(name, "tools and function calling are not supported"))


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad_type("stream_options", "an object", options)
    if not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true",
                       param="stream_options")  # fmt: skip
    known(options, {"include_usage"}, where="stream_options.")
    usage = options.get("include_usage")
    return False if usage is None else boolean(usage, "stream_options.include_usage")


def _optional_number(body: Mapping[str, Any], name: str, default: float, **bounds: Any) -> float:
    value = body.get(name)
    return default if value is None else number(value, name, **bounds)


def _sampling(body: Mapping[str, Any], limits: Limits) -> Sampling:
    seed = body.get("seed")
    return Sampling(
        temperature=_optional_number(body, "temperature", 1.0, lo=0.0, hi=2.0),
        top_p=_optional_number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=0
        if body.get("top_k") is None
        else integer(body["top_k"], "top_k", lo=0, hi=2**31 - 1),  # fmt: skip
        min_p=_optional_number(body, "min_p", 0.0, lo=0.0, hi=1.0),
        # As OpenAI: without a seed, sampling differs per request.
        seed=secrets.randbits(32) if seed is None else integer(seed, "seed", lo=0, hi=MAX_SEED),
        repetition_penalty=_optional_number(
            body, "repetition_penalty", 1.0, lo=0.0, hi=10.0, lo_open=True
        ),  # fmt: skip
        presence_penalty=_optional_number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=_optional_number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        logit_bias=_logit_bias(body, limits),
    )


def _logit_bias(body: Mapping[str, Any], limits: Limits) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise bad_type("logit_bias", "an object of token id -> bias", bias)
    if len(bias) > MAX_LOGIT_BIAS:
        raise out_of_range("logit_bias", f"at most {MAX_LOGIT_BIAS} entries", len(bias))
    out = []
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key) or int(key) >= limits.vocab_size:
            raise out_of_range("logit_bias", f"keyed by token ids in [0, {limits.vocab_size})",
                               key)  # fmt: skip
        out.append((int(key), number(value, "logit_bias", lo=-100.0, hi=100.0)))
    return tuple(sorted(out))


def _logprobs(body: Mapping[str, Any], kind: Kind) -> int | None:
    top = MAX_TOP_LOGPROBS[kind]
    value = body.get("logprobs")
    if kind == "completion":  # the legacy API: logprobs is the number of alternatives
        return None if value is None else integer(value, "logprobs", lo=0, hi=top)
    wanted = False if value is None else boolean(value, "logprobs")
    n = body.get("top_logprobs")
    if n is None:
        return 0 if wanted else None
    n = integer(n, "top_logprobs", lo=0, hi=top)
    if not wanted:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return n


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list):
        raise bad_type("stop", "a string or an array of strings", stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise out_of_range("stop", f"at most {MAX_STOP_STRINGS} strings", len(stops))
    return tuple(text(s, "stop", max_chars=MAX_STOP_CHARS, nul=True) for s in stops)


def _max_tokens_field(body: Mapping[str, Any], limits: Limits) -> tuple[str, int] | None:
    given = [n for n in ("max_completion_tokens", "max_tokens") if body.get(n) is not None]
    if len(given) == 2:
        raise ApiError(400, "give max_tokens or max_completion_tokens, not both",
                       param="max_completion_tokens")  # fmt: skip
    if not given:
        return None
    name = given[0]
    return name, integer(body[name], name, lo=1, hi=limits.max_tokens)


def _fit(field: tuple[str, int] | None, limits: Limits, room: int, prompt_len: int) -> int:
    if field is None:
        return min(DEFAULT_MAX_TOKENS, limits.max_tokens, room)
    name, value = field
    if value > room:
        raise ApiError(
            413,
            f"{name}={value} plus the {prompt_len}-token prompt exceeds this model's "
            f"context of {limits.context_length} tokens",
            param=name,
            code="context_length_exceeded",
        )
    return value


def _too_long(param: str, chars: int, limits: Limits) -> ApiError:
    return ApiError(
        413,
        f"the prompt is {chars} characters; at most {limits.max_prompt_chars} can fit this "
        f"model's context of {limits.context_length} tokens",
        param=param,
        code="context_length_exceeded",
    )


def _messages(body: Mapping[str, Any], limits: Limits) -> list[dict[str, str]]:
    if body.get("messages") is None:
        raise ApiError(400, "messages is required", param="messages", code="missing_field")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise bad_type("messages", "an array of message objects", messages)
    if not messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    if len(messages) > limits.context_length:  # every message costs at least one token
        raise ApiError(413, f"{len(messages)} messages cannot fit this model's context of "
                       f"{limits.context_length} tokens", param="messages",
                       code="context_length_exceeded")  # fmt: skip
    out, chars = [], 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_type(where, "an object", message)
        known(message, {"role", "content", "name"}, where=f"{where}.")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise out_of_range(f"{where}.role", f"one of {ROLES}", role)
        content = _content(message.get("content"), where)
        chars += len(content)
        if limits.max_prompt_chars is not None and chars > limits.max_prompt_chars:
            raise _too_long("messages", chars, limits)
        entry = {"role": role, "content": content}
        if message.get("name") is not None:
            entry["name"] = text(message["name"], f"{where}.name", max_chars=MAX_NAME_CHARS)
        out.append(entry)
    return out


def _content(content: Any, where: str) -> str:
    """A string, or an array of {"type": "text", "text": ...} parts (joined)."""
    if isinstance(content, str):
        return text(content, f"{where}.content", nul=True)
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise unsupported(f"{where}.content", f"part {j}: only text parts are supported")
            known(part, {"type", "text"}, where=f"{where}.content[{j}].")
            texts.append(text(part.get("text"), f"{where}.content[{j}].text", nul=True))
        return "".join(texts)
    raise bad_type(f"{where}.content", "a string or an array of text parts", content)


def _prompt(
    body: Mapping[str, Any], limits: Limits, encode: Callable[[str], list[int]]
) -> list[int]:
    """A string, an array of token ids, or a one-element array of either."""
    if body.get("prompt") is None:
        raise ApiError(400, "prompt is required", param="prompt", code="missing_field")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > 1:
            raise unsupported("prompt", "one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        text(prompt, "prompt", nul=True)
        if limits.max_prompt_chars is not None and len(prompt) > limits.max_prompt_chars:
            raise _too_long("prompt", len(prompt), limits)
        return encode(prompt)
    if not isinstance(prompt, list):
        raise bad_type("prompt", "a string or an array of token ids (one prompt)", prompt)
    if len(prompt) >= limits.context_length:
        raise ApiError(413, f"the prompt is {len(prompt)} tokens; this model's context is "
                       f"{limits.context_length} tokens", param="prompt",
                       code="context_length_exceeded")  # fmt: skip
    for t in prompt:
        if not isinstance(t, int) or isinstance(t, bool):
            raise bad_type("prompt", "a string or an array of token ids (one prompt)", t)
        if not 0 <= t < limits.vocab_size:
            raise out_of_range("prompt", f"token ids in [0, {limits.vocab_size})", t)
    return list(prompt)


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
    """id, object names and timestamps shared by every body of one response; `decode`
    names tokens in logprobs."""

    def __init__(
        self, kind: Kind, model: str, fingerprint: str, *, decode: Callable[[Sequence[int]], str]
    ) -> None:
        self.kind, self.model, self.fingerprint, self.decode = kind, model, fingerprint, decode
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self._offset = 0  # characters of completion text before the next token (legacy)

    def _base(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    def _choice(
        self, text: str, finish_reason: str | None, *, delta: bool, logprobs: Any = None
    ) -> dict[str, Any]:
        if self.kind == "completion":
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if delta:
            return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                    "finish_reason": finish_reason}  # fmt: skip
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish_reason}  # fmt: skip

    def logprobs(self, drawn: Sequence[Drawn] | None) -> dict[str, Any] | None:
        """The choice's logprobs object for `drawn` (None when none were asked for)."""
        if drawn is None:
            return None
        if self.kind == "chat":
            return {"content": [self._entry(d) for d in drawn], "refusal": None}
        tokens = [self.decode([d.token]) for d in drawn]
        offsets = []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [d.logprob for d in drawn],
            "top_logprobs": [{self.decode([t]): lp for t, lp in d.top} for d in drawn],
            "text_offset": offsets,
        }

    def _entry(self, d: Drawn) -> dict[str, Any]:
        def one(token: int, logprob: float | None) -> dict[str, Any]:
            text = self.decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {**one(d.token, d.logprob), "top_logprobs": [one(t, lp) for t, lp in d.top]}

    def full(self, c: Completion) -> dict[str, Any]:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        logprobs = self.logprobs(c.logprobs)
        choice = self._choice(c.text, c.finish_reason, delta=False, logprobs=logprobs)
        return {
            **self._base(obj),
            "choices": [choice],
            "usage": usage(c),
            "kvpack": kvpack_object(c),
        }

    def chunk(
        self, text: str, *, first: bool = False, drawn: Sequence[Drawn] | None = None
    ) -> dict[str, Any]:
        body = self._base(self._chunk_object())
        choice = self._choice(text, None, delta=True, logprobs=self.logprobs(drawn))
        if first and self.kind == "chat":
            choice["delta"] = {"role": "assistant", "content": text}
        body["choices"] = [choice]
        return body

    def last_chunk(self, c: Completion, drawn: Sequence[Drawn] | None = None) -> dict[str, Any]:
        """The chunk with the finish reason (and the logprobs of tokens whose text came
        with it); it also carries the kvpack object."""
        body = self._base(self._chunk_object())
        logprobs = self.logprobs(drawn) if drawn else None
        body["choices"] = [self._choice("", c.finish_reason, delta=True, logprobs=logprobs)]
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
