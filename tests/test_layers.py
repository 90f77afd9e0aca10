"""The layers point one way (docs/architecture.md, "Layers"), read from the code's own imports.

Every import statement counts — at module level, inside functions and under
TYPE_CHECKING alike — because each is a dependency someone reading the code must
follow. The rules:
- cas/ and catalog/ import nothing from engine/ or kvpack/ (catalog may use cas);
- engine/ imports nothing from cas/, catalog/, kvpack/, SQLAlchemy or boto;
- migrations/ imports only catalog/ among ours;
- kvpack/ never imports the engine's codec (engine.codec, engine.restore): it hands
  bytes to the engine through engine.state and Slot.export / Slot.restore;
- the library never imports the command line (kvpack.commands, kvpack.cli);
- there is no import cycle between modules.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cas", "catalog", "engine", "kvpack", "migrations")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports (absolute names; `from x import y` counts x and x.y)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def graph() -> dict[str, set[str]]:
    """Our modules -> the modules of ours they import."""
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    ours = {module_name(p) for p in files}
    edges: dict[str, set[str]] = defaultdict(set)
    for p in files:
        name = module_name(p)
        edges[name] = {m for m in imports_of(p) if m in ours and m != name}
    return edges


def all_imports() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def top(module: str) -> str:
    return module.split(".", 1)[0]


FORBIDDEN = {
    "cas": {"catalog", "engine", "kvpack", "migrations"},
    "catalog": {"engine", "kvpack", "migrations"},
    "engine": {"cas", "catalog", "kvpack", "migrations", "sqlalchemy", "boto3", "botocore",
               "aiobotocore", "alembic"},
    "migrations": {"cas", "engine", "kvpack"},
}  # fmt: skip


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_lower_layers_import_nothing_above_them(layer):
    bad = {
        module: sorted(m for m in imported if top(m) in FORBIDDEN[layer])
        for module, imported in all_imports().items()
        if top(module) == layer
    }
    assert {m: v for m, v in bad.items() if v} == {}


def test_kvpack_hands_bytes_to_the_engine_and_never_touches_its_codec():
    bad = {
        module: sorted(
            m for m in imported if m.startswith(("engine.codec", "engine.restore", "engine.planes"))
        )
        for module, imported in all_imports().items()
        if top(module) == "kvpack"
    }
    assert {m: v for m, v in bad.items() if v} == {}


def test_the_library_never_imports_the_command_line():
    bad = {
        module: sorted(m for m in imported if m.startswith(("kvpack.commands", "kvpack.cli")))
        for module, imported in all_imports().items()
        if top(module) == "kvpack" and not module.startswith(("kvpack.commands", "kvpack.cli"))
    }
    assert {m: v for m, v in bad.items() if v} == {}


def test_there_is_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == []
