"""`kvpack keys`, `kvpack peers` and `kvpack quarantine`, through the real CLI in-process,
each on embedded vaults (SQLite and a local store under a temp data dir)."""

from __future__ import annotations

import io
import json
import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from catalog.ids import IdentityDigest
from catalog.signing import Bundle, BundleInvalid
from kvpack import cli
from kvpack.config import Settings
from kvpack.remote.quarantine import Quarantine
from kvpack.vault import Vault

PEER_KEY = "kvp_0123456789abcdef_peer-secret-never-printed"
UNREACHABLE = "http://127.0.0.1:9"


@pytest.fixture(autouse=True)
def no_kvpack_env(monkeypatch):
    """Only the flags say where the vault is."""
    for var in [v for v in os.environ if v.startswith("KVPACK_")]:
        monkeypatch.delenv(var)


def kv(capsys, data_dir: Path, *argv: str) -> tuple[int, str, str]:
    code = cli.main([*argv, "--data-dir", str(data_dir)])
    out, err = capsys.readouterr()
    return code, out, err


def show(capsys, data_dir: Path) -> Bundle:
    code, out, err = kv(capsys, data_dir, "keys", "show")
    assert code == 0, err
    return Bundle.from_json(out)


def trusted(capsys, data_dir: Path) -> dict[str, list[str]]:
    """`keys list` as key id -> [producer, endorsed by, added date, time, revoked...]."""
    code, out, err = kv(capsys, data_dir, "keys", "list")
    assert code == 0, err
    rows = [line.split() for line in out.splitlines()[1:]]
    return {r[1]: [r[0], *r[2:]] for r in rows}


def bundle_file(capsys, producer_dir: Path, path: Path) -> Bundle:
    bundle = show(capsys, producer_dir)
    path.write_text(bundle.to_json())
    return bundle


# -- keys --------------------------------------------------------------------------------


def test_generate_refuses_an_existing_key_file(tmp_path, capsys):
    """`keys generate` writes the key file (0600) and prints producer and key id; a second
    generate exits 2, says the file exists and leaves it as it was."""
    code, out, err = kv(capsys, tmp_path, "keys", "generate")
    assert code == 0, err
    key_file = tmp_path / "producer-key.json"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    bundle = show(capsys, tmp_path)
    assert bundle.producer in out and bundle.keys[0].id in out
    before = key_file.read_bytes()
    code, out, err = kv(capsys, tmp_path, "keys", "generate")
    assert code == 2 and out == "" and "exists" in err and "keys rotate" in err
    assert key_file.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".producer-key")] == []


def test_show_prints_a_bundle_that_checks_and_needs_a_key_file(tmp_path, capsys):
    """`keys show` prints the public bundle alone on stdout (Bundle.from_json accepts it,
    no private key in it); with no key file it exits 2 and creates none."""
    code, out, _ = kv(capsys, tmp_path, "keys", "show")
    assert code == 2 and out == ""
    assert not (tmp_path / "producer-key.json").exists()
    kv(capsys, tmp_path, "keys", "generate")
    code, out, _ = kv(capsys, tmp_path, "keys", "show")
    bundle = Bundle.from_json(out)
    assert code == 0 and len(bundle.keys) == 1 and bundle.keys[0].endorsed_by is None
    assert "private" not in out
    assert bundle.producer == (tmp_path / "producer-id").read_text().strip()


def test_rotate_adds_a_key_endorsed_by_the_previous_one(tmp_path, capsys):
    """`keys rotate`: the bundle then holds two keys, the second endorsed by the first (the
    endorsement verifies); the output names both and the endorsement."""
    assert kv(capsys, tmp_path, "keys", "rotate")[0] == 2  # nothing to rotate yet
    kv(capsys, tmp_path, "keys", "generate")
    first = show(capsys, tmp_path).keys[0]
    code, out, err = kv(capsys, tmp_path, "keys", "rotate")
    assert code == 0, err
    bundle = show(capsys, tmp_path)
    assert [k.id for k in bundle.keys][0] == first.id and len(bundle.keys) == 2
    assert bundle.keys[1].endorsed_by == first.id and bundle.keys[1].endorsement
    assert first.id in out and bundle.keys[1].id in out and "endorsement" in out


def test_trust_pins_another_vaults_bundle(tmp_path, capsys):
    """`keys trust FILE` in vault B pins both keys of vault A's rotated bundle; `keys list`
    shows them under A's producer with the endorsement; trusting again adds nothing."""
    a, b, path = tmp_path / "a", tmp_path / "b", tmp_path / "a.json"
    kv(capsys, a, "keys", "generate")
    kv(capsys, a, "keys", "rotate")
    bundle = bundle_file(capsys, a, path)
    k1, k2 = (k.id for k in bundle.keys)
    code, out, err = kv(capsys, b, "keys", "trust", str(path))
    assert code == 0, err
    assert bundle.producer in out and k1 in out and k2 in out
    rows = trusted(capsys, b)
    assert set(rows) == {k1, k2}
    assert rows[k1][:2] == [bundle.producer, "-"] and rows[k1][-1] == "-"
    assert rows[k2][:2] == [bundle.producer, k1] and rows[k2][-1] == "-"
    code, out, _ = kv(capsys, b, "keys", "trust", str(path))
    assert code == 0 and "no new key" in out
    assert set(trusted(capsys, a)) == set()  # A's own keys are not in A's trust store


def test_trust_reads_stdin(tmp_path, capsys, monkeypatch):
    """`keys trust -` reads the bundle from stdin."""
    kv(capsys, tmp_path / "a", "keys", "generate")
    bundle = show(capsys, tmp_path / "a")
    monkeypatch.setattr("sys.stdin", io.StringIO(bundle.to_json()))
    code, _, err = kv(capsys, tmp_path / "b", "keys", "trust", "-")
    assert code == 0, err
    assert set(trusted(capsys, tmp_path / "b")) == {bundle.keys[0].id}


def test_tampered_or_malformed_bundle_is_refused_and_nothing_trusted(tmp_path, capsys):
    """A bundle whose endorsement has one hex digit flipped, one that is not JSON and a
    missing file: each exits 2 with a message, no traceback, and nothing is trusted."""
    a, b = tmp_path / "a", tmp_path / "b"
    kv(capsys, a, "keys", "generate")
    kv(capsys, a, "keys", "rotate")
    doc = json.loads(show(capsys, a).to_json())
    sig = doc["keys"][1]["endorsement"]
    doc["keys"][1]["endorsement"] = ("1" if sig[0] != "1" else "2") + sig[1:]
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(doc))
    with pytest.raises(BundleInvalid):
        Bundle.from_json(tampered.read_text())  # the tamper is one the check must see
    code, out, err = kv(capsys, b, "keys", "trust", str(tampered))
    assert code == 2 and out == "" and "endorsement" in err and "Traceback" not in err
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    for source in (garbage, tmp_path / "missing.json"):
        code, out, err = kv(capsys, b, "keys", "trust", str(source))
        assert code == 2 and out == "" and str(source) in err
    assert trusted(capsys, b) == {}


def test_untrust_revokes_and_revoked_keys_stay_revoked(tmp_path, capsys):
    """`keys untrust P --key K` revokes K only (`list` shows a revocation time); trusting
    the bundle again does not bring K back; `untrust P` revokes the rest; an unknown
    producer exits 2."""
    a, b, path = tmp_path / "a", tmp_path / "b", tmp_path / "a.json"
    kv(capsys, a, "keys", "generate")
    kv(capsys, a, "keys", "rotate")
    bundle = bundle_file(capsys, a, path)
    k1, k2 = (k.id for k in bundle.keys)
    kv(capsys, b, "keys", "trust", str(path))
    code, out, err = kv(capsys, b, "keys", "untrust", bundle.producer, "--key", k2)
    assert code == 0 and k2 in out and k1 not in out, err
    rows = trusted(capsys, b)
    assert rows[k1][-1] == "-" and rows[k2][-1] != "-"
    code, out, _ = kv(capsys, b, "keys", "trust", str(path))
    assert code == 0 and "stay revoked" in out
    assert trusted(capsys, b)[k2][-1] != "-"
    assert kv(capsys, b, "keys", "untrust", bundle.producer)[0] == 0
    assert all(row[-1] != "-" for row in trusted(capsys, b).values())
    code, out, err = kv(capsys, b, "keys", "untrust", "vault-nobody")
    assert code == 2 and out == "" and "vault-nobody" in err


# -- peers -------------------------------------------------------------------------------


def test_peers_add_list_remove_never_print_the_key(tmp_path, capsys, monkeypatch):
    """`peers add` with --api-key-env writes the peers file (0600, the key in it); `peers`
    alone and `peers list` show name and url but never the key; `remove` drops it."""
    monkeypatch.setenv("EAST_KEY", PEER_KEY)
    outputs = []
    code, out, err = kv(capsys, tmp_path, "peers", "add", "east", "http://east.test:8000/",
                        "--api-key-env", "EAST_KEY")  # fmt: skip
    assert code == 0, err
    outputs += [out, err]
    peers_file = tmp_path / "peers.json"
    assert stat.S_IMODE(peers_file.stat().st_mode) == 0o600
    assert json.loads(peers_file.read_text())["peers"] == [
        {"name": "east", "url": "http://east.test:8000", "api_key": PEER_KEY}
    ]
    for argv in (["peers"], ["peers", "list"]):
        code, out, err = kv(capsys, tmp_path, *argv)
        assert code == 0 and out.split() == ["east", "http://east.test:8000"], err
        outputs += [out, err]
    code, out, err = kv(capsys, tmp_path, "peers", "remove", "east")
    assert code == 0 and json.loads(peers_file.read_text())["peers"] == []
    outputs += [out, err]
    assert all(PEER_KEY not in text and "peer-secret" not in text for text in outputs)


def test_peers_add_reads_a_key_file(tmp_path, capsys):
    """--api-key-file: the key is the file's content, surrounding whitespace stripped."""
    key_file = tmp_path / "east.key"
    key_file.write_text(f"{PEER_KEY}\n")
    code, _, err = kv(capsys, tmp_path, "peers", "add", "east", "https://east.test",
                      "--api-key-file", str(key_file))  # fmt: skip
    assert code == 0, err
    assert json.loads((tmp_path / "peers.json").read_text())["peers"][0]["api_key"] == PEER_KEY


def test_peers_bad_input_exits_2_and_changes_nothing(tmp_path, capsys, monkeypatch):
    """A duplicate name, a non-http url, a bad name, an unset key variable, a key that is
    not a kvpack key, and removing an unknown peer: exit 2, a message, file unchanged."""
    monkeypatch.setenv("EAST_KEY", PEER_KEY)
    monkeypatch.setenv("NOT_A_KEY", "hunter2")
    add, key = ["peers", "add"], ["--api-key-env", "EAST_KEY"]
    code, _, err = kv(capsys, tmp_path, *add, "east", "http://east.test", *key)
    assert code == 0, err
    before = (tmp_path / "peers.json").read_text()
    cases = {
        "exists": [*add, "east", "http://other.test", *key],
        "http": [*add, "west", "ftp://west.test", *key],
        "peer name": [*add, "we st", "http://west.test", *key],
        "UNSET_KEY": [*add, "west", "http://west.test", "--api-key-env", "UNSET_KEY"],
        "not a kvpack API key": [*add, "west", "http://west.test", "--api-key-env", "NOT_A_KEY"],
        "no peer named": ["peers", "remove", "west"],
    }
    for message, argv in cases.items():
        code, out, err = kv(capsys, tmp_path, *argv)
        assert (code, out) == (2, ""), (argv, out, err)
        assert message in err and "Traceback" not in err, err
        assert "hunter2" not in err
    assert (tmp_path / "peers.json").read_text() == before


def test_check_reports_an_unreachable_peer_and_exits_0(tmp_path, capsys, monkeypatch):
    """`peers list --check` on a peer nobody listens for: its line says unreachable, the
    command still exits 0, and the key is not printed."""
    monkeypatch.setenv("K", PEER_KEY)
    kv(capsys, tmp_path, "peers", "add", "gone", UNREACHABLE, "--api-key-env", "K")
    code, out, err = kv(capsys, tmp_path, "peers", "list", "--check")
    assert code == 0, err
    (line,) = out.splitlines()
    assert line.startswith("gone") and UNREACHABLE in line and "error: unreachable" in line
    assert PEER_KEY not in out + err


class _KeysPeer(BaseHTTPRequestHandler):
    """GET /v1/peer/keys: the bundle, for the bearer key only (401 otherwise)."""

    bundle = ""
    seen: list[str | None] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.seen.append(self.headers.get("Authorization"))
        ok = self.path == "/v1/peer/keys" and self.seen[-1] == f"Bearer {PEER_KEY}"
        body = self.bundle.encode() if ok else b'{"error": "unauthorized"}'
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def keys_peer(bundle: Bundle) -> Iterator[tuple[str, list]]:
    handler = type("Handler", (_KeysPeer,), {"bundle": bundle.to_json(), "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_check_says_which_of_a_peers_keys_we_trust(tmp_path, capsys, monkeypatch):
    """`peers list --check` sends the peer key as a bearer token and, per key of the
    peer's bundle, says trusted yes (pinned), yes (endorsed: a rotation of a pinned key),
    or revoked; a peer holding a different key of ours gets HTTP 401 on its line."""
    a, b, path = tmp_path / "a", tmp_path / "b", tmp_path / "a.json"
    kv(capsys, a, "keys", "generate")
    k1 = bundle_file(capsys, a, path).keys[0].id
    kv(capsys, b, "keys", "trust", str(path))  # B pins k1 only, then A rotates twice
    kv(capsys, a, "keys", "rotate")
    kv(capsys, a, "keys", "rotate")
    bundle = show(capsys, a)
    _, k2, k3 = (k.id for k in bundle.keys)
    monkeypatch.setenv("GOOD", PEER_KEY)
    monkeypatch.setenv("BAD", "kvp_0123456789abcdef_wrong")
    with keys_peer(bundle) as (url, seen):
        kv(capsys, b, "peers", "add", "a", url, "--api-key-env", "GOOD")
        kv(capsys, b, "peers", "add", "a-bad", url, "--api-key-env", "BAD")
        code, out, err = kv(capsys, b, "peers", "list", "--check")
    assert code == 0, err
    assert seen == [f"Bearer {PEER_KEY}", "Bearer kvp_0123456789abcdef_wrong"]
    good, bad = out.splitlines()
    assert f"ok, producer {bundle.producer}" in good
    assert f"{k1} trusted: yes," in good
    assert f"{k2} trusted: yes (endorsed)" in good and f"{k3} trusted: yes (endorsed)" in good
    assert bad.startswith("a-bad") and "error: HTTP 401" in bad
    assert PEER_KEY not in out + err and "wrong" not in out + err
    kv(capsys, b, "keys", "untrust", bundle.producer, "--key", k1)
    with keys_peer(bundle) as (url, _):
        kv(capsys, b, "peers", "remove", "a")
        kv(capsys, b, "peers", "add", "a", url, "--api-key-env", "GOOD")
        _, out, _ = kv(capsys, b, "peers", "list", "--check")
    line = next(row for row in out.splitlines() if row.startswith("a "))
    assert f"{k1} trusted: revoked" in line
    assert f"{k2} trusted: no" in line and f"{k3} trusted: no" in line


# -- quarantine --------------------------------------------------------------------------


@contextmanager
def quarantine(data_dir: Path) -> Iterator[Quarantine]:
    """The vault's quarantine, built from the library pieces (not the CLI's helper)."""
    vault = Vault.open(Settings.load(data_dir=data_dir, env={}))
    try:
        yield Quarantine(vault)
    finally:
        vault.close()


def refused_import(data_dir: Path, reason: str) -> str:
    with quarantine(data_dir) as q:
        import_id = q.open(peer="east", identity=IdentityDigest(bytes(range(32))))
        q.put(import_id, "statement", b"s" * 123)
        q.note(import_id, producer="vault-east", generation=7, depth=512)
        q.refuse(import_id, reason)
    return import_id


def test_quarantine_list_show_drop(tmp_path, capsys):
    """A refused import (statement kept): `list` shows it with its reason cut to fit;
    `show` prints its fields and the statement's size, "gone" for the missing planes;
    `drop` removes row and bytes, and a second drop exits 2."""
    reason = "signature by key 00ff does not verify " + "x" * 100
    import_id = refused_import(tmp_path, reason)
    with quarantine(tmp_path) as q:
        pending = q.open(peer="west", identity=IdentityDigest(bytes(32)))
    code, out, err = kv(capsys, tmp_path, "quarantine", "list")
    assert code == 0, err
    (line,) = [row for row in out.splitlines() if row.startswith(import_id)]
    assert line.split()[1:6] == ["refused", "east", "vault-east", "7", "512"]
    assert "signature by key 00ff does not verify" in line and reason not in line
    assert len(line.split("  ")[-1]) <= 60
    code, out, _ = kv(capsys, tmp_path, "quarantine", "list", "--state", "pending", "--json")
    assert [json.loads(row)["import_id"] for row in out.splitlines()] == [pending]

    code, out, err = kv(capsys, tmp_path, "quarantine", "show", import_id)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["state"] == "refused" and doc["reason"] == reason and doc["peer"] == "east"
    assert doc["objects"] == {"statement": 123, "planes": "gone"}

    code, out, err = kv(capsys, tmp_path, "quarantine", "drop", import_id)
    assert code == 0 and import_id in out, err
    with quarantine(tmp_path) as q:
        assert q.show(import_id) is None
        assert q.show(pending) is not None
    assert not (tmp_path / "objects" / "quarantine" / import_id / "statement").exists()
    code, out, err = kv(capsys, tmp_path, "quarantine", "drop", import_id)
    assert code == 2 and out == "" and import_id in err
    code, out, err = kv(capsys, tmp_path, "quarantine", "show", import_id)
    assert code == 2 and out == "" and import_id in err


def test_quarantine_drop_all_refused_keeps_the_rest(tmp_path, capsys):
    """`drop --all-refused` drops every refused import and no pending one."""
    refused = {refused_import(tmp_path, "bad"), refused_import(tmp_path, "worse")}
    with quarantine(tmp_path) as q:
        pending = q.open(peer="west", identity=IdentityDigest(bytes(32)))
    code, out, err = kv(capsys, tmp_path, "quarantine", "drop", "--all-refused")
    assert code == 0, err
    dropped = [row.split() for row in out.splitlines()]
    assert {row[1] for row in dropped if len(row) == 2} == refused
    assert dropped[-1][:2] == ["dropped", "2"]
    with quarantine(tmp_path) as q:
        assert [r.import_id for r in q.list()] == [pending]
