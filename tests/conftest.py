"""Shared test setup: real backends come from fixture plugins, one per service."""

# engine first: it loads the fast BLAS, which only works before mlx.core is imported.
import engine  # noqa: F401, I001
import pytest

pytest_plugins = ["tests.fixtures.s3", "tests.fixtures.db", "tests.fixtures.models"]


@pytest.fixture
def digest_calls(monkeypatch) -> list[int]:
    """Every keyed chunk digest computed while the test runs (the size of what it
    hashed), for tests that count how often bytes are hashed."""
    from cas.ids import ChunkId

    calls: list[int] = []
    real = ChunkId.of.__func__  # type: ignore[attr-defined]

    def counting(cls, data, *, key):
        calls.append(len(data))
        return real(cls, data, key=key)

    monkeypatch.setattr(ChunkId, "of", classmethod(counting))
    return calls
