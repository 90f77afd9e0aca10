"""The floor: what this machine needs, at least, to restore chunks of given sizes.

- floor: for each chunk, a read of its sealed bytes from a file in the page cache into a
  reused buffer, an AES-256-GCM open (tag check and decryption into a second reused
  buffer) and one keyed BLAKE3 of the plaintext — one thread, nothing else: no store, no
  thread hops, no fresh memory. The primitives are seal format 2's (cas/seal.py), the
  bytes random. A restore path's rate divided by the floor's says how much of the
  hardware it reaches (`kvpack bench` and `kvpack bench-store` print that fraction).
- Floor: one measurement — bytes, and the seconds of each step (read, open, hash) in the
  best of `repeats` passes over every chunk.

Scope: warm page cache (the files are written just before they are read), one core.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import blake3
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from cas.seal import TAG_SIZE, ZERO_NONCE


@dataclass(frozen=True)
class Floor:
    bytes: int  # plaintext bytes of all the chunks
    read_s: float
    open_s: float
    hash_s: float

    @property
    def seconds(self) -> float:
        return self.read_s + self.open_s + self.hash_s

    @property
    def rate(self) -> float:
        """Plaintext bytes per second."""
        return self.bytes / self.seconds


def measure_floor(
    sizes: Sequence[int], *, directory: Path | str | None = None, repeats: int = 3
) -> Floor:
    """The floor for chunks of `sizes` plaintext bytes. The sealed files go to a temporary
    directory under `directory` (default: the system's) and are removed afterwards; put it
    on the file system the vault uses."""
    if not sizes or min(sizes) < 0 or sum(sizes) == 0:
        raise ValueError(f"sizes must be sizes >= 0 with some bytes, got {list(sizes)!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    key, digest_key, aad = os.urandom(32), os.urandom(32), b"floor"
    biggest = max(sizes)
    plaintext = memoryview(os.urandom(biggest))
    sealed_buf = memoryview(bytearray(biggest + TAG_SIZE))
    out_buf = memoryview(bytearray(biggest))
    with tempfile.TemporaryDirectory(prefix="kvpack-floor-", dir=directory) as tmp:
        paths = []
        for i, size in enumerate(sizes):
            path = Path(tmp) / f"chunk-{i}"
            path.write_bytes(AESGCM(key).encrypt(ZERO_NONCE, plaintext[:size], aad))
            paths.append(path)
        best: Floor | None = None
        for _ in range(repeats):
            read_s = open_s = hash_s = 0.0
            for path, size in zip(paths, sizes, strict=True):
                sealed, out = sealed_buf[: size + TAG_SIZE], out_buf[:size]
                t0 = time.perf_counter()
                with open(path, "rb", buffering=0) as f:
                    n = f.readinto(sealed)
                t1 = time.perf_counter()
                AESGCM(key).decrypt_into(ZERO_NONCE, sealed[:n], aad, out)
                t2 = time.perf_counter()
                blake3.blake3(out, key=digest_key).digest()
                t3 = time.perf_counter()
                read_s, open_s, hash_s = read_s + t1 - t0, open_s + t2 - t1, hash_s + t3 - t2
            floor = Floor(sum(sizes), read_s, open_s, hash_s)
            if best is None or floor.seconds < best.seconds:
                best = floor
    assert best is not None
    return best
