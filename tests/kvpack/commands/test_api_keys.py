"""`kvpack api-keys` and `kvpack serve`'s key checks, through the real CLI: keys made,
listed and revoked in an embedded catalog, and a `kvpack serve` process that refuses
callers until one presents a key."""

from __future__ import annotations

import sys

from sqlalchemy.orm import Session

from catalog import access
from kvpack import cli
from kvpack.bench.serve import ServerProcess
from kvpack.config import Settings
from tests.kvpack.serverkit import TINY_A, call


def keys(capsys, data_dir, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["api-keys", *argv, "--data-dir", str(data_dir)])
    out, err = capsys.readouterr()
    return code, out, err


def login(data_dir, token: str) -> access.Principal | None:
    db = Settings.load(data_dir=data_dir, env={}).make_engine()
    try:
        with Session(db) as s, s.begin():
            return access.authenticate(session=s, token=token)
    finally:
        db.dispose()


def test_create_prints_the_token_once_and_it_authenticates(tmp_path, capsys):
    """`create`: stdout is the token alone (capturable), stderr says it is shown only once;
    the token authenticates as the role and namespace asked for, with its label listed."""
    code, out, err = keys(capsys, tmp_path, "create", "--role", "tenant", "--namespace", "acme",
                          "--label", "acme prod")  # fmt: skip
    assert code == 0, err
    token = out.strip()
    assert out == f"{token}\n" and token.startswith("kvp_")
    assert "shown only once" in err
    principal = login(tmp_path, token)
    assert (principal.role, principal.namespace) == ("tenant", "acme")
    code, out, _ = keys(capsys, tmp_path, "list")
    assert code == 0 and principal.key_id in out and "acme prod" in out
    assert access.parse_token(token)[1] not in out  # the secret is never shown again


def test_revoke_stops_the_token_and_list_says_so(tmp_path, capsys):
    """`revoke ID`: the token no longer authenticates and `list` shows a revocation time;
    an unknown id is an error (exit 1)."""
    _, out, _ = keys(capsys, tmp_path, "create", "--role", "admin", "--namespace", "*")
    token = out.strip()
    key_id = access.parse_token(token)[0]
    code, out, _ = keys(capsys, tmp_path, "revoke", key_id)
    assert code == 0 and key_id in out
    assert login(tmp_path, token) is None
    _, out, _ = keys(capsys, tmp_path, "list")
    (line,) = [row for row in out.splitlines() if row.startswith(key_id)]
    assert line.split()[5] != "-"  # the revoked column has a time
    code, _, err = keys(capsys, tmp_path, "revoke", "0" * 16)
    assert code == 1 and "no key" in err


def test_create_refuses_a_bad_key_naming_what_is_wrong(tmp_path, capsys):
    """No --namespace, "*" for a tenant key, one namespace for an admin key (admin keys
    are global): exit 2 and a message naming the field; nothing is created."""
    code, out, err = keys(capsys, tmp_path, "create", "--role", "tenant")
    assert code == 2 and out == "" and "--namespace is required" in err
    code, out, err = keys(capsys, tmp_path, "create", "--role", "tenant", "--namespace", "*")
    assert code == 2 and out == "" and "namespace" in err
    code, out, err = keys(capsys, tmp_path, "create", "--role", "admin", "--namespace", "acme")
    assert code == 2 and out == "" and "admin keys are global" in err
    _, out, _ = keys(capsys, tmp_path, "list")
    assert out.splitlines()[1:] == []


def test_no_auth_is_refused_off_loopback(capsys):
    """`serve --no-auth` on a non-loopback host: exit 2 before anything loads."""
    assert cli.main(["serve", "--no-auth", "--host", "0.0.0.0"]) == 2
    assert "loopback" in capsys.readouterr().out


def test_serve_requires_keys_by_default(tmp_path, capsys):
    """`kvpack serve` without --no-auth: with no key in the catalog it warns and refuses
    (401) everything but /healthz; a key made with `kvpack api-keys create` while it runs
    is accepted at once, for completions too."""
    data_dir = tmp_path / "vault"
    argv = [sys.executable, "-m", "kvpack.cli", "serve", "--host", "127.0.0.1", "--port", "0",
            "--model", "tiny", "--data-dir", str(data_dir), "--alignment", str(TINY_A)]  # fmt: skip
    with ServerProcess(argv, tmp_path / "serve.log", 120.0) as server:
        assert "no API key exists" in server.log_path.read_text()
        assert call(server.url, "GET", "/v1/models")[0] == 401
        assert call(server.url, "GET", "/healthz")[0] == 200
        _, out, _ = keys(capsys, data_dir, "create", "--role", "tenant", "--namespace", "acme")
        token = out.strip()
        assert call(server.url, "GET", "/v1/models", token=token)[0] == 200
        body = {"prompt": "hello", "max_tokens": 2}
        status, _, reply = call(server.url, "POST", "/v1/completions", token=token, body=body)
        assert status == 200 and reply["usage"]["completion_tokens"] == 2
        assert call(server.url, "GET", "/metrics", token=token)[0] == 403
    assert server.exit_code == 0
