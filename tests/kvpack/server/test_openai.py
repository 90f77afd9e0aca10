"""The OpenAI request parser and response bodies, directly (no server, no engine).

The tokenizer is a stand-in that maps characters to ids, so each test can say exactly
which tokens a prompt becomes."""

from __future__ import annotations

import json

import pytest

from kvpack.server.openai import (
    DEFAULT_MAX_TOKENS,
    ApiError,
    Envelope,
    Limits,
    parse_json,
    parse_request,
    sse,
)
from kvpack.service.service import Completion

LIMITS = Limits(model="tiny", context_length=64, max_tokens=32)


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def chat_tokens(messages: list[dict[str, str]]) -> list[int]:
    return encode("".join(f"<{m['role']}>{m['content']}" for m in messages))


def parse(kind, body):
    return parse_request(kind, body, limits=LIMITS, chat_tokens=chat_tokens, encode=encode)


def refused(kind, body) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(kind, body)
    return e.value


def test_a_completion_prompt_is_a_string_token_ids_or_a_one_element_list_of_either():
    for prompt in ("hi", [104, 105], ["hi"], [[104, 105]]):
        assert parse("completion", {"prompt": prompt}).tokens == [104, 105]


def test_chat_messages_go_through_the_template_text_parts_joined():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    body = {"messages": [{"role": "user", "content": parts}]}
    assert parse("chat", body).tokens == encode("<user>ab")


def test_defaults_when_fields_are_absent():
    req = parse("completion", {"prompt": "hi"})
    assert (req.model, req.temperature, req.top_p, req.stop) == ("tiny", 1.0, 1.0, ())
    assert req.max_tokens == min(DEFAULT_MAX_TOKENS, LIMITS.max_tokens, 64 - 2)
    assert (req.stream, req.include_usage) == (False, False)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": 5}, 422, "prompt"),
        ({"prompt": [1, True]}, 422, "prompt"),
        ({"prompt": "hi", "model": "other"}, 404, "model"),
        ({"prompt": "hi", "model": 3}, 422, "model"),
        ({"prompt": "x" * 64}, 413, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, 422, "max_tokens"),
        ({"prompt": "hi", "max_tokens": True}, 422, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 33}, 422, "max_tokens"),
        ({"prompt": "x" * 40, "max_tokens": 30}, 413, "max_tokens"),
        ({"prompt": "hi", "temperature": 2.5}, 422, "temperature"),
        ({"prompt": "hi", "temperature": "hot"}, 422, "temperature"),
        ({"prompt": "hi", "top_p": 0}, 422, "top_p"),
        ({"prompt": "hi", "seed": -1}, 422, "seed"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 422, "stop"),
        ({"prompt": "hi", "stop": [1]}, 422, "stop"),
        ({"prompt": "hi", "n": 2}, 422, "n"),
        ({"prompt": "hi", "logprobs": True}, 422, "logprobs"),
        ({"prompt": "hi", "stream": "yes"}, 422, "stream"),
        ({"prompt": "hi", "stream_options": {"include_usage": 1}}, 422,
         "stream_options.include_usage"),
    ],
)  # fmt: skip
def test_each_bad_completion_field_is_refused_naming_it(body, status, param):
    e = refused("completion", body)
    assert (e.status, e.param) == (status, param), e.message
    assert e.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ([], "messages"),
        ("hi", "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
    ],
)
def test_each_bad_chat_message_is_refused_naming_it(messages, param):
    assert refused("chat", {"messages": messages}).param == param


def test_parse_json_refuses_what_is_not_one_json_object():
    for raw in (b"{", b"[1]", "é".encode("latin-1")):
        with pytest.raises(ApiError) as e:
            parse_json(raw)
        assert e.value.status == 400


def done(**changes) -> Completion:
    fields = dict(tokens=[1, 2, 3], text="abc", finish_reason="stop", prompt_tokens=5,
                  cached_tokens=4, tier="durable", restore_seconds=0.5,
                  prefill_seconds=0.25)  # fmt: skip
    return Completion(**{**fields, **changes})


def test_a_full_body_carries_usage_with_cached_tokens_and_the_kvpack_object():
    body = Envelope("chat", "tiny", "fp").full(done())
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "abc"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
    assert body["kvpack"] == {"tier": "durable", "cached_tokens": 4, "restore_seconds": 0.5,
                              "prefill_seconds": 0.25}  # fmt: skip


def test_stream_chunks_share_one_id_and_the_last_carries_the_finish_and_kvpack():
    envelope = Envelope("completion", "tiny", "fp")
    first, last = envelope.chunk("a", first=True), envelope.last_chunk(done())
    assert first["id"] == last["id"] and first["object"] == "text_completion"
    assert last["choices"][0]["finish_reason"] == "stop" and last["kvpack"]["tier"] == "durable"
    assert envelope.usage_chunk(done())["choices"] == []
    assert sse({"x": 1}) == b'data: {"x":1}\n\n' and sse("[DONE]") == b"data: [DONE]\n\n"
    assert json.loads(sse(first)[6:]) == first
