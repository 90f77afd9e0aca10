"""Shared test setup: real backends come from fixture plugins, one per service."""

# engine first: it loads the fast BLAS, which only works before mlx.core is imported.
import engine  # noqa: F401, I001

pytest_plugins = ["tests.fixtures.s3", "tests.fixtures.db", "tests.fixtures.models"]
