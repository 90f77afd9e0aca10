"""A bounded load test: 32 concurrent clients of four tenants against a real server
(tiny model, API keys, embedded vault), mixing identical and distinct prompts, greedy
and seeded sampling, streaming and not. Every request succeeds and every output equals
its cold reference (a fresh engine's own run of the same prompt and sampling), whichever
tier served it; the latency percentiles are printed (figures, not assertions)."""

from __future__ import annotations

import http.client
import json
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest
from sqlalchemy.orm import Session

from catalog import access
from engine.sampling import Sampling
from engine.slots import SlotPool
from kvpack.server.auth import catalog_authenticator
from tests.engine.slotkit import prompt
from tests.kvpack.serverkit import running

CLIENTS = 32
TENANTS = 4
ROUNDS = 3
MAX_TOKENS = 8
SHARED = [f"Shared brief {i}: harbour schedules, tide tables and pilot notes. " * 3
          for i in range(6)]  # fmt: skip


@dataclass(frozen=True)
class Ask:
    prompt: str | tuple[int, ...]
    seed: int | None  # None: greedy
    stream: bool

    def body(self) -> dict:
        body = {"prompt": list(self.prompt) if isinstance(self.prompt, tuple) else self.prompt,
                "max_tokens": MAX_TOKENS, "stream": self.stream}  # fmt: skip
        if self.seed is None:
            return {**body, "temperature": 0}
        return {**body, "temperature": 0.8, "top_p": 0.95, "seed": self.seed}

    def sampling(self) -> Sampling:
        if self.seed is None:
            return Sampling()
        return Sampling(temperature=0.8, top_p=0.95, seed=self.seed)


def plan(client: int) -> list[Ask]:
    """Each client: a shared prompt, one of its own, another shared one; the seed and
    streaming vary with the client, so identical prompts meet with both samplings."""
    own = tuple(prompt(120 + 7 * client, seed=1000 + client))
    seed = None if client % 2 == 0 else 7 + client % 3
    return [
        Ask(SHARED[client % len(SHARED)], seed, stream=client % 4 < 2),
        Ask(own, None if client % 3 else 11, stream=client % 4 >= 2),
        Ask(SHARED[(client + 1) % len(SHARED)], seed, stream=client % 3 == 0),
    ]


def cold_reference(service, ask: Ask) -> str:
    tokens = (service.loaded.tokenizer.encode(ask.prompt) if isinstance(ask.prompt, str)
              else list(ask.prompt))  # fmt: skip
    slot = SlotPool(service.loaded, num_slots=1).slot(0)
    slot.prefill(tokens)
    generated = slot.generate(max_tokens=MAX_TOKENS, sampling=ask.sampling()).tokens
    return service.loaded.tokenizer.decode(generated)


def send(url: str, token: str, ask: Ask) -> tuple[float, str, str]:
    """(seconds, output text, tier) of one request, streamed or not."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    t = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(ask.body()), headers=headers)
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    if not ask.stream:
        reply = json.loads(resp.read())
        out = reply["choices"][0]["text"], reply["kvpack"]["tier"]
    else:
        texts, tier, done = [], None, False
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            texts.append(chunk["choices"][0]["text"])
            tier = chunk.get("kvpack", {}).get("tier", tier)
        assert done
        out = "".join(texts), tier
    seconds = time.perf_counter() - t
    conn.close()
    return seconds, *out


@pytest.fixture
def service(tiny_service):
    return tiny_service


def test_32_concurrent_clients_get_no_error_and_only_cold_outputs(service):
    with Session(service.vault.db) as s, s.begin():
        tokens = [access.create_key(session=s, role="tenant", namespace=f"load-{t}")
                  for t in range(TENANTS)]  # fmt: skip
    plans = {c: plan(c) for c in range(CLIENTS)}
    references = {ask: cold_reference(service, ask) for asks in plans.values() for ask in asks}

    def client(c: int) -> list[tuple[Ask, float, str, str]]:
        return [(ask, *send(url, tokens[c % TENANTS], ask)) for ask in plans[c]]

    with running(service, authenticate=catalog_authenticator(service.vault.db)) as url:
        started = time.perf_counter()
        with ThreadPoolExecutor(CLIENTS) as pool:
            results = [r for rs in pool.map(client, range(CLIENTS)) for r in rs]
        wall = time.perf_counter() - started
    wrong = [(ask, text, references[ask]) for ask, _, text, _ in results if text != references[ask]]
    assert len(results) == CLIENTS * ROUNDS
    assert wrong == []
    seconds = sorted(s for _, s, _, _ in results)
    tiers = Counter(tier for _, _, _, tier in results)
    p50 = statistics.median(seconds)
    p99 = seconds[min(len(seconds) - 1, round(0.99 * (len(seconds) - 1)))]
    print(
        f"\nload: {len(results)} requests from {CLIENTS} concurrent clients of {TENANTS} "
        f"tenants in {wall:.1f} s, 0 errors, every output equal to its cold reference; "
        f"latency p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, max "
        f"{seconds[-1] * 1000:.0f} ms; tiers {dict(tiers)}"
    )
    assert set(tiers) - {"none"}  # some requests were served by a tier, all still cold-equal
