"""Every KVPACK_* / AWS_* variable that infra/ sets (compose services, the image, the
systemd unit, the launchd agent, the example environment file) is one that kvpack's
settings, infra/'s own scripts or the test suites read: a misspelt or retired name would
be ignored silently. What is read comes from the code: Settings.environment_variables(),
the variables infra/*.sh expand and those tests/fixtures/ look up."""

from __future__ import annotations

import plistlib
import re

from kvpack.config import Settings
from tests.infra.files import INFRA, ROOT, Dockerfile, compose, systemd_unit

PREFIX = re.compile(r"^(KVPACK|AWS)_")
LOOKED_UP = re.compile(r"environ(?:\.get)?[(\[]\s*[\"']((?:KVPACK|AWS)_\w+)")
EXPANDED = re.compile(r"\$\{?((?:KVPACK|AWS)_\w+)")
ASSIGNED = re.compile(r"(?:^|[\s;])(?:export\s+)?((?:KVPACK|AWS)_\w+)=", re.MULTILINE)


def read_by_tests() -> set[str]:
    names = set()
    for path in (ROOT / "tests" / "fixtures").glob("*.py"):
        names |= set(LOOKED_UP.findall(path.read_text()))
    return names


def read_by_scripts() -> set[str]:
    return {n for path in INFRA.glob("*.sh") for n in EXPANDED.findall(path.read_text())}


def set_by_infra() -> dict[str, set[str]]:
    """Variable names each infra/ file sets, by file."""
    out: dict[str, set[str]] = {}
    services = compose()["services"]
    out["compose.yaml"] = {k for s in services.values() for k in (s.get("environment") or {})}
    out["Dockerfile"] = {k for stage in Dockerfile.read().stages for k in stage.env()}
    unit = systemd_unit(INFRA / "kvpack.service")["Service"]
    assignments = [word for key, value in unit if key == "Environment" for word in value.split()]
    out["kvpack.service"] = {word.split("=", 1)[0] for word in assignments}
    with (INFRA / "kvpack.plist").open("rb") as f:
        agent = plistlib.load(f)
    out["kvpack.plist"] = set(agent.get("EnvironmentVariables", {})) | set(
        ASSIGNED.findall(agent["ProgramArguments"][-1])
    )
    example = (INFRA / "kvpack.env.example").read_text()
    out["kvpack.env.example"] = set(re.findall(r"^#?(\w+)=", example, re.MULTILINE))
    return {name: {v for v in names if PREFIX.match(v)} for name, names in out.items()}


def test_the_test_suites_variables_are_found_in_the_fixtures():
    assert {n for n in read_by_tests() if n.startswith("KVPACK_TEST_")}, "the regex finds none"


def test_every_variable_infra_sets_is_read_by_the_settings_or_the_tests():
    read = set().union(*Settings.environment_variables().values())
    read |= read_by_scripts() | read_by_tests()
    found = set_by_infra()
    for name in ("compose.yaml", "Dockerfile", "kvpack.service", "kvpack.plist"):
        assert found[name], f"no KVPACK_* variable found in {name}: is the parser still right?"
    unread = {f"{file}: {v}" for file, names in found.items() for v in names - read}
    assert not unread, f"set but read by nothing: {sorted(unread)}"
