"""A corpus of malformed requests over every route of a real server (real Service on the
tiny model, API keys in its own catalog), on the embedded default and on PostgreSQL:
no answer is a 5xx, every answer is an OpenAI error body (JSON, never HTML) whose
`param` names the field at fault, and the server answers /healthz after each one.

The classes: every body field with values of the wrong type, out of range, not finite
(NaN, Infinity, 1e400) or past a length cap; a bool where an integer goes; lone
surrogates and NUL bytes; integers of thousands of digits; JSON nested 5,000 and
100,000 deep; bodies that are not JSON objects; unknown and unimplemented fields; ids
of the wrong shape (path tricks, NUL, wrong length, not hex) on the admin and peer
routes; a peer find past the link cap and one at it; bad keys; wrong methods."""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

import pytest
from sqlalchemy.orm import Session

from catalog import access
from kvpack.config import Settings
from kvpack.server.auth import catalog_authenticator
from kvpack.server.peers import MAX_LINKS
from kvpack.service.service import Service
from tests.kvpack.serverkit import TINY_A, running

NAN, INF = float("nan"), float("inf")
HUGE = 10**4000  # an int json.dumps writes and json.loads reads back (under 4,300 digits)
MSG = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class Case:
    method: str
    path: str
    body: bytes | None
    param: str | None  # the field the error must name (None: the body or the request)
    key: str = "admin"  # whose key is sent: admin, tenant, peer, or a raw header value
    status: int | None = None  # the exact status, when the class has one


def dumps(doc) -> bytes:
    return json.dumps(doc, allow_nan=True).encode()  # NaN and Infinity as Python writes them


def completion_cases() -> list[Case]:
    """Every field of both completion routes with values it must refuse."""
    numbers = [True, "1", [], {}, NAN, INF, -INF, 1e308, -1e308, HUGE, -HUGE]
    integers = [True, 1.5, 2.0, "1", [], {}, -1, 10**30, NAN, INF, HUGE]
    booleans = [1, 0, "true", [], {}, NAN]
    strings = [1, True, [], {}, "\ud800", "a\udfffb"]
    fields: dict[str, list] = {
        "temperature": numbers + [2.5, -0.1],
        "top_p": numbers + [0, 1.5],
        "min_p": numbers + [1.5, -0.5],
        "presence_penalty": numbers + [99, -3],
        "frequency_penalty": numbers + [99, -3],
        "repetition_penalty": numbers + [0, 11],
        "max_tokens": integers + [0, 5000],
        "max_completion_tokens": integers + [0],
        "seed": integers + [2**63],
        "top_k": integers + [2**31],
        "stream": booleans,
        "model": strings + ["gpt-4", "tin\x00y", "x" * 5000],
        "user": strings + ["x" * 257, "u\x00"],
        "stop": [1, True, {}, [1], ["a"] * 5, ["x" * 257], "\ud800", [None]],
        "logit_bias": [[], "x", 1, True, {"a": 1}, {"-1": 1}, {"01x": 1}, {"1": NAN},
                       {"1": INF}, {"1": 101}, {"1": True}, {"1": "5"}, {"99999": 1},
                       {"1" * 12: 1}, {str(i): 1 for i in range(301)}],
        "n": [2, 0, True, "1", 1.0, -1],
        "wizardry": [1, "x"],
        "Model": ["tiny"],
        "": [1],
        "\ud800": [1],
        "x" * 300: [1],
    }  # fmt: skip
    kinds = {"/v1/completions": {"prompt": "hello"}, "/v1/chat/completions": {"messages": MSG}}
    cases = []
    for path, base in kinds.items():
        for name, values in fields.items():
            for value in values:
                cases.append(Case("POST", path, dumps({**base, name: value}), name[:80]))
    chat_only: dict[str, list] = {
        "logprobs": booleans,
        "top_logprobs": [True, 1.5, -1, 21, "3"],
        "response_format": [{"type": "json_object"}, "text", {"type": "json_schema"}, []],
        "tools": [[{"type": "function", "function": {"name": "f"}}], "x", {}],
        "tool_choice": ["auto", "required", {"type": "function"}, 1],
        "functions": [[{"name": "f"}]],
        "function_call": ["auto", {"name": "f"}],
        "parallel_tool_calls": [1, "yes"],
        "echo": [False],  # a completions field: unknown here
        "prompt": ["hi"],
    }
    completion_only: dict[str, list] = {
        "logprobs": [True, -1, 6, 1.5, "1"],
        "echo": [True, 1],
        "best_of": [2, True],
        "suffix": ["x"],
        "top_logprobs": [1],  # a chat field: unknown here
        "messages": [MSG],
    }
    for path, only in (("/v1/chat/completions", chat_only), ("/v1/completions", completion_only)):
        for name, values in only.items():
            for value in values:
                cases.append(Case("POST", path, dumps({**kinds[path], name: value}), name))
    return cases


def prompt_cases() -> list[Case]:
    c, ch = "/v1/completions", "/v1/chat/completions"
    prompts = [5, True, {}, [], [[]], [1, True], [1, 1.5], [1, -1], [1, 10**9], ["a", "b"],
               [[1, 2], [3]], "\ud800", ["\ud800"], [None], "", "x" * 200_000]  # fmt: skip
    cases = [Case("POST", c, dumps({"prompt": p}), "prompt") for p in prompts]
    cases.append(Case("POST", c, dumps({}), "prompt"))
    cases.append(Case("POST", c, dumps({"prompt": None}), "prompt"))
    cases.append(Case("POST", c, dumps({"prompt": list(range(200)) * 50}), "prompt"))
    messages = {
        "messages": ["hi", {}, [], 5],
        "messages[0]": [[1], [None], ["hi"]],
        "messages[0].role": [[{"content": "x"}], [{"role": "wizard", "content": "x"}],
                             [{"role": ["user"], "content": "x"}], [{"role": 1, "content": "x"}]],
        "messages[0].content": [[{"role": "user"}], [{"role": "user", "content": 5}],
                                [{"role": "user", "content": "\ud800"}],
                                [{"role": "user", "content": [{"type": "image_url"}]}],
                                [{"role": "user", "content": [1]}],
                                [{"role": "user", "content": {"text": "x"}}]],
        "messages[0].content[0].text": [[{"role": "user", "content": [{"type": "text"}]}],
                                        [{"role": "user", "content": [{"type": "text",
                                                                       "text": 5}]}]],
        "messages[0].name": [[{"role": "user", "content": "x", "name": "\x00"}],
                             [{"role": "user", "content": "x", "name": "n" * 65}]],
        "messages[0].tool_calls": [[{"role": "assistant", "content": "x", "tool_calls": []}]],
        "messages[1]": [[*MSG, "x"], [*MSG, 3]],
    }  # fmt: skip
    for param, values in messages.items():
        for value in values:
            cases.append(Case("POST", ch, dumps({"messages": value}), param))
    cases.append(Case("POST", ch, dumps({}), "messages"))
    cases.append(Case("POST", ch, dumps({"messages": [{"role": "user", "content": "x" * 9000}]}),
                      "messages", status=413))  # fmt: skip
    cases.append(Case("POST", ch, dumps({"messages": MSG * 9000}), "messages", status=413))
    for path, base in ((c, {"prompt": "hi"}), (ch, {"messages": MSG})):
        both = {**base, "max_tokens": 4, "max_completion_tokens": 4}
        cases += [
            Case("POST", path, dumps({**base, "max_completion_tokens": None, "max_tokens": 0}),
                 "max_tokens"),
            Case("POST", path, dumps(both), "max_completion_tokens"),
            Case("POST", path, dumps({**base, "stream_options": {"include_usage": True}}),
                 "stream_options"),
            Case("POST", path, dumps({**base, "stream": True, "stream_options": "x"}),
                 "stream_options"),
            Case("POST", path, dumps({**base, "stream": True, "stream_options": {"x": 1}}),
                 "stream_options.x"),
            Case("POST", path, dumps({**base, "stream": True,
                                      "stream_options": {"include_usage": 1}}),
                 "stream_options.include_usage"),
        ]  # fmt: skip
    return cases


def body_cases() -> list[Case]:
    """Bodies that are not one JSON object of bounded depth, on every route that reads one."""
    raw = [b"", b"{", b"[]", b"null", b"1", b'"x"', b"NaN", b"\xff\xfe", b'{"prompt": "a"',
           b"{" + b'"a":' * 5, b'{"max_tokens": 1' + b"0" * 5000 + b"}",
           b"[" * 5000 + b"]" * 5000, b"[" * 100_000 + b"]" * 100_000,
           b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
           b'{"stop": ' + b"[" * 40 + b"]" * 40 + b"}"]  # fmt: skip
    params = {b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}": None,  # past the parser's own
              b'{"stop": ' + b"[" * 40 + b"]" * 40 + b"}": "stop"}  # fmt: skip
    routes = ["/v1/completions", "/v1/chat/completions", "/v1/admin/gc", "/v1/peer/find"]
    cases = []
    for path in routes:
        for body in raw:
            if body == b"" and path == "/v1/admin/gc":
                continue  # an empty body is GC's defaults: a real (valid) request
            key = "peer" if path.startswith("/v1/peer") else "admin"
            cases.append(Case("POST", path, body, params.get(body), key=key))
    cases.append(Case("POST", "/v1/completions", dumps({"prompt": "b" * 7_000_000}), None,
                      status=413))  # fmt: skip
    return cases


def admin_cases() -> list[Case]:
    gc = "/v1/admin/gc"
    bad = {
        "budget_bytes": [True, False, "1", -1, 1.5, NAN, INF, 1e308, 2**63, [], {}],
        "grace_s": [True, "1", -1, NAN, INF, -INF, 1e308, 1e30, 1e15, []],
        "quarantine_retention_s": [1e15, NAN, INF, True, -1, "7d"],
        "budget": [1],
    }
    cases = [Case("POST", gc, dumps({k: v}), k) for k, values in bad.items() for v in values]
    ids = ["..", "..%2F..%2Fchunks", "%2e%2e", "%00", "x" * 5000, "A" * 32, "0" * 31, "0" * 33,
           "g" * 32, "%20" * 32, quote("\u00e9" * 16), "0" * 31 + "%00"]  # fmt: skip
    for import_id in ids:
        for method in ("GET", "DELETE"):
            cases.append(Case(method, f"/v1/admin/quarantine/{import_id}", None, "import_id"))
    for method in ("GET", "DELETE"):
        cases.append(Case(method, f"/v1/admin/quarantine/{'0' * 32}", None, "import_id",
                          status=404))  # fmt: skip
    queries = {"state=bogus": "state", "state=%00": "state", "limit=5": "limit",
               "state=refused&x=1": "x"}  # fmt: skip
    for query, param in queries.items():
        cases.append(Case("GET", f"/v1/admin/quarantine?{query}", None, param))
    return cases


def peer_cases() -> list[Case]:
    find = "/v1/peer/find"
    ok = {"identity": "0" * 64, "alignment": 64, "depth": 64, "links": [[64, "0" * 64]],
          "min_depth": 0}  # fmt: skip
    bad = {
        "identity": [None, 5, "0" * 63, "0" * 65, "\x00" * 64, "G" * 64, "A" * 64, " " * 64],
        "alignment": [None, 0, -1, True, 1.0, "64", 2**40],
        "depth": [None, -1, True, 64.0, 2**62],
        "min_depth": [None, -1, True, 65],
        "links": [None, "x", {}, [[64]], [[64, "0" * 64, 1]], [["64", "0" * 64]],
                  [[True, "0" * 64]], [[64, "\x00" * 64]], [[64, "z" * 64]], [[128, "0" * 64]],
                  [[64, "0" * 64]] * 2, [[64, 5]], [5]],
        "bogus": [1],
    }  # fmt: skip
    cases = [
        Case("POST", find, dumps({**ok, k: v}), k, key="peer")
        for k, values in bad.items()
        for v in values
    ]
    past = {**ok, "depth": (MAX_LINKS + 1) * 64,
            "links": [[64 * (i + 1), "0" * 64] for i in range(MAX_LINKS + 1)]}  # fmt: skip
    cases.append(Case("POST", find, dumps(past), "depth", key="peer"))
    past = {**ok, "depth": 65_536 * 64, "links": [[64 * (i + 1), "0" * 64] for i in range(65_536)]}
    cases.append(Case("POST", find, dumps(past), None, key="peer", status=413))  # by its size
    at_cap = {**ok, "depth": MAX_LINKS * 64,
              "links": [[64 * (i + 1), f"{i:064x}"] for i in range(MAX_LINKS)]}  # fmt: skip
    cases.append(Case("POST", find, dumps(at_cap), None, key="peer", status=404))  # asks the SQL
    for manifest in ("..", "%00", "z" * 32, "0" * 31, "0" * 33, "0" * 64, "x" * 5000):
        cases.append(Case("GET", f"/v1/peer/packs/{manifest}/planes", None, "manifest", key="peer"))
    cases.append(Case("GET", f"/v1/peer/packs/{'0' * 32}/planes", None, "manifest", key="peer",
                      status=404))  # fmt: skip
    return cases


def misc_cases() -> list[Case]:
    cases = [
        Case("GET", f"/v1/models/{name}", None, "model", status=404)
        for name in ("gpt-4", "%00", "x" * 5000, "%ff", "tiny%20")
    ]
    cases += [Case(m, p, None, None, status=405) for m, p in (
        ("PUT", "/v1/completions"), ("DELETE", "/v1/models"), ("POST", "/healthz"),
        ("GET", "/v1/chat/completions"), ("PATCH", "/v1/admin/gc"))]  # fmt: skip
    cases += [Case("GET", p, None, None, status=404) for p in ("/v1/nothing", "/v2/models")]
    headers = ["Bearer " + "x" * 4_000, "Bearer kvp_" + "0" * 16 + "_" + "a" * 200,
               "Bearer kvp_" + "A" * 16 + "_secret", "Bearer kvp_0000000000000000_nosuch",
               "Basic x", "Bearer"]  # fmt: skip
    for header in headers:
        cases.append(Case("GET", "/v1/models", None, None, key=header, status=401))
    for path in ("/metrics", "/v1/economics", "/v1/admin/gc", "/v1/peer/keys"):
        method = "POST" if path.endswith("gc") else "GET"
        cases.append(Case(method, path, dumps({}), None, key="tenant", status=403))
    return cases


CORPUS = [*completion_cases(), *prompt_cases(), *body_cases(), *admin_cases(), *peer_cases(),
          *misc_cases()]  # fmt: skip


def route(path: str) -> str:
    """The route a path is for (its id, model or query taken away)."""
    path = path.split("?")[0]
    for prefix in ("/v1/admin/quarantine", "/v1/peer/packs", "/v1/models"):
        if path.startswith(prefix):
            return prefix
    return path


def test_the_corpus_is_large_and_covers_every_route():
    routes = {route(c.path) for c in CORPUS}
    assert len(CORPUS) >= 300
    for name in ("/v1/completions", "/v1/chat/completions", "/v1/admin/gc", "/v1/peer/find",
                 "/v1/peer/packs", "/v1/admin/quarantine", "/v1/models", "/metrics",
                 "/v1/economics", "/v1/peer/keys", "/healthz"):  # fmt: skip
        assert name in routes, name


@pytest.fixture(
    scope="module", params=["embedded", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def server(request, tmp_path_factory):
    """(base URL, {role: token}) of a server with API keys on the backend."""
    tmp = tmp_path_factory.mktemp("corpus")
    overrides = {}
    if request.param == "postgres":
        from tests.fixtures.db import DatabaseFactory

        factory = DatabaseFactory("postgres", tmp)
        request.addfinalizer(factory.drop_all)
        overrides["database_url"] = factory.create()
    settings = Settings.load(data_dir=tmp / "vault", alignment=TINY_A, env={}, **overrides)
    service = Service.open(settings, model="tiny")
    db = service.vault.db
    with Session(db) as s, s.begin():
        keys = {role: access.create_key(session=s, role=role, namespace=ns)
                for role, ns in (("admin", "*"), ("peer", "*"), ("tenant", "acme"))}  # fmt: skip
    try:
        with running(service, authenticate=catalog_authenticator(db)) as url:
            yield url, keys
    finally:
        service.close()


def send(url: str, case: Case, keys: dict[str, str]) -> tuple[int, str, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    header = f"Bearer {keys[case.key]}" if case.key in keys else case.key
    conn.putrequest(case.method, case.path, skip_accept_encoding=True)
    conn.putheader("Authorization", header)
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(len(case.body or b"")))
    conn.endheaders(case.body or b"")
    resp = conn.getresponse()
    out = resp.status, resp.getheader("Content-Type", ""), resp.read()
    conn.close()
    return out


def test_no_malformed_request_gets_a_5xx_and_each_error_names_its_field(server):
    """Every case: a 4xx (the exact one where the case names it), an OpenAI error body in
    JSON whose param is the field at fault, and /healthz answers afterwards."""
    url, keys = server
    wrong = []
    for case in CORPUS:
        status, content_type, raw = send(url, case, keys)
        body = json.loads(raw) if content_type.startswith("application/json") else None
        error = body.get("error") if isinstance(body, dict) else None
        got = (status, error.get("param") if isinstance(error, dict) else "<no error body>")
        ok = 400 <= status < 500 and (case.status is None or status == case.status)
        if not ok or not isinstance(error, dict) or got[1] != case.param:
            wrong.append((case.method, case.path[:60], (case.body or b"")[:80], got, case.param))
        health = send(url, Case("GET", "/healthz", None, None), keys)
        assert health[0] == 200, f"the server stopped answering after {case}"
    assert wrong == [], f"{len(wrong)} of {len(CORPUS)} answered wrongly: {wrong[:10]}"
    print(
        f"\ncorpus: {len(CORPUS)} malformed requests, 0 answered >= 500, all named their "
        f"field, /healthz alive after each"
    )
    good = Case("POST", "/v1/completions", dumps({"prompt": "hi", "max_tokens": 2}), None,
                key="tenant")  # fmt: skip
    assert send(url, good, keys)[0] == 200  # the engine thread is alive too
