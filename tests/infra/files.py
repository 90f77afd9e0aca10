"""Reading infra/'s files as their tools would, for the tests in this package.

- ROOT / INFRA: the repository and its infra/ folder.
- require_tool(name): the tool's path; a missing tool FAILS under CI=true (`make setup`
  installs it: infra/install-checkers.sh) and skips elsewhere, saying why.
- compose(): infra/compose.yaml as YAML (anchors and merge keys resolved).
- Dockerfile / Stage / Instruction: infra/Dockerfile as stages of instructions, with
  line continuations joined and JSON-form arguments decoded.
- systemd_unit(path): a unit file as {section: [(key, value), ...]}.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
COMPOSE = INFRA / "compose.yaml"


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path:
        return path
    reason = f"{name} not found (make setup installs it: infra/install-checkers.sh)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; required under CI=true", pytrace=False)
    pytest.skip(reason)


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ENV, ...
    args: str  # the rest of the logical line, continuations joined

    def exec_form(self) -> list[str]:
        """CMD/ENTRYPOINT/HEALTHCHECK arguments as argv (JSON form, or shell words)."""
        text = self.args.strip()
        return json.loads(text) if text.startswith("[") else shlex.split(text)


@dataclass
class Stage:
    name: str
    base: str  # the FROM image, ARG defaults substituted
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None

    def env(self) -> dict[str, str]:
        """ENV keys set in this stage (`ENV K=V K2=V2`; values unexpanded)."""
        out = {}
        for inst in self.all("ENV"):
            for word in shlex.split(inst.args):
                key, _, value = word.partition("=")
                out[key] = value
        return out


@dataclass
class Dockerfile:
    stages: list[Stage]

    @classmethod
    def read(cls, path: Path = INFRA / "Dockerfile") -> Dockerfile:
        args: dict[str, str] = {}
        stages: list[Stage] = []
        for inst in _logical_lines(path.read_text()):
            if inst.keyword == "ARG" and not stages:
                name, _, default = inst.args.partition("=")
                args[name.strip()] = default.strip()
            elif inst.keyword == "FROM":
                words = inst.args.split()
                base = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], words[0])
                name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else ""
                stages.append(Stage(name, base))
            else:
                stages[-1].instructions.append(inst)
        return cls(stages)

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def resolve(self, stage: Stage) -> list[Stage]:
        """The stage and the stages it is built FROM, nearest first."""
        chain = [stage]
        names = {s.name for s in self.stages}
        while chain[-1].base in names:
            chain.append(self.stage(chain[-1].base))
        return chain

    @property
    def default(self) -> Stage:
        return self.stages[-1]  # what `docker build` without --target builds


def _logical_lines(text: str) -> list[Instruction]:
    out: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, rest = full.partition(" ")
        out.append(Instruction(keyword.upper(), rest.strip()))
    return out


def systemd_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    current = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = line.strip("[]")
            sections.setdefault(current, [])
            continue
        key, _, value = line.partition("=")
        sections[current].append((key.strip(), value.strip()))
    return sections
