"""Fixtures for the kvpack tests: settings on a fresh embedded vault (A = 64), a service
factory and a Python-API vault factory that close what they opened, and settings shared
by two service instances on the embedded default or on S3 + PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from cas.s3 import S3Config
from kvpack import api
from kvpack.config import Settings
from kvpack.service.service import Service
from tests.engine.slotkit import TINY_A


def s3_settings(s3: S3Config) -> dict[str, str | None]:
    """The Settings overrides that reach the S3 server (and prefix) of `s3`."""
    return {
        "store_url": f"s3://{s3.bucket}/{s3.prefix}",
        "s3_endpoint": s3.endpoint_url,
        "s3_region": s3.region,
        "s3_access_key": s3.access_key,
        "s3_secret_key": s3.secret_key,
    }


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


@pytest.fixture
def open_vault() -> Iterator[Callable[..., api.VaultClient]]:
    """kvpack.open(settings=..., **options), closed after the test."""
    opened: list[api.VaultClient] = []

    def make(settings: Settings, **kw) -> api.VaultClient:
        client = api.open(settings=settings, **kw)
        opened.append(client)
        return client

    yield make
    for client in opened:
        client.close()


@pytest.fixture(params=["embedded", pytest.param("s3+postgres", marks=[pytest.mark.s3])])
def shared_settings(request, tmp_path) -> Settings:
    """Settings two service instances share: the embedded default, or S3 + PostgreSQL."""
    if request.param == "embedded":
        return Settings.load(data_dir=tmp_path / "vault", alignment=TINY_A, env={})
    from tests.fixtures.db import DatabaseFactory

    factory = DatabaseFactory("postgres", tmp_path)
    request.addfinalizer(factory.drop_all)
    return Settings.load(
        data_dir=tmp_path / "vault",
        alignment=TINY_A,
        database_url=factory.create(),  # empty: the service migrates it on open
        env={},
        **s3_settings(request.getfixturevalue("s3_config")),
    )


@pytest.fixture(scope="module")
def tiny_service(tmp_path_factory) -> Iterator[Service]:
    """One service on the tiny model for a whole test module (a fresh embedded vault)."""
    from tests.kvpack.serverkit import open_tiny_service

    svc = open_tiny_service(tmp_path_factory.mktemp("vault"))
    yield svc
    svc.close()
