"""The OpenAI request parser and response bodies, directly (no server, no engine).

The tokenizer is a stand-in that maps characters to ids, so each test can say exactly
which tokens a prompt becomes."""

from __future__ import annotations

import json

import pytest

from engine.sampling import Drawn, Sampling
from kvpack.server.errors import ApiError
from kvpack.server.fields import MAX_DEPTH, parse_json
from kvpack.server.openai import DEFAULT_MAX_TOKENS, Envelope, Limits, parse_request, sse
from kvpack.service.service import Completion

LIMITS = Limits(model="tiny", context_length=64, max_tokens=32, vocab_size=300,
                max_prompt_chars=128)  # fmt: skip


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
    s = req.sampling
    assert (req.model, s.temperature, s.top_p, s.top_k, s.min_p, req.stop) == (
        "tiny", 1.0, 1.0, 0, 0.0, ())  # fmt: skip
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.0, 0.0, 0.0)
    assert s.logit_bias == () and req.top_logprobs is None
    assert req.max_tokens == min(DEFAULT_MAX_TOKENS, LIMITS.max_tokens, 64 - 2)
    assert (req.stream, req.include_usage) == (False, False)


def test_sampling_parameters_reach_the_engine_settings():
    body = {"prompt": "hi", "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
            "seed": 7, "repetition_penalty": 1.1, "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "logit_bias": {"65": 5, "7": -100}, "logprobs": 3,
            "user": "u-1", "n": 1, "echo": False, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    req = parse("completion", body)
    assert req.sampling == Sampling(
        temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=7, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=-0.5, logit_bias=((7, -100.0), (65, 5.0)),
    )  # fmt: skip
    assert (req.top_logprobs, req.stream, req.include_usage) == (3, True, True)
    chat = {"messages": [{"role": "user", "content": "x", "name": "ann"}], "logprobs": True,
            "top_logprobs": 4, "response_format": {"type": "text"}, "tools": [],
            "tool_choice": "none"}  # fmt: skip
    assert parse("chat", chat).top_logprobs == 4
    assert parse("chat", {**chat, "top_logprobs": None}).top_logprobs == 0


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": 5}, 400, "prompt"),
        ({"prompt": [1, True]}, 400, "prompt"),
        ({"prompt": [1, 300]}, 400, "prompt"),  # outside the vocabulary
        ({"prompt": ["a", "b"]}, 400, "prompt"),  # one prompt per request
        ({"prompt": "\ud800"}, 400, "prompt"),  # a lone surrogate
        ({"prompt": "x" * 129}, 413, "prompt"),  # past max_prompt_chars, not tokenized
        ({"prompt": "hi", "model": "other"}, 404, "model"),
        ({"prompt": "hi", "model": 3}, 400, "model"),
        ({"prompt": "x" * 64}, 413, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 8.0}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 33}, 400, "max_tokens"),
        ({"prompt": "hi", "max_completion_tokens": None, "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "max_completion_tokens": 4, "max_tokens": 4}, 400,
         "max_completion_tokens"),
        ({"prompt": "x" * 40, "max_tokens": 30}, 413, "max_tokens"),
        ({"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
        ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "hi", "temperature": float("nan")}, 400, "temperature"),
        ({"prompt": "hi", "top_p": float("inf")}, 400, "top_p"),
        ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"prompt": "hi", "top_k": -1}, 400, "top_k"),
        ({"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
        ({"prompt": "hi", "presence_penalty": 99}, 400, "presence_penalty"),
        ({"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
        ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ({"prompt": "hi", "logit_bias": {"a": 1}}, 400, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"300": 1}}, 400, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"1": 101}}, 400, "logit_bias"),
        ({"prompt": "hi", "logit_bias": [1]}, 400, "logit_bias"),
        ({"prompt": "hi", "seed": -1}, 400, "seed"),
        ({"prompt": "hi", "seed": 1.5}, 400, "seed"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"prompt": "hi", "stop": [1]}, 400, "stop"),
        ({"prompt": "hi", "n": 2}, 400, "n"),
        ({"prompt": "hi", "n": True}, 400, "n"),
        ({"prompt": "hi", "best_of": 3}, 400, "best_of"),
        ({"prompt": "hi", "echo": True}, 400, "echo"),
        ({"prompt": "hi", "suffix": "x"}, 400, "suffix"),
        ({"prompt": "hi", "logprobs": True}, 400, "logprobs"),
        ({"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
        ({"prompt": "hi", "top_logprobs": 2}, 400, "top_logprobs"),  # not a completion field
        ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}}, 400,
         "stream_options.include_usage"),
        ({"prompt": "hi", "stream": True, "stream_options": {"x": 1}}, 400,
         "stream_options.x"),
        ({"prompt": "hi", "user": 5}, 400, "user"),
        ({"prompt": "hi", "wizardry": 1}, 400, "wizardry"),
        ({"prompt": "hi", "response_format": {"type": "text"}}, 400, "response_format"),
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
        ([{"role": ["user"], "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "user", "content": "\udfff"}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}],
         "messages[0].content[0].x"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
        ([{"role": "user", "content": "x", "name": 7}], "messages[0].name"),
        ([{"role": "user", "content": "x" * 100}] * 2, "messages"),  # past max_prompt_chars
    ],
)  # fmt: skip
def test_each_bad_chat_message_is_refused_naming_it(messages, param):
    assert refused("chat", {"messages": messages}).param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"echo": False}, "echo"),  # a completions field
    ],
)
def test_chat_refuses_what_it_does_not_implement_naming_it(body, param):
    e = refused("chat", {"messages": [{"role": "user", "content": "x"}], **body})
    assert (e.status, e.param) == (400, param), e.message


def test_parse_json_refuses_what_is_not_one_json_object():
    for raw in (b"{", b"[1]", "é".encode("latin-1"), b"[" * 100_000 + b"]" * 100_000):
        with pytest.raises(ApiError) as e:
            parse_json(raw)
        assert e.value.status == 400


def test_parse_json_bounds_the_depth_and_names_the_field():
    nested = json.dumps({"prompt": "x", "logit_bias": [[[0]]]}).encode()
    assert parse_json(nested)["logit_bias"] == [[[0]]]
    deep = b'{"stop": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}"
    with pytest.raises(ApiError) as e:
        parse_json(deep)
    assert (e.value.status, e.value.param, e.value.code) == (400, "stop", "too_deep")
    ok = b'{"stop": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}"
    assert parse_json(ok)


def done(**changes) -> Completion:
    fields = dict(tokens=[1, 2, 3], text="abc", finish_reason="stop", prompt_tokens=5,
                  cached_tokens=4, tier="durable", restore_seconds=0.5,
                  prefill_seconds=0.25)  # fmt: skip
    return Completion(**{**fields, **changes})


def decode(ids) -> str:
    return "".join(chr(i) for i in ids)


def test_a_full_body_carries_usage_with_cached_tokens_and_the_kvpack_object():
    body = Envelope("chat", "tiny", "fp", decode=decode).full(done())
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "abc"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
    assert body["kvpack"] == {"tier": "durable", "cached_tokens": 4, "restore_seconds": 0.5,
                              "prefill_seconds": 0.25}  # fmt: skip


def test_stream_chunks_share_one_id_and_the_last_carries_the_finish_and_kvpack():
    envelope = Envelope("completion", "tiny", "fp", decode=decode)
    first, last = envelope.chunk("a", first=True), envelope.last_chunk(done())
    assert first["id"] == last["id"] and first["object"] == "text_completion"
    assert last["choices"][0]["finish_reason"] == "stop" and last["kvpack"]["tier"] == "durable"
    assert envelope.usage_chunk(done())["choices"] == []
    assert sse({"x": 1}) == b'data: {"x":1}\n\n' and sse("[DONE]") == b"data: [DONE]\n\n"
    assert json.loads(sse(first)[6:]) == first


def test_logprobs_in_the_chat_and_the_legacy_completion_shapes():
    drawn = (Drawn(104, -0.5, ((104, -0.5), (105, -1.5))), Drawn(105, -0.25, ((105, -0.25),)))
    chat = Envelope("chat", "tiny", "fp", decode=decode).full(done(logprobs=drawn))
    content = chat["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "h", "logprob": -0.5, "bytes": [104], "top_logprobs": [
        {"token": "h", "logprob": -0.5, "bytes": [104]},
        {"token": "i", "logprob": -1.5, "bytes": [105]}]}  # fmt: skip
    legacy = Envelope("completion", "tiny", "fp", decode=decode)
    first = legacy.chunk("h", drawn=drawn[:1])["choices"][0]["logprobs"]
    rest = legacy.last_chunk(done(), drawn[1:])["choices"][0]["logprobs"]
    assert first == {"tokens": ["h"], "token_logprobs": [-0.5],
                     "top_logprobs": [{"h": -0.5, "i": -1.5}], "text_offset": [0]}  # fmt: skip
    assert rest["text_offset"] == [1] and rest["tokens"] == ["i"]
    assert Envelope("chat", "tiny", "fp", decode=decode).full(done())["choices"][0][
        "logprobs"] is None  # fmt: skip
