"""The docs point at code that exists: every test and module docs/architecture.md names."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def test_every_test_the_architecture_page_names_exists():
    text = DOC.read_text()
    current = None
    named = []
    for path, name in re.findall(r"`(tests/[\w/]+\.py)?(?:::(\w+))?`", text):
        current = path or current
        if name:
            named.append((current, name))
    assert named
    for path, name in named:
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"{path}::{name}"


def test_every_module_the_architecture_page_names_exists():
    text = DOC.read_text()
    paths = set(re.findall(r"`((?:cas|catalog|engine|kvpack|migrations|tests)/[\w/]*\.py)", text))
    assert paths
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert missing == []
