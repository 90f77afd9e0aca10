"""`kvpack vault` on a real vault (the local directory and S3): verify --read-data finds
each class of damage and names the cuts it breaks, --repair condemns them, a clean vault
exits 0; stats, ls, quota, gc and forget say what they did, in text and --json; bad usage
exits 2."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from sqlalchemy import update

from catalog.ids import IdentityDigest
from catalog.models import ChunkRow
from catalog.queries import manifest_chunk_ids
from catalog.scope import Scope
from kvpack.cli import main
from kvpack.config import Settings
from kvpack.vault import Vault
from tests.kvpack.conftest import s3_settings

A = 64
IDENTITY = IdentityDigest(b"vault-command-test".ljust(32, b"\0"))
SCOPE = Scope(
    IDENTITY, "default", A, components={"namespace": "default", "alignment": A}, model="synthetic"
)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def where(request, tmp_path) -> tuple[Settings, list[str]]:
    """Settings of a fresh vault and the storage flags that reach it."""
    flags = {"data_dir": str(tmp_path / "vault"), "alignment": str(A)}
    if request.param == "s3":
        extra = s3_settings(request.getfixturevalue("s3_config"))
        flags |= {k: v for k, v in extra.items() if v is not None}
    argv = [x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", v)]
    return Settings.load(env={}, **flags), argv


def history(seed: int, n: int = 2 * A) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def fill(settings: Settings, cuts: int) -> list:
    """`cuts` cuts of distinct histories, two chunks each (no chunk shared)."""
    vault = Vault.open(settings)
    try:
        out = []
        for i in range(cuts):
            rng = random.Random(1000 + i)
            parts = [(f"block/{j}", rng.randbytes(4096 + j)) for j in range(2)]
            vault.publish(SCOPE, history(i), layout={"test": i}, parts=parts, logits_witnessed=True)
            out.append(vault.find(SCOPE, SCOPE.chain(history(i))))
        return out
    finally:
        vault.close()


def vault_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(["vault", *argv])
    got = capsys.readouterr()
    return code, got.out, got.err


def damage(settings: Settings, cuts) -> dict[str, tuple[str, str]]:
    """One class of damage per cut; kind -> (broken object key, manifest id it breaks)."""
    vault = Vault.open(settings)
    objects = vault.objects
    try:

        def chunk_key(cut, i=0):
            chunk = vault.read(
                lambda s: manifest_chunk_ids(session=s, manifest_id=cut.manifest_id)[i]
            )
            return chunk, f"chunks/{chunk[:2]}/{chunk}"

        def rewrite(key, change):
            data = bytearray(vault.run(objects.get(key)))
            vault.run(objects.delete(key))
            vault.run(objects.put_if_absent(key, bytes(change(data))))

        def flip(data):
            data[len(data) // 2] ^= 0x01
            return data

        out = {}
        _, key = chunk_key(cuts[0])
        rewrite(key, flip)
        out["chunk_corrupt"] = (key, cuts[0].manifest_id.hex)
        _, key = chunk_key(cuts[1])
        rewrite(key, lambda d: d[: len(d) // 2])
        out["chunk_truncated"] = (key, cuts[1].manifest_id.hex)
        _, key = chunk_key(cuts[2])
        vault.run(objects.delete(key))
        out["chunk_missing"] = (key, cuts[2].manifest_id.hex)
        rewrite(cuts[3].object_key, flip)
        out["manifest_invalid"] = (cuts[3].object_key, cuts[3].manifest_id.hex)
        vault.run(objects.delete(cuts[4].object_key))
        out["manifest_missing"] = (cuts[4].object_key, cuts[4].manifest_id.hex)
        chunk, key = chunk_key(cuts[5], 1)
        with vault.transaction() as s:
            s.execute(
                update(ChunkRow)
                .where(ChunkRow.id == chunk)
                .values(stored_size=ChunkRow.stored_size + 1)
            )
        out["size_mismatch"] = (key, cuts[5].manifest_id.hex)
        return out
    finally:
        vault.close()


def test_verify_finds_each_class_of_damage_and_repair_condemns_it(where, capsys):
    """Six cuts, each damaged one way, and one left intact. verify without --read-data
    finds all but the flipped chunk byte (sizes are right); with --read-data it finds all
    six, each object named with the cut it breaks, exit 1; the intact cut is named
    nowhere. --repair condemns the six; verify is then clean (exit 0) and the intact cut
    still loads."""
    settings, argv = where
    cuts = fill(settings, 7)
    code, out, _ = vault_cli(["verify", "--read-data", *argv], capsys)
    assert code == 0 and "no problems found" in out and "7 cuts and 14 chunks" in out
    broken = damage(settings, cuts)

    code, out, _ = vault_cli(["verify", "--json", *argv], capsys)
    assert code == 1
    assert {p["kind"] for p in json.loads(out)["problems"]} == set(broken) - {"chunk_corrupt"}

    code, out, _ = vault_cli(["verify", "--read-data", "--json", *argv], capsys)
    assert code == 1
    doc = json.loads(out)
    found = {p["kind"]: (p["object"], [c["manifest"] for c in p["cuts"]]) for p in doc["problems"]}
    assert found == {kind: (key, [mid]) for kind, (key, mid) in broken.items()}
    # read: all but the three whose sizes are wrong and the one that fails its re-hash
    assert doc["broken_cuts"] == 6 and doc["chunks_read"] == 14 - 4

    code, out, _ = vault_cli(["verify", "--read-data", *argv], capsys)
    assert code == 1 and "6 broken object(s), 6 cut(s) affected" in out
    for kind, (key, mid) in broken.items():
        assert f"BROKEN {key}: {kind}" in out and f"breaks cut {mid}" in out
    assert cuts[6].manifest_id.hex not in out

    code, out, _ = vault_cli(["verify", "--read-data", "--repair", *argv], capsys)
    assert code == 1 and "condemned 6 cut(s)" in out
    code, out, _ = vault_cli(["verify", "--read-data", *argv], capsys)
    assert code == 0 and "checked 1 cuts and 2 chunks" in out
    vault = Vault.open(settings)
    try:
        assert vault.load(cuts[6], SCOPE).manifest.layout == {"test": 6}
        code, out, _ = vault_cli(["condemned", "--json", *argv], capsys)
        assert {r["kind"] for r in json.loads(out)} == set(broken)
    finally:
        vault.close()


def test_stats_ls_quota_gc_and_forget(where, capsys):
    """The other subcommands on three cuts: what stats and ls report agrees with what
    was published; a quota shows its use; gc --dry-run predicts what gc then does;
    forget makes the identity's cuts unreachable and gc --grace 0s reclaims the bytes."""
    settings, argv = where
    cuts = fill(settings, 3)
    code, out, _ = vault_cli(["stats", "--json", *argv], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["cuts"] == 3 and doc["chunks"] == 6
    assert doc["footprint"] == doc["cut_bytes"] == sum(c.bytes for c in cuts)
    assert doc["identities"][0]["model"] == "synthetic" and doc["dedup_ratio"] == 1.0
    code, out, _ = vault_cli(["ls", "--json", "--model", "synthetic", *argv], capsys)
    assert sorted(c["manifest_id"] for c in json.loads(out)) == sorted(
        c.manifest_id.hex for c in cuts
    )
    code, out, _ = vault_cli(["quota", "set", "default", "10KiB", *argv], capsys)
    assert code == 0 and "default" in out and "10.0 KiB" in out
    code, out, _ = vault_cli(["gc", "--dry-run", "--json", *argv], capsys)
    plan = json.loads(out)
    assert plan["evict"] == 2 and plan["footprint_after"] == cuts[2].bytes
    code, out, _ = vault_cli(["gc", "--json", *argv], capsys)
    done = json.loads(out)
    assert code == 0 and done["evicted"] == 2 and done["quota_evicted"] == {"default": 2}
    assert done["footprint_after"] == plan["footprint_after"]
    code, out, _ = vault_cli(["quota", "clear", "default", *argv], capsys)
    assert code == 0

    code, out, _ = vault_cli(
        ["forget", "--identity", IDENTITY.hex[:10], "--dry-run", *argv], capsys
    )
    assert code == 0 and "would forget 1 cut(s)" in out
    code, out, _ = vault_cli(["forget", "--model", "synthetic", *argv], capsys)
    assert code == 0 and "forgot 1 cut(s)" in out
    code, out, _ = vault_cli(["gc", "--grace", "0s", "--json", *argv], capsys)
    assert json.loads(out)["deleted_chunks"] == 6
    code, out, _ = vault_cli(["stats", "--json", *argv], capsys)
    doc = json.loads(out)
    assert (doc["cuts"], doc["chunk_rows"], doc["stored_bytes"]) == (0, 0, 0)
    code, _, err = vault_cli(["forget", "--model", "synthetic", *argv], capsys)
    assert code == 1  # nothing left to forget


@pytest.mark.parametrize(
    "argv",
    [
        ["gc", "--budget", "12XB"],
        ["gc", "--grace", "soon"],
        ["verify", "--sample", "0"],
        ["forget", "--identity", "zz"],
        ["forget", "--identity", "abcdef0123", "--model", "m"],
        ["quota", "clear", "nobody"],
    ],
)
def test_bad_usage_exits_2(argv, tmp_path, capsys):
    flags = ["--data-dir", str(tmp_path / "vault")]
    try:
        code = main(["vault", *argv, *flags])
    except SystemExit as e:  # argparse refuses a bad value itself
        code = e.code
    assert code == 2
    assert capsys.readouterr().err


def test_progress_shows_on_a_terminal_and_not_when_piped(tmp_path):
    """verify draws a progress bar on stderr when it is a terminal (a pty here) and
    writes nothing there when stderr is a pipe; stdout is the same either way."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    settings = Settings.load(data_dir=tmp_path / "vault", alignment=A, env={})
    fill(settings, 2)
    argv = [
        sys.executable,
        "-m",
        "kvpack.cli",
        "vault",
        "verify",
        "--read-data",
        "--data-dir",
        str(settings.data_dir),
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    piped = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert piped.returncode == 0 and "no problems found" in piped.stdout
    assert piped.stderr == ""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    try:
        shown = subprocess.run(
            argv, stdout=subprocess.PIPE, stderr=follower, text=True, env=env, timeout=120
        )
        os.close(follower)
        follower = -1
        drawn = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the pty is closed once the child is gone
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        if follower != -1:
            os.close(follower)
        os.close(leader)
    assert shown.returncode == 0 and shown.stdout == piped.stdout
    assert b"verify" in drawn and b"obj" in drawn  # tqdm's "verify: ... 8/8 [..obj/s]"
