"""engine.models.hub: Hugging Face repo ids resolved in the local cache, never downloaded.

The cache is the `hub_cache` fixture (tests/fixtures/models.py): kvpack-test/tiny (main:
tiny float32 at commit a; branch "int4" and tag "v1": the 4-bit copy at commit b) and
kvpack-test/tiny-8bit (main: the 8-bit copy at commit c)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from engine.models import ModelLoadError, ModelNotCached, load_model
from engine.models.hub import RepoSpec
from tests.fixtures.models import COMMITS

ROOT = Path(__file__).resolve().parents[2]
REPO = "kvpack-test/tiny"


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPACK_CACHE_DIR", str(tmp_path / "kvpack-cache"))


def snapshot(cache: Path, repo: str, commit: str) -> Path:
    return cache / ("models--" + repo.replace("/", "--")) / "snapshots" / commit


def test_repo_specs_parse():
    """`org/name[@revision]` is a repo spec; paths, bare names, ids the Hub forbids and
    revisions that would climb out of the repo folder are not."""
    assert RepoSpec.parse("org/name") == RepoSpec("org/name", None)
    assert RepoSpec.parse("mlx-community/Qwen3-0.6B-4bit@v1.0") == RepoSpec(
        "mlx-community/Qwen3-0.6B-4bit", "v1.0"
    )
    assert RepoSpec.parse("org/name@refs/pr/1") == RepoSpec("org/name", "refs/pr/1")
    assert str(RepoSpec.parse("org/name@main")) == "org/name@main"
    for spec in (
        "name",
        "a/b/c",
        "./org/name",
        "/org/name",
        "~/org/name",
        "org/na--me",
        "org/name@",
        "org/name@a@b",
        "org/name@../../elsewhere",
        "org/name@refs//x",
    ):
        assert RepoSpec.parse(spec) is None, spec


def test_resolves_by_repo_id_branch_tag_and_commit(hub_cache, tiny_models):
    """The default branch, a branch, a tag and a commit hash each load the snapshot they
    name — the same model (same identity) as the directory it was made from."""
    float32 = load_model(str(tiny_models["float32"]))
    int4 = load_model(str(tiny_models["q4g64"]))
    main = load_model(REPO, hf_cache=hub_cache)
    assert main.name == REPO and main.path == snapshot(hub_cache, REPO, COMMITS["a"])
    assert main.identity == float32.identity
    for revision in ("int4", "v1", COMMITS["b"]):
        m = load_model(f"{REPO}@{revision}", hf_cache=hub_cache)
        assert m.path == snapshot(hub_cache, REPO, COMMITS["b"]), revision
        assert m.identity == int4.identity and m.name == f"{REPO}@{revision}"
    pinned = load_model(f"{REPO}@{COMMITS['a']}", hf_cache=hub_cache)
    assert pinned.identity == float32.identity
    other = load_model("kvpack-test/tiny-8bit", hf_cache=hub_cache)
    assert other.path == snapshot(hub_cache, "kvpack-test/tiny-8bit", COMMITS["c"])
    assert len({main.identity.digest, int4.identity.digest, other.identity.digest}) == 3


def test_missing_models_are_typed_errors_naming_repo_revision_and_folder(hub_cache, tmp_path):
    """A repo that is not cached, a ref it does not have, a commit without a snapshot and a
    ref to a missing snapshot: each a ModelNotCached (a ModelLoadError) carrying the repo
    id, the revision and the repo folder looked in, all three in its message."""
    broken = tmp_path / "hub"
    shutil.copytree(hub_cache, broken, symlinks=True)
    folder = broken / ("models--" + REPO.replace("/", "--"))
    (folder / "refs" / "stale").write_text("f" * 40)
    cases = {
        ("kvpack-test/absent", "main"): "no such repo folder",
        (REPO, "no-such-branch"): "no ref 'no-such-branch' (refs here: int4, main, stale, v1)",
        (REPO, "e" * 40): f"no snapshot {'e' * 40}",
        (REPO, "stale"): f"no snapshot {'f' * 40}",
    }
    for (repo, revision), why in cases.items():
        spec = repo if revision == "main" else f"{repo}@{revision}"
        with pytest.raises(ModelNotCached) as info:
            load_model(spec, hf_cache=broken)
        err = info.value
        assert isinstance(err, ModelLoadError) and err.spec == spec
        assert (err.repo_id, err.revision, err.why) == (repo, revision, why)
        assert err.folder == broken / ("models--" + repo.replace("/", "--"))
        for part in (repo, revision, str(err.folder)):
            assert part in str(err)


def test_an_existing_path_wins_over_a_repo_id(hub_cache, tiny_models, tmp_path, monkeypatch):
    """A spec naming an existing directory is that directory, even when it is spelled like
    a cached repo id; `@main` asks the cache, `./` always means a path."""
    local = tmp_path / REPO
    shutil.copytree(tiny_models["q8g64"], local)
    monkeypatch.chdir(tmp_path)
    q8 = load_model(str(tiny_models["q8g64"])).identity
    assert load_model(REPO, hf_cache=hub_cache).identity == q8
    assert load_model(f"./{REPO}", hf_cache=hub_cache).path == local.resolve()
    cached = load_model(f"{REPO}@main", hf_cache=hub_cache)
    assert cached.path == snapshot(hub_cache, REPO, COMMITS["a"]) and cached.identity != q8


_CHILD = """
import json, socket, sys
connects = []
real_connect = socket.socket.connect
def record(self, address):
    connects.append(repr(address))
    return real_connect(self, address)
socket.socket.connect = record
socket.socket.connect_ex = lambda self, address: record(self, address) or 0
from engine.models import ModelNotCached, load_model
found = load_model("kvpack-test/tiny")
try:
    load_model("kvpack-test/absent@v2")
    missing = None
except ModelNotCached as e:
    missing = {"repo_id": e.repo_id, "revision": e.revision, "folder": str(e.folder)}
during = list(connects)
# The control: a request of our own must show up in both instruments.
import os, urllib.error, urllib.request
try:
    urllib.request.urlopen(os.environ["HF_ENDPOINT"] + "/control")
except urllib.error.HTTPError:
    pass
print(json.dumps({"path": str(found.path), "identity": found.identity.hex,
                  "missing": missing, "during": during, "control": connects[len(during):]}))
"""


class _Recorder(BaseHTTPRequestHandler):
    seen: list[str] = []

    def _any(self) -> None:
        self.seen.append(f"{self.command} {self.path}")
        self.send_response(404)
        self.end_headers()

    do_GET = do_HEAD = do_POST = _any

    def log_message(self, *args) -> None:
        pass


def test_hf_home_is_respected_and_nothing_touches_the_network(hub_cache, tiny_models):
    """In a fresh process with HF_HOME set (no cache argument), HF_HUB_OFFLINE unset and the
    Hub endpoint pointed at a recording server: a cached repo resolves under HF_HOME, a
    missing one is ModelNotCached, and no socket was connected, no request received —
    while a control request made afterwards shows up in both records."""
    _Recorder.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_HOME")
    }
    env.update(
        HF_HOME=str(hub_cache.parent),  # the fixture's cache is $HF_HOME/hub
        HF_ENDPOINT=f"http://127.0.0.1:{server.server_port}",
        PYTHONPATH=str(ROOT),
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, cwd=ROOT
        )
    finally:
        server.shutdown()
        thread.join()
    assert out.returncode == 0, out.stderr
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child["path"] == str(snapshot(hub_cache, REPO, COMMITS["a"]))
    assert child["identity"] == load_model(str(tiny_models["float32"])).identity.hex
    assert child["missing"] == {
        "repo_id": "kvpack-test/absent",
        "revision": "v2",
        "folder": str(hub_cache / "models--kvpack-test--absent"),
    }
    assert child["during"] == []
    assert len(child["control"]) == 1 and _Recorder.seen == ["GET /control"]
