"""kvpack serve's HTTP API, through the official `openai` client and raw HTTP, against
a real server (real Service, tiny model, embedded SQLite + local store)."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.slots import SlotPool
from tests.kvpack.serverkit import SlowService, open_tiny_service, running

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]  # tiny: 8+ tokens, no eos


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    svc = open_tiny_service(tmp_path_factory.mktemp("vault"))
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def url(service):
    with running(service) as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def greedy_text(service, tokens: list[int], n: int) -> str:
    """What a cold engine of the same model generates: the reference output."""
    slot = SlotPool(service.loaded, num_slots=1).slot(0)
    slot.prefill(tokens)
    return service.loaded.tokenizer.decode(slot.generate(max_tokens=n).tokens)


def post(url: str, path: str, body: bytes | dict) -> tuple[int, dict]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def get(url: str, path: str) -> tuple[int, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def test_chat_completion_matches_a_cold_engine_and_says_which_tier(service, client):
    """Non-streaming chat: chat template applied, greedy text identical to a cold engine's,
    OpenAI usage shape, and the tier in both the kvpack object and the X-Kvpack headers."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0
    )
    reply = raw.parse()
    prompt = service.loaded.tokenizer.apply_chat_template(MESSAGES)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == greedy_text(service, prompt, 8)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == 8
    assert reply.choices[0].finish_reason == "length"
    kvpack = reply.model_extra["kvpack"]
    assert raw.headers["X-Kvpack-Tier"] == kvpack["tier"]
    assert float(raw.headers["X-Kvpack-Restore-Seconds"]) == pytest.approx(
        kvpack["restore_seconds"], abs=1e-5
    )
    assert reply.usage.prompt_tokens_details.cached_tokens == kvpack["cached_tokens"]


def test_chat_streaming_yields_the_same_text_with_usage_last(service, client):
    """Streaming chat (SSE): role first, deltas concatenate to the non-streamed greedy text,
    the finish chunk carries the kvpack object, include_usage adds a usage chunk."""
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    prompt = service.loaded.tokenizer.apply_chat_template(MESSAGES)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy_text(service, prompt, 8)
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finish] == ["length"]
    assert finish[0].model_extra["kvpack"]["tier"] in ("none", "session", "resident", "durable")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == len(prompt)


def test_repeated_completion_reports_cached_tokens_from_the_resident_tier(service, client):
    """/v1/completions twice with a fresh prompt: the first is served by no tier (cached 0),
    the repeat by the resident tier with every prompt token cached, same text."""
    prompt = "The archive of river survey notes, volume seven. " * 4  # 200 byte tokens
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    assert service.flush(30)  # publication is off the response path; let it land
    second = client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0
    )
    again = second.parse()
    assert first.object == "text_completion"
    assert first.usage.prompt_tokens == len(prompt)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.model_extra["kvpack"]["tier"] == "none"
    assert again.model_extra["kvpack"]["tier"] == "resident"
    assert second.headers["X-Kvpack-Tier"] == "resident"
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt)
    assert again.choices[0].text == first.choices[0].text


def test_completion_streaming_and_prompt_as_token_ids(service, client):
    """/v1/completions with a prompt of token ids, streamed: text chunks then a finish."""
    ids = service.loaded.tokenizer.encode("token ids go straight to the engine")
    stream = client.completions.create(
        model="tiny", prompt=ids, max_tokens=5, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == greedy_text(service, ids, 5)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].model_extra["kvpack"]["tier"] == "none"


def test_models_list_and_retrieve(client):
    """GET /v1/models lists the one served model; retrieving another is a 404."""
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")


def test_healthz_metrics_and_economics(service, url, client):
    """/healthz reports the model and identity; /metrics is Prometheus text whose miss
    counter moves with a request; /v1/economics labels each value's basis."""
    status, body = get(url, "/healthz")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok"
    assert health["identity"] == service.loaded.identity.hex

    def misses() -> float:
        status, text = get(url, "/metrics")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(text.decode())}
        return sum(s.value for s in families["kvpack_misses"].samples if s.name.endswith("total"))

    before = misses()
    client.completions.create(model="tiny", prompt="a prompt nobody sent before", max_tokens=1)
    assert misses() == before + 1
    status, body = get(url, "/v1/economics")
    econ = json.loads(body)
    assert status == 200 and econ["joules_saved"]["basis"] == "mock"


@pytest.mark.parametrize(
    ("body", "status", "param", "says"),
    [
        (b"{not json", 400, None, "not valid JSON"),
        (b"[1, 2]", 400, None, "JSON object"),
        ({"model": "tiny"}, 400, "messages", "messages is required"),
        ({"messages": "hi"}, 400, "messages", "messages must be an array"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "one of"),
        ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "string"),
        ({"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens", "in [1, 4096]"),
        ({"messages": MESSAGES, "max_tokens": "8"}, 400, "max_tokens", "an integer"),
        ({"messages": MESSAGES, "temperature": 9}, 400, "temperature", "in [0.0, 2.0]"),
        ({"messages": MESSAGES, "n": 2}, 400, "n", "one choice"),
        ({"messages": MESSAGES, "model": "gpt-4"}, 404, "model", "does not exist"),
        ({"messages": [{"role": "user", "content": "x" * 9000}]}, 413, "messages", "context"),
        (
            {"messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 4000},
            413,
            "max_tokens",
            "exceeds",
        ),  # fmt: skip
    ],
)
def test_bad_chat_requests_get_a_4xx_naming_what_was_wrong(url, body, status, param, says):
    """Each malformed request: the right status and an OpenAI error body naming the field."""
    got, reply = post(url, "/v1/chat/completions", body)
    assert got == status
    assert reply["error"]["param"] == param
    assert says in reply["error"]["message"]


def test_bad_completion_requests(url, client):
    """Completions: a missing prompt (400), token ids outside the vocabulary (400 naming
    the prompt, checked before the engine sees them), an unknown route (404 in the same
    error shape); the openai client maps them to its typed errors."""
    assert post(url, "/v1/completions", {"model": "tiny"})[0] == 400
    status, reply = post(url, "/v1/completions", {"prompt": [1, 2, 99999], "max_tokens": 2})
    assert (status, reply["error"]["param"]) == (400, "prompt")
    with pytest.raises(openai.BadRequestError, match="token ids in"):
        client.completions.create(model="tiny", prompt=[1, 2, 99999], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="prompt is required"):
        client.completions.create(model="tiny", prompt=None, max_tokens=2)
    status, reply = post(url, "/v1/nothing-here", {})
    assert status == 404 and "Not Found" in reply["error"]["message"]


def test_stop_string_ends_the_completion(service, client):
    """`stop`: the output ends just before the stop string, finish_reason "stop", and
    generation stops there (fewer tokens than max_tokens)."""
    ids = service.loaded.tokenizer.encode("Stop strings end a completion early.")
    full = greedy_text(service, ids, 40)
    cut = next(i for i in range(3, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    stop = full[cut : cut + 2]
    reply = client.completions.create(
        model="tiny", prompt=ids, max_tokens=40, temperature=0, stop=[stop]
    )
    assert reply.choices[0].text == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < 40


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_generation(service, stream):
    """A client that goes away (mid-stream: the failed write; not streaming: the transport
    poll) sets the job's cancel Event: the abandoned generation (200 slow tokens) ends
    cancelled, far short of its length, and the one worker serves the next request."""
    slow = SlowService(service, delay_s=0.05)
    with running(slow) as base:
        parts = urlsplit(base)
        body = {"model": "tiny", "prompt": "an abandoned request", "max_tokens": 200,
                "temperature": 0, "stream": stream}  # fmt: skip
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps(body))
        if stream:
            resp = conn.getresponse()
            assert resp.status == 200
            assert resp.readline().startswith(b"data:")  # generation is under way
        else:
            assert slow.generating.wait(30)  # generation is under way
        conn.close()  # the client goes away
        status, reply = post(base, "/v1/completions", {"prompt": "next", "max_tokens": 1})
    assert status == 200 and reply["usage"]["completion_tokens"] == 1
    abandoned = slow.completions[0]  # the worker is serial: it ended before "next" ran
    assert abandoned.finish_reason == "cancelled" and len(abandoned.tokens) < 200
