"""Bounded outages on a real server (tiny model), with fault injection around the real
dependencies: PostgreSQL behind a TCP proxy that stops answering, SeaweedFS behind one
that drops every connection (tests/proxy.py).

Invariant 9 throughout: an outage slows a request, never fails it (the prompt is
recomputed and the output is the cold one), except the API-key check, which fails
closed (503). Once a breaker has opened, a request costs a recompute and no call to the
dead dependency; /readyz says which dependency is down; once healed, hits return.
The figures (each request's seconds) are printed; what is asserted is behaviour, with
client timeouts that fail the test if a request waited out an unbounded outage."""

from __future__ import annotations

import time
from urllib.parse import urlsplit

import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from catalog import access
from kvpack.config import Settings
from kvpack.server.auth import catalog_authenticator
from kvpack.service.service import Service
from tests.kvpack.conftest import s3_settings
from tests.kvpack.serverkit import TINY_A, call, running
from tests.proxy import proxy

PROMPT = "Tide tables for the northern harbour, spring quarter, all stations. " * 3
TIMEOUT_S = 1.0  # catalog_timeout_s in these tests
BACKOFF_S = 3.0  # outage_backoff_s


def complete(url: str, *, token: str | None = None, timeout: float = 30) -> tuple[dict, float]:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    t = time.perf_counter()
    status, _, reply = call(url, "POST", "/v1/completions", token=token, body=body,
                            timeout=timeout)  # fmt: skip
    assert status == 200, reply
    return reply, time.perf_counter() - t


def until(predicate, *, within_s: float, every_s: float = 0.2):
    """Poll `predicate` until it returns something truthy (or fail after `within_s`)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"not within {within_s} s")


def readyz(url: str) -> tuple[int, dict]:
    status, _, body = call(url, "GET", "/readyz")
    return status, body["dependencies"]


@pytest.mark.postgres
def test_postgres_that_stops_answering_costs_a_recompute_and_auth_fails_closed(tmp_path):
    from tests.fixtures.db import DatabaseFactory

    factory = DatabaseFactory("postgres", tmp_path)
    url = make_url(factory.create())
    try:
        with proxy(url.host or "127.0.0.1", url.port or 5432) as pg:
            proxied = url.set(host="127.0.0.1", port=pg.port).render_as_string(False)
            settings = Settings.load(
                data_dir=tmp_path / "vault", alignment=TINY_A, database_url=proxied, env={},
                catalog_timeout_s=TIMEOUT_S, outage_backoff_s=BACKOFF_S,
            )  # fmt: skip
            service = Service.open(settings, model="tiny")
            try:
                _postgres_phases(service, pg)
            finally:
                pg.heal()
                service.close()
    finally:
        factory.drop_all()


def _postgres_phases(service: Service, pg) -> None:
    breaker = service.vault.catalog_breaker
    with Session(service.vault.db) as s, s.begin():
        token = access.create_key(session=s, role="tenant", namespace="default")
    authenticate = catalog_authenticator(service.vault.db, breaker=breaker)
    with running(service) as base:
        cold, cold_s = complete(base)
        assert service.flush(30)
        warm, warm_s = complete(base)
        assert warm["kvpack"]["tier"] == "resident"
        pg.stall()
        first, first_s = complete(base, timeout=4 * TIMEOUT_S + 20)
        skipped = breaker.state().skipped
        later = [complete(base, timeout=20) for _ in range(3)]
        for reply in (first, *(r for r, _ in later)):
            # Fail closed: without the authority no cache may serve; recomputed, same text.
            assert reply["kvpack"]["tier"] == "none"
            assert reply["choices"][0]["text"] == cold["choices"][0]["text"]
        assert breaker.state().skipped >= skipped + 3  # the later ones never asked
        status, deps = readyz(base)
        assert status == 503 and not deps["catalog"]["up"] and deps["object_store"]["up"]
    with running(service, authenticate=authenticate) as base:
        t = time.perf_counter()
        status, headers, reply = call(base, "GET", "/v1/models", token=token, timeout=20)
        auth_s = time.perf_counter() - t
        assert status == 503 and reply["error"]["code"] == "auth_unavailable"
        pg.heal()
        until(lambda: call(base, "GET", "/v1/models", token=token)[0] == 200,
              within_s=4 * BACKOFF_S + 10)  # fmt: skip
        healed = until(
            lambda: (r := complete(base, token=token)[0])["kvpack"]["tier"] != "none" and r,
            within_s=4 * BACKOFF_S + 10,
        )
        assert healed["kvpack"]["tier"] in ("resident", "durable")
        assert healed["choices"][0]["text"] == cold["choices"][0]["text"]
        assert readyz(base)[0] == 200
    print(
        f"\noutage (PostgreSQL stops answering, catalog timeout {TIMEOUT_S} s): cold "
        f"{cold_s:.2f} s, warm {warm_s:.2f} s; first request of the outage {first_s:.2f} s, "
        f"then {', '.join(f'{s:.2f}' for _, s in later)} s (breaker open: recompute only); "
        f"API-key check {auth_s:.2f} s -> 503; healed: {healed['kvpack']['tier']} hit"
    )


@pytest.mark.s3
def test_s3_that_drops_connections_costs_a_recompute_once_the_breaker_opens(s3_config, tmp_path):
    endpoint = urlsplit(s3_config.endpoint_url)
    with proxy(endpoint.hostname, endpoint.port) as s3:
        overrides = s3_settings(s3_config) | {"s3_endpoint": f"http://127.0.0.1:{s3.port}"}
        settings = Settings.load(data_dir=tmp_path / "vault", alignment=TINY_A, env={},
                                 outage_backoff_s=BACKOFF_S, **overrides)  # fmt: skip
        # No resident tier: a repeat must load from the store.
        service = Service.open(settings, model="tiny", resident_budget_bytes=0)
        try:
            _s3_phases(service, s3)
        finally:
            s3.heal()
            service.close()


def _s3_phases(service: Service, s3) -> None:
    breaker = service.vault.objects.breaker
    with running(service) as base:
        cold, cold_s = complete(base)
        assert service.flush(30) and service.background.stats()["failed"] == 0
        warm, warm_s = complete(base)
        assert warm["kvpack"]["tier"] == "durable"
        s3.drop()
        first, first_s = complete(base)
        assert breaker.state().state == "open"
        connections = s3.connections
        later = [complete(base) for _ in range(3)]
        for reply in (first, *(r for r, _ in later)):
            assert reply["kvpack"]["tier"] == "none"
            assert reply["choices"][0]["text"] == cold["choices"][0]["text"]
        assert service.flush(30)  # the recomputes' publications failed fast too
        assert s3.connections == connections  # no request (or publication) tried the store
        status, deps = readyz(base)
        assert status == 503 and not deps["object_store"]["up"] and deps["catalog"]["up"]
        s3.heal()
        healed = until(lambda: (r := complete(base)[0])["kvpack"]["tier"] == "durable" and r,
                       within_s=4 * BACKOFF_S + 10)  # fmt: skip
        assert healed["choices"][0]["text"] == cold["choices"][0]["text"]
        assert readyz(base)[0] == 200
    print(
        f"\noutage (S3 drops connections): cold {cold_s:.2f} s, durable hit {warm_s:.2f} s; "
        f"first request of the outage {first_s:.2f} s (attempts until the breaker opened), "
        f"then {', '.join(f'{s:.2f}' for _, s in later)} s (breaker open: recompute only)"
    )
