"""Fair tenants on a real server (tiny model, A = 64, API keys): one tenant's long
prompts cannot starve another's short one, and a tenant past its queue bound is told
to come back (429 + Retry-After) while others are still served."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy.orm import Session

from catalog import access
from kvpack.server.app import FRONT, make_app
from kvpack.server.auth import catalog_authenticator
from tests.engine.slotkit import prompt
from tests.kvpack.serverkit import SlowService, call, serving

LONG = 2000  # tokens: 32 aligned prefill steps each
SHORT_STEPS = 5  # B's request: its lookup, one prefill step, two tokens, the end


@pytest.fixture
def service(tiny_service):
    return tiny_service


def keys(service, *namespaces: str) -> list[str]:
    with Session(service.vault.db) as s, s.begin():
        return [access.create_key(session=s, role="tenant", namespace=ns) for ns in namespaces]


def complete(url: str, token: str, tokens: list[int], max_tokens: int) -> tuple[int, dict]:
    body = {"prompt": tokens, "max_tokens": max_tokens, "temperature": 0}
    status, headers, reply = call(url, "POST", "/v1/completions", token=token, body=body)
    return status, {"reply": reply, "retry_after": headers.get("Retry-After"),
                    "done_at": time.perf_counter()}  # fmt: skip


def until(predicate, within_s: float = 30) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.002)


def test_a_short_request_of_b_is_served_within_a_few_steps_behind_six_long_ones_of_a(service):
    """Six 2,000-token requests of tenant A are queued; B's 2-token request then finishes
    before A's first, within a few engine steps of its own (the turns alternate), instead
    of after all of A's (in arrival order); A's six come back unharmed."""
    app = make_app(service, authenticate=catalog_authenticator(service.vault.db))
    front = app[FRONT]
    key_a, key_b = keys(service, "fair-a", "fair-b")
    short = [10, 11]
    with serving(app) as url, ThreadPoolExecutor(8) as pool:
        t = time.perf_counter()
        assert complete(url, key_b, short, 2)[0] == 200
        alone_s = time.perf_counter() - t
        prompts = [prompt(LONG, seed=100 + i) for i in range(6)]
        started = time.perf_counter()
        futures = [pool.submit(complete, url, key_a, p, 8) for p in prompts]
        until(lambda: front.scheduler.pending("fair-a") == 6)
        steps_before = front.scheduler.steps_run
        t = time.perf_counter()
        status, b = complete(url, key_b, short, 2)
        behind_s = time.perf_counter() - t
        steps_b = front.scheduler.steps_run - steps_before
        results = [f.result(120) for f in futures]
    assert status == 200 and b["reply"]["usage"]["completion_tokens"] == 2
    assert all(s == 200 for s, _ in results)
    a_done = [r["done_at"] for _, r in results]
    assert b["done_at"] < min(a_done)
    assert steps_b <= 2 * SHORT_STEPS + 4
    a_total_s = max(a_done) - started
    print(
        f"\nfairness: tenant B's 2-token request took {alone_s * 1000:.0f} ms alone and "
        f"{behind_s * 1000:.0f} ms behind six {LONG}-token requests of tenant A "
        f"({steps_b} engine steps of both tenants); A's six took {a_total_s:.2f} s, which "
        f"B would have waited first in arrival order"
    )


def test_past_its_queue_bound_a_tenant_gets_429_with_retry_after_and_others_are_served(service):
    """Branch: bound 2. Tenant A has one request running (its text slowed) and one
    waiting: a third is refused with 429, Retry-After and an OpenAI error body; tenant B
    is served meanwhile; once A's requests finished, A is served again."""
    slow = SlowService(service, delay_s=0.1)
    app = make_app(slow, authenticate=catalog_authenticator(service.vault.db),
                   max_queued_per_tenant=2)  # fmt: skip
    front = app[FRONT]
    key_a, key_b = keys(service, "busy-a", "busy-b")
    with serving(app) as url, ThreadPoolExecutor(4) as pool:
        first = [pool.submit(complete, url, key_a, prompt(300, seed=s), 8) for s in (1, 2)]
        until(lambda: front.scheduler.pending("busy-a") == 2)
        status, refused = complete(url, key_a, [1, 2, 3], 2)
        other = pool.submit(complete, url, key_b, [4, 5, 6], 2)
        assert other.result(60)[0] == 200
        assert all(f.result(60)[0] == 200 for f in first)
        again = complete(url, key_a, [1, 2, 3], 2)[0]
    assert status == 429 and int(refused["retry_after"]) >= 1
    error = refused["reply"]["error"]
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "rate_limit_error")
    assert again == 200


def test_a_cancelled_request_waiting_its_turn_runs_no_engine_step(service):
    """Branch: a request whose client left before its first step ends at once, cancelled,
    without a lookup (the scheduler still reports it done)."""
    from kvpack.service.service import CompletionRequest

    cancel = threading.Event()
    cancel.set()
    steps = service.steps(CompletionRequest(tokens=[1, 2, 3], max_tokens=4), cancel=cancel)
    with pytest.raises(StopIteration) as done:
        next(steps)
    assert done.value.value.finish_reason == "cancelled" and done.value.value.tier == "none"
