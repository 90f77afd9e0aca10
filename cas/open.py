"""open_object_store(url): one place that turns a store URL into an ObjectStore.

- "file:///abs/dir", "/abs/dir" or a relative path -> LocalDirStore
- "s3://bucket/prefix" -> S3Store; endpoint and credentials from the given
  S3Config, else from AWS_ENDPOINT_URL / AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from urllib.parse import unquote, urlsplit

from cas.local import LocalDirStore
from cas.s3 import S3Config, S3Store
from cas.store import ObjectStore


def open_object_store(url: str, *, s3: S3Config | None = None) -> ObjectStore:
    if not url:
        raise ValueError("object store url is empty")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"object store url {url!r}: file:// urls take no host")
        return LocalDirStore(Path(unquote(parts.path)))
    if scheme == "s3":
        bucket, prefix = parts.netloc, parts.path.lstrip("/")
        if not bucket:
            raise ValueError(f"object store url {url!r} names no bucket (s3://bucket/prefix)")
        if s3 is None:
            return S3Store(S3Config.from_env(bucket, prefix))
        return S3Store(dataclasses.replace(s3, bucket=bucket, prefix=prefix))
    if scheme and len(scheme) > 1:  # "c:" style drive letters are paths, not schemes
        raise ValueError(f"object store url {url!r}: unsupported scheme {scheme!r} (file, s3)")
    return LocalDirStore(Path(url).resolve())
