"""infra/kvpack.service (systemd) and infra/kvpack.plist (launchd): each runs `kvpack db
upgrade` then `kvpack serve` from the venv, with a data dir, an environment file for
secrets and a restart-on-failure policy. systemd-analyze checks the unit (its ExecStart
binaries must exist, so the venv prefix points at a stub for it); the launchd agent's
script is run with /bin/sh against a stub kvpack that records its calls."""

from __future__ import annotations

import json
import os
import plistlib
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.infra.files import INFRA, require_tool, systemd_unit

VENV = "/opt/kvpack"
MODEL_DIR = "/opt/kvpack-model"  # README "Run as a service"; MLX opens the GGUF in it read-write
UNIT = INFRA / "kvpack.service"
AGENT = INFRA / "kvpack.plist"
ENV_EXAMPLE = INFRA / "kvpack.env.example"


def stub_venv(root: Path, *, fail_on: str | None = None) -> Path:
    """root/bin/kvpack: appends {argv, KVPACK_* env} to root/calls.jsonl; exits 1 when
    its first argument is `fail_on`."""
    (root / "bin").mkdir(parents=True)
    stub = root / "bin" / "kvpack"
    stub.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"with open({str(root / 'calls.jsonl')!r}, 'a') as f:\n"
        "    env = {k: v for k, v in os.environ.items() if k.startswith('KVPACK_')}\n"
        "    f.write(json.dumps({'argv': sys.argv[1:], 'env': env}) + '\\n')\n"
        f"sys.exit(1 if sys.argv[1:2] == [{fail_on!r}] else 0)\n"
    )
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    return stub


def calls(root: Path) -> list[dict]:
    path = root / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# -- systemd ---------------------------------------------------------------------------


def service() -> dict[str, str | list[str]]:
    out: dict[str, str | list[str]] = {}
    for key, value in systemd_unit(UNIT)["Service"]:
        out.setdefault(key, []).append(value)  # type: ignore[union-attr]
    return {k: v[0] if len(v) == 1 else v for k, v in out.items()}  # type: ignore[index]


def test_systemd_analyze_verifies_the_unit_without_a_diagnostic(tmp_path):
    tool = require_tool("systemd-analyze")
    stub_venv(tmp_path / "venv")
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace(f"{VENV}/", f"{tmp_path / 'venv'}/"))
    done = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stderr


def test_the_unit_migrates_then_serves_from_the_venv_on_loopback():
    s = service()
    pre, start = shlex.split(s["ExecStartPre"]), shlex.split(s["ExecStart"])
    assert pre == [f"{VENV}/bin/kvpack", "db", "upgrade"]
    assert start[:2] == [f"{VENV}/bin/kvpack", "serve"]
    assert start[start.index("--host") + 1] == "127.0.0.1"
    assert start[start.index("--model") + 1] == "smollm2"
    assert "--no-auth" not in start


def test_the_unit_keeps_its_data_dir_reads_an_env_file_and_restarts_on_failure():
    s = service()
    assert s["Environment"] == f"KVPACK_DATA_DIR=/var/lib/{s['StateDirectory']}"
    assert s["StateDirectoryMode"] == "0700"
    assert s["EnvironmentFile"].lstrip("-") == "/etc/kvpack/kvpack.env"
    assert s["Restart"] == "on-failure"
    assert s["ProtectSystem"] != "strict" or s["ReadWritePaths"].lstrip("-") == MODEL_DIR
    assert s["KillSignal"] == "SIGTERM" and int(s["TimeoutStopSec"]) >= 10
    assert s["User"] not in ("root", "0")


def test_the_example_env_file_is_read_alike_by_systemd_and_sh():
    """KEY=value with no quotes or spaces: both parsers then see the same value."""
    for line in ENV_EXAMPLE.read_text().splitlines():
        setting = line.lstrip("#")
        if "=" in setting and setting.split("=", 1)[0].isidentifier():
            key, value = setting.split("=", 1)
            assert key.isupper() and not any(c in value for c in " \"'$`\\"), line


# -- launchd ---------------------------------------------------------------------------


def agent() -> dict:
    with AGENT.open("rb") as f:
        return plistlib.load(f)


def test_the_plist_parses_and_restarts_only_after_a_failure():
    a = agent()
    assert f"LaunchAgents/{a['Label']}.plist" in AGENT.read_text()  # installed under its label
    assert a["ProgramArguments"][:2] == ["/bin/sh", "-c"]
    assert a["RunAtLoad"] is True
    assert a["KeepAlive"] == {"SuccessfulExit": False}
    assert isinstance(a["ExitTimeOut"], int) and a["ExitTimeOut"] >= 10


def run_agent(tmp_path: Path, *, fail_on: str | None = None) -> subprocess.CompletedProcess:
    home = tmp_path / "home"
    (home / "Library" / "Logs").mkdir(parents=True)
    (home / ".config" / "kvpack").mkdir(parents=True)
    (home / ".config" / "kvpack" / "kvpack.env").write_text("KVPACK_NAMESPACE=acme\n")
    stub_venv(tmp_path / "venv", fail_on=fail_on)
    script = agent()["ProgramArguments"][2].replace(f"{VENV}/", f"{tmp_path / 'venv'}/")
    env = {"HOME": str(home), "PATH": os.environ["PATH"]}
    return subprocess.run(["/bin/sh", "-c", script], env=env, timeout=30)


def test_the_agent_exports_the_env_file_and_migrates_before_serving(tmp_path):
    assert run_agent(tmp_path).returncode == 0
    made = calls(tmp_path / "venv")
    assert [c["argv"][:2] for c in made] == [["db", "upgrade"], ["serve", "--host"]]
    serve = made[1]["argv"]
    assert serve[serve.index("--host") + 1] == "127.0.0.1"
    for call in made:
        assert call["env"]["KVPACK_DATA_DIR"] == str(tmp_path / "home" / ".kvpack")
        assert call["env"]["KVPACK_NAMESPACE"] == "acme"  # exported, not only set


def test_the_agent_does_not_serve_an_unmigrated_catalog_and_exits_non_zero(tmp_path):
    assert run_agent(tmp_path, fail_on="db").returncode != 0  # KeepAlive restarts it
    assert [c["argv"][:2] for c in calls(tmp_path / "venv")] == [["db", "upgrade"]]


@pytest.mark.parametrize("path", [UNIT, AGENT])
def test_each_unit_names_the_env_file_the_example_documents(path):
    wanted = "/etc/kvpack/kvpack.env" if path == UNIT else "$HOME/.config/kvpack/kvpack.env"
    assert wanted in path.read_text()
    documented = "/etc/kvpack/kvpack.env" if path == UNIT else "~/.config/kvpack/kvpack.env"
    assert documented in ENV_EXAMPLE.read_text()
