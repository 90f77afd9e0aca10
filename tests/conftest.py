"""Shared test setup: real backends come from fixture plugins, one per service."""

pytest_plugins = ["tests.fixtures.s3", "tests.fixtures.db"]
