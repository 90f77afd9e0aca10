"""The scripts in examples/, run as a user runs them (a fresh process each), pointed at
temporary vaults through their arguments and the KVPACK_* environment: generate with the
vault (on tiny, and on the demo model, slow), restore into mlx-lm's own generate (on
tiny's mlx-lm directory at A = 64), and one vault shared by two processes over S3 and
PostgreSQL."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.slotkit import TINY_A
from tests.kvpack.conftest import s3_settings

ROOT = Path(__file__).resolve().parents[1]
CALL = re.compile(
    r"call (\d): tier (\w+), cached (\d+) of (\d+) prompt tokens, restore [\d.]+ s, "
    r"prefill [\d.]+ s\n  text: (.*)\n"
)


def example(name: str, *args: str, env: dict[str, str], timeout: float = 600) -> str:
    """Run examples/<name> in a fresh process; its stdout (it must exit 0)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVPACK_")}
    base.update(PYTHONPATH=str(ROOT), **env)
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True, text=True, env=base, cwd=ROOT, timeout=timeout,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def calls(stdout: str) -> list[tuple[str, int, int, str]]:
    """(tier, cached tokens, prompt tokens, text) of each call the example reports."""
    found = [(t, int(c), int(n), text) for _, t, c, n, text in CALL.findall(stdout)]
    assert len(found) == 2, stdout
    return found


def check_generate(tmp_path: Path, model: str) -> None:
    """First run: the second call restores the whole prompt from the resident tier, with
    the same text; second run (a new process on the same data dir): its first call is
    served from the durable tier, with the same text again."""
    env = {"KVPACK_CACHE_DIR": str(tmp_path / "kvpack-cache")}
    argv = ("--model", model, "--data-dir", str(tmp_path / "vault"), "--max-tokens", "12")
    (t1, c1, n, text), (t2, c2, n2, text2) = calls(example("generate.py", *argv, env=env))
    assert (t1, c1) == ("none", 0) and (t2, c2) == ("resident", n) and n == n2 > 0
    assert text2 == text
    (t3, c3, n3, text3), _ = calls(example("generate.py", *argv, env=env))
    assert (t3, c3, n3, text3) == ("durable", n, n, text)


def test_generate_on_tiny(tmp_path):
    check_generate(tmp_path, "tiny")


@pytest.mark.slow
def test_generate_on_the_demo_model(tmp_path):
    check_generate(tmp_path, "smollm2")


def test_mlx_lm_restore_on_tiny(tmp_path, tiny_models):
    """First run: the vault holds nothing; the aligned cut (128) and the exact one (all
    but the last token) are sealed, and mlx-lm's tokens equal its cold run's. Second run:
    that exact cut comes from the durable tier, and the tokens still equal the cold run's."""
    env = {"KVPACK_CACHE_DIR": str(tmp_path / "kvpack-cache"), "KVPACK_ALIGNMENT": str(TINY_A)}
    argv = ("--model", str(tiny_models["float32"]), "--data-dir", str(tmp_path / "vault"))
    first = example("mlx_lm_restore.py", *argv, env=env)
    depth = int(re.search(r"vault: 0 of (\d+) tokens from tier none", first)[1])
    assert depth > 2 * TINY_A
    sealed = [int(d) for d in re.findall(r"sealed the cut at (\d+) tokens", first)]
    assert sealed == [depth // TINY_A * TINY_A, depth]
    assert "same tokens as a cold mlx-lm run: True" in first
    second = example("mlx_lm_restore.py", *argv, env=env)
    assert f"vault: {depth} of {depth} tokens from tier durable" in second
    assert "sealed" not in second and "same tokens as a cold mlx-lm run: True" in second


@pytest.mark.s3
@pytest.mark.postgres
def test_shared_vault_over_s3_and_postgres(tmp_path, s3_config):
    """The first process computes (no tier), the second — started by it, nothing in
    memory — is served the whole prompt from the durable tier: S3 chunks and PostgreSQL
    rows, with the same text."""
    from tests.fixtures.db import DatabaseFactory

    factory = DatabaseFactory("postgres", tmp_path)
    try:
        settings = s3_settings(s3_config) | {"database_url": factory.create()}
        env = {f"KVPACK_{k.upper()}": v for k, v in settings.items() if v is not None}
        env["KVPACK_CACHE_DIR"] = str(tmp_path / "kvpack-cache")
        out = example("shared_vault.py", "--model", "tiny", "--data-dir", str(tmp_path / "v"),
                      env=env)  # fmt: skip
    finally:
        factory.drop_all()
    assert "note" not in out
    lines = dict(re.findall(r"^(first|second): (.*)$", out, re.M))
    first, second = (re.match(r"tier (\w+), cached (\d+) of (\d+)", lines[r]) for r in lines)
    assert (first[1], first[2]) == ("none", "0")
    assert (second[1], second[2]) == ("durable", first[3])
    assert lines["first"].split(" text ")[1] == lines["second"].split(" text ")[1]
