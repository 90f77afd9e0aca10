"""Fixtures for the service tests: settings on a fresh embedded vault (A = 64) and a
service factory that closes what it opened."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvpack.config import Settings
from kvpack.service import Service
from tests.engine.slotkit import TINY_A


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings.load(data_dir=tmp_path / "vault", alignment=TINY_A, env={})


@pytest.fixture
def open_service() -> Iterator[Callable[..., Service]]:
    opened: list[Service] = []

    def make(settings: Settings, **kw) -> Service:
        svc = Service.open(settings, model="tiny", **kw)
        opened.append(svc)
        return svc

    yield make
    for svc in opened:
        svc.close()
