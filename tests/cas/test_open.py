"""open_object_store(url) and S3Config: URL forms, env fallback, and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from cas.local import LocalDirStore
from cas.open import open_object_store
from cas.s3 import S3Config, S3Store


def test_file_urls_and_paths_open_a_local_store(tmp_path, monkeypatch):
    """file:///abs, /abs and relative paths all give a LocalDirStore rooted there."""
    for url in (f"file://{tmp_path}", str(tmp_path)):
        store = open_object_store(url)
        assert isinstance(store, LocalDirStore) and store.root == tmp_path
    monkeypatch.chdir(tmp_path)
    assert open_object_store("rel/dir").root == tmp_path / "rel" / "dir"


def test_s3_url_takes_endpoint_from_config(tmp_path):
    """s3://bucket/prefix keeps the given S3Config's endpoint and credentials."""
    base = S3Config(bucket="ignored", endpoint_url="http://h:1", access_key="a", secret_key="s")
    store = open_object_store("s3://vault/kv/prefix", s3=base)
    assert isinstance(store, S3Store)
    c = store.config
    assert (c.bucket, c.key_prefix, c.endpoint_url, c.access_key) == (
        "vault",
        "kv/prefix/",
        "http://h:1",
        "a",
    )


def test_s3_url_takes_endpoint_from_env(monkeypatch):
    """Without an S3Config, AWS_ENDPOINT_URL / AWS_ACCESS_KEY_ID / ... fill it in."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ak")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sk")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    c = open_object_store("s3://b").config
    assert (c.bucket, c.key_prefix, c.endpoint_url, c.access_key, c.secret_key, c.region) == (
        "b",
        "",
        "http://127.0.0.1:9",
        "ak",
        "sk",
        "eu-west-1",
    )


@pytest.mark.parametrize("url", ["", "s3://", "s3:///prefix", "gs://b/p", "file://host/x"])
def test_bad_urls_are_refused(url):
    """Unusable urls raise ValueError naming the url."""
    with pytest.raises(ValueError):
        open_object_store(url)


def test_local_store_root_is_a_path():
    """LocalDirStore accepts str or Path."""
    assert LocalDirStore("/tmp/x").root == Path("/tmp/x")


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"bucket": ""}, "bucket"),
        ({"bucket": "a/b"}, "bucket"),
        ({"bucket": "b", "prefix": "/p"}, "prefix"),
        ({"bucket": "b", "max_concurrency": 0}, "max_concurrency"),
        ({"bucket": "b", "max_attempts": 0}, "max_attempts"),
        ({"bucket": "b", "access_key": "a"}, "secret_key"),
    ],
)
def test_config_validation(kwargs, word):
    """Bad S3Config fields raise ValueError naming the field."""
    with pytest.raises(ValueError, match=word):
        S3Config(**kwargs)
