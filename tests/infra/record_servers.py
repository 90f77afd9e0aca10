"""A pytest plugin: `-p tests.infra.record_servers --record-servers=FILE` appends, as JSON
lines, the S3 server and the PostgreSQL server the fixtures (tests/fixtures/) set up,
so a test that runs a suite in a subprocess can tell which servers that suite used."""

from __future__ import annotations

import json

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-servers", metavar="FILE", help="append the servers used here")


def _describe(name: str, value: object) -> dict | None:
    if name == "s3_server":
        return {"s3_endpoint": value.endpoint_url}  # type: ignore[attr-defined]
    if name == "db_factory" and value.backend == "postgres":  # type: ignore[attr-defined]
        return {"pg_url": value.pg_base.render_as_string(hide_password=True)}  # type: ignore[attr-defined]
    return None


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    value = yield
    path = request.config.getoption("record_servers")
    if path and (record := _describe(fixturedef.argname, value)):
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    return value
