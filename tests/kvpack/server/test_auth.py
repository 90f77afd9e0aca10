"""API keys on a real server (real Service on the tiny model, keys in its own catalog, the
catalog authenticator): who is refused, which role reaches what, and tenant isolation."""

from __future__ import annotations

import secrets

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from catalog import access
from kvpack.server.auth import catalog_authenticator
from tests.kvpack.serverkit import call, running


@pytest.fixture(scope="module")
def service(tiny_service):
    return tiny_service


@pytest.fixture(scope="module")
def url(service):
    with running(service, authenticate=catalog_authenticator(service.vault.db)) as base:
        yield base


def new_key(service, role: str, namespace: str) -> str:
    with Session(service.vault.db) as s, s.begin():
        return access.create_key(session=s, role=role, namespace=namespace)


def revoke(service, token: str) -> None:
    with Session(service.vault.db) as s, s.begin():
        assert access.revoke_key(session=s, key_id=access.parse_token(token)[0])


def unique(name: str) -> str:
    return f"{name}-{secrets.token_hex(3)}"


def complete(url: str, token: str, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    status, _, reply = call(url, "POST", "/v1/completions", token=token, body=body)
    assert status == 200, reply
    return reply


ROUTES = [
    ("POST", "/v1/completions", {"prompt": "hello", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("GET", "/v1/economics", None),
    ("GET", "/v1/admin/anything", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer", "Bearer kvp_0000000000000000_nosuchsecret", "Basic dXNlcjpwYXNz", "wrong"],
)
def test_no_valid_key_is_a_401_in_the_openai_shape_and_runs_nothing(
    service, url, method, path, body, authorization
):
    """Branches: no header, an empty Bearer, an unknown key, another scheme, garbage: 401
    with an OpenAI error body (code invalid_api_key), WWW-Authenticate: Bearer, and no
    completion ran (no counter moved)."""
    before = service.accounting.snapshot()
    status, headers, reply = call(url, method, path, body=body, authorization=authorization)
    assert status == 401
    assert headers["WWW-Authenticate"] == "Bearer"
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["code"] == "invalid_api_key"
    assert reply["error"]["type"] == "invalid_request_error"
    assert service.accounting.snapshot() == before


def test_a_wrong_secret_for_a_real_key_is_a_401(service, url):
    """Branch: the key id exists but the secret differs -> 401, and the real token works."""
    token = new_key(service, "admin", "*")
    key_id, secret = access.parse_token(token)
    forged = f"kvp_{key_id}_{secrets.token_urlsafe(32)}"
    assert call(url, "GET", "/metrics", token=forged)[0] == 401
    assert call(url, "GET", "/metrics", token=token)[0] == 200


def test_the_openai_client_sees_an_authentication_error(url):
    """The official client maps the refusal to its typed AuthenticationError."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="kvp_not_a_key", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="not valid"):
        client.models.list()


def test_healthz_needs_no_key_and_shows_activity_only_to_an_admin(service, url):
    """Branches: no key, a bad key, a tenant key: liveness only (no requests in flight, no
    publication queue, which would track other tenants' prompts); an admin key: both."""
    activity = {"requests_in_flight", "requests_queued", "publication"}
    tenant = new_key(service, "tenant", unique("acme"))
    for token in (None, "kvp_0000000000000000_nosuch", tenant):
        status, _, health = call(url, "GET", "/healthz", token=token)
        assert status == 200 and health["status"] == "ok"
        assert not activity & set(health), token
    status, _, health = call(url, "GET", "/healthz", token=new_key(service, "admin", "*"))
    assert status == 200 and activity <= set(health)
    assert call(url, "GET", "/readyz")[0] == 200  # readiness needs no key either


def test_a_key_revoked_while_the_server_runs_is_refused_at_once(service, url):
    """Branch: the key works; revoked in the catalog (server still running), the very next
    request is a 401: no cache between the catalog and the check."""
    token = new_key(service, "tenant", unique("acme"))
    assert call(url, "GET", "/v1/models", token=token)[0] == 200
    revoke(service, token)
    status, headers, reply = call(url, "GET", "/v1/models", token=token)
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    assert headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize(
    ("role", "path", "status"),
    [
        ("tenant", "/v1/models", 200),
        ("tenant", "/metrics", 403),  # every tenant's counters
        ("tenant", "/v1/economics", 403),
        ("tenant", "/v1/admin/anything", 403),
        ("tenant", "/v1/peer/anything", 403),
        ("peer", "/v1/peer/anything", 404),  # let through: no such route
        ("peer", "/metrics", 403),
        ("peer", "/v1/admin/anything", 403),
        ("admin", "/metrics", 200),
        ("admin", "/v1/economics", 200),
        ("admin", "/v1/admin/anything", 404),  # let through: no such route
        ("admin", "/v1/peer/anything", 404),
    ],
)
def test_each_role_reaches_only_its_routes(service, url, role, path, status):
    """Branches of the route classes: admin-only, peer-or-admin, any key. A refused role is
    a 403 in the OpenAI shape; an admitted one reaches the router (200, or 404)."""
    token = new_key(service, role, unique("acme") if role == "tenant" else "*")
    got, _, reply = call(url, "GET", path, token=token)
    assert got == status
    if status == 403:
        assert reply["error"]["code"] == "permission_denied" and role in reply["error"]["message"]


def test_tenants_never_hit_each_others_prefixes_and_are_counted_apart(service, url):
    """Tenant isolation. Tenant A sends a prompt (a miss) and again (a hit: A's state is in
    the vault and reachable). Tenant B then sends the very same prompt: it would hit if the
    key's namespace were ignored, yet it is served by no tier with nothing cached, and
    gives the same text. A second key of A's namespace still hits. The service's counters,
    and /metrics, carry each tenant apart: hits for A, a miss and no hit for B."""
    a, b = unique("acme"), unique("zeta")
    key_a, key_a2 = new_key(service, "tenant", a), new_key(service, "tenant", a)
    key_b = new_key(service, "tenant", b)
    prompt = f"Harbour tolls ledger {a}, page nine. " * 5  # > 2 aligned blocks (A = 64)
    first = complete(url, key_a, prompt)
    assert first["kvpack"]["tier"] == "none"
    assert service.flush(30)  # publication is off the response path; let it land
    again = complete(url, key_a, prompt)
    assert again["kvpack"]["tier"] == "resident"
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)

    other = complete(url, key_b, prompt)
    assert other["kvpack"]["tier"] == "none"
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert other["choices"][0]["text"] == first["choices"][0]["text"]
    assert service.flush(30)
    assert complete(url, key_a2, prompt)["kvpack"]["tier"] == "resident"

    acc = service.accounting
    assert acc.total("kvpack_hits_total", namespace=a) == 2
    assert acc.total("kvpack_misses_total", namespace=a) == 1
    assert acc.total("kvpack_hits_total", namespace=b) == 0
    assert acc.total("kvpack_misses_total", namespace=b) == 1
    _, _, text = call(url, "GET", "/metrics", token=new_key(service, "admin", "*"))
    hits = {
        s.labels["namespace"]: s.value
        for f in text_string_to_metric_families(text.decode())
        if f.name == "kvpack_hits"
        for s in f.samples
        if s.name == "kvpack_hits_total" and s.labels["tier"] == "resident"
    }
    assert hits[a] == 2 and hits.get(b, 0) == 0


def test_an_every_namespace_key_completes_in_the_default_namespace(service, url):
    """Branch: an admin key of namespace "*" completes in the server's default namespace:
    a tenant key of that namespace then hits what the admin's request stored."""
    prompt = f"Default namespace ledger {secrets.token_hex(3)}. " * 5
    assert complete(url, new_key(service, "admin", "*"), prompt)["kvpack"]["tier"] == "none"
    assert service.flush(30)
    default = service.loaded.identity.components["namespace"]
    reply = complete(url, new_key(service, "tenant", default), prompt)
    assert reply["kvpack"]["tier"] == "resident"


def test_an_unreachable_catalog_refuses_with_503(service):
    """Fail closed: a key that cannot be checked is no access (503, not 200, not 401)."""
    broken = create_engine("sqlite:////nonexistent-kvpack-dir/catalog.sqlite3")
    with running(service, authenticate=catalog_authenticator(broken)) as base:
        status, _, reply = call(base, "GET", "/v1/models", token=new_key(service, "admin", "*"))
        assert call(base, "GET", "/healthz")[0] == 200
    assert status == 503 and reply["error"]["code"] == "auth_unavailable"
