"""Store URLs: parsed once into a StoreUrl, then opened into an ObjectStore.

- "file:///abs/dir", "/abs/dir" or a relative path -> a local directory (LocalDirStore)
- "s3://bucket/prefix" -> an S3 bucket (S3Store); endpoint and credentials from the
  given S3Config (the settings build it), else from AWS_ENDPOINT_URL /
  AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from cas.local import LocalDirStore
from cas.s3 import S3Config, S3Store
from cas.store import ObjectStore


@dataclass(frozen=True)
class StoreUrl:
    """Where the objects live: a local directory (`path`) or an S3 bucket and prefix."""

    url: str
    path: Path | None = None
    bucket: str | None = None
    prefix: str = ""

    @property
    def is_s3(self) -> bool:
        return self.bucket is not None

    def __str__(self) -> str:
        return self.url


def parse_store_url(url: str) -> StoreUrl:
    """A StoreUrl; ValueError naming the URL when it is unusable."""
    if not url:
        raise ValueError("object store url is empty")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"object store url {url!r}: file:// urls take no host")
        return StoreUrl(url, path=Path(unquote(parts.path)))
    if scheme == "s3":
        bucket, prefix = parts.netloc, parts.path.lstrip("/")
        if not bucket:
            raise ValueError(f"object store url {url!r} names no bucket (s3://bucket/prefix)")
        return StoreUrl(url, bucket=bucket, prefix=prefix)
    if scheme and len(scheme) > 1:  # "c:" style drive letters are paths, not schemes
        raise ValueError(f"object store url {url!r}: unsupported scheme {scheme!r} (file, s3)")
    return StoreUrl(url, path=Path(url).resolve())


def open_object_store(url: str | StoreUrl, *, s3: S3Config | None = None) -> ObjectStore:
    store = url if isinstance(url, StoreUrl) else parse_store_url(url)
    if store.path is not None:
        return LocalDirStore(store.path)
    assert store.bucket is not None
    if s3 is None:
        return S3Store(S3Config.from_env(store.bucket, store.prefix))
    return S3Store(dataclasses.replace(s3, bucket=store.bucket, prefix=store.prefix))
