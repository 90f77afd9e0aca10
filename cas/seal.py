"""The chunk seal: authenticated encryption at rest, at memory speed.

Words:
- seal key: a vault key that seals chunks, named by its key id (the keyring's current
  key seals; every key in the ring still opens what it sealed).
- header: magic "KVPC" | format version u8 | key id length u8 | key id. It is bound as
  associated data (AAD) together with the chunk id in both formats.
- chunk key (format 2): the one-time AES-256 key of one sealed chunk,
      K = BLAKE3-keyed(KDF key, header | chunk id)
  where the KDF key is Keyring.subkey("chunk-seal-v2", key id): HKDF-separated from
  every other use of the seal key, format 1's key included.

Sealed chunk, format version 2 (what `seal` writes):

    header | ciphertext | tag (16)       AES-256-GCM under K, nonce 12 zero bytes,
                                          AAD = header | chunk id

Sealed chunk, format version 1 (still opens; nothing seals it any more):

    header | nonce (12) = chunk id[:12] | ciphertext | tag (16)
                                          AES-256-GCM-SIV under Keyring.subkey("chunk-seal",
                                          key id), AAD = header | chunk id

Why format 2 never repeats a key/nonce pair. The nonce is a constant, so the claim is
that one chunk key never encrypts two different (plaintext, AAD) pairs. K is a PRF
(keyed BLAKE3 under a 256-bit vault secret) of exactly the AAD, header | chunk id, so
two seals share a key only if they share the header and the chunk id (or two different
inputs collide in 256 bits: about n^2 / 2^257 over n chunks ever sealed). The chunk id
is the namespace-keyed BLAKE3 of the plaintext (cas/ids.py), so a shared id means the
same plaintext (short of the same 256-bit collision bound, across namespaces too).
Sealing is deterministic, so equal plaintext seals to equal bytes and dedups. The id is
computed from the very bytes sealed — by ChunkStore.put, or by its caller from the same
immutable buffer (catalog/publish.py) — and even a caller that paired an id with other
bytes could not put two ciphertexts under one key at rest: a chunk's object key is its
id and writes are put-if-absent, and opening re-hashes the plaintext against the id.
Each K encrypts one message, so GCM's per-key limits (2^32 messages, 64 GiB each) are
never approached; AES-256, not AES-128, because every chunk key shares the nonce and a
key search against N targets at once costs 2^256 / N.

What opening refuses (ChunkCorrupt unless said otherwise; nothing is returned):
- a flipped byte: in the magic or version, "bad magic" / "unsupported version" (a
  format 2 chunk relabelled format 1 would open under format 1's key, which never sealed
  it: nonce or tag); in the key id, UnknownKey or a failed tag (another K and AAD); in
  the ciphertext or the tag, a failed tag;
- truncation or padding: the plaintext size the object implies differs from the size
  the caller expects (the manifest's), or it is shorter than a header and a tag;
- a chunk relabelled to another id (stored or opened under another chunk's name):
  format 2 derives another K and binds the id as AAD, so the tag fails; format 1 checks
  the nonce against the id, and the tag binds the id;
- a chunk sealed under another vault's key, or under another key id of this vault:
  another K (format 2) or key (format 1), so the tag fails; a key id this ring lacks is
  UnknownKey;
- a chunk validly sealed by a key holder over other plaintext: the tag verifies, the
  re-hash against the chunk id does not.

Opening into segments (open_into with a list of buffers, or an Opening fed run by run as
the sealed bytes land: cas/trail.py) decrypts format 2 as a stream: plaintext reaches
the caller's buffers before the tag is checked at the end, so on any error those buffers
hold garbage; the caller uses nothing until open_into (Opening.finish) returns.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from functools import partial

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, AESGCMSIV

from cas.buffers import scatter
from cas.errors import ChunkCorrupt
from cas.ids import ChunkId
from cas.keys import Keyring
from cas.lanes import Lane, Lanes

PURPOSE = "chunk-seal-v2"  # the KDF key of format 2's chunk keys
PURPOSE_V1 = "chunk-seal"  # format 1's GCM-SIV key
MAGIC = b"KVPC"
VERSION = 2
VERSION_V1 = 1
VERSIONS = (VERSION_V1, VERSION)
NONCE_SIZE = 12  # format 1 stores it; format 2's is the constant ZERO_NONCE
ZERO_NONCE = bytes(NONCE_SIZE)
# A chunk this large hashes on a lane behind its decryption (cas/lanes.py); a smaller
# one is over before a hand-off would pay.
LANE_MIN = 1 << 20
RUN = 1 << 20  # bytes opened at a time at most: few GIL hand-offs, still in the cache
RING = 2  # run buffers per thread: a lane hashes one while the opener fills the other
# Runs start at multiples of this in the stream: BLAKE3 hashes many of its 1 KiB chunks
# at once only in subtrees aligned to their size, so updates from unaligned offsets are
# slow (a demo block hashed segment by segment, 1,472 + k x 64 KiB: 3.3 ms, against 1.7
# ms in one buffer; aligned 64 KiB runs 2.1 ms, 256 KiB to 1 MiB 1.9 ms).
ALIGN = 64 << 10
TAG_SIZE = 16
MAX_KEY_ID = 64
MAX_OVERHEAD = len(MAGIC) + 2 + MAX_KEY_ID + NONCE_SIZE + TAG_SIZE
HEADER_MAX = MAX_OVERHEAD - TAG_SIZE  # the most bytes before any ciphertext


def header(key_id: str, *, version: int = VERSION) -> bytes:
    kid = key_id.encode()
    if not 1 <= len(kid) <= MAX_KEY_ID:
        raise ValueError(f"key id must be 1..{MAX_KEY_ID} bytes, got {key_id!r}")
    if version not in VERSIONS:
        raise ValueError(f"seal format version must be one of {VERSIONS}, got {version}")
    return MAGIC + bytes((version, len(kid))) + kid


def sealed_size(size: int, key_id: str, *, version: int = VERSION) -> int:
    """Bytes of a sealed chunk whose plaintext has `size` bytes."""
    nonce = NONCE_SIZE if version == VERSION_V1 else 0
    return len(header(key_id, version=version)) + nonce + size + TAG_SIZE


def plausible_sizes(size: int, key_ids: list[str] | tuple[str, ...]) -> frozenset[int]:
    """Every size a sealed chunk of `size` plaintext bytes can have under these key ids, in
    any format that still opens (a vault keeps v1 chunks sealed before the upgrade)."""
    return frozenset(sealed_size(size, k, version=v) for k in key_ids for v in VERSIONS)


def max_sealed_size(size: int) -> int:
    """An upper bound for any key id and format: what to allocate before reading a chunk."""
    return size + MAX_OVERHEAD


class ChunkSeal:
    """Seals (format 2) and opens (formats 1 and 2) chunks with a keyring's subkeys."""

    def __init__(self, keyring: Keyring) -> None:
        self.keyring = keyring
        self._v1: dict[str, AESGCMSIV] = {}

    def _chunk_key(self, key_id: str | None, head: bytes, chunk_id: ChunkId) -> bytes:
        _, kdf_key = self.keyring.subkey(PURPOSE, key_id)  # UnknownKey
        return blake3.blake3(head + chunk_id.raw, key=kdf_key).digest()

    def _chunk_aead(self, key_id: str | None, head: bytes, chunk_id: ChunkId) -> AESGCM:
        return AESGCM(self._chunk_key(key_id, head, chunk_id))

    def _v1_aead(self, key_id: str) -> AESGCMSIV:
        if key_id not in self._v1:
            self._v1[key_id] = AESGCMSIV(self.keyring.subkey(PURPOSE_V1, key_id)[1])
        return self._v1[key_id]

    def seal(self, chunk_id: ChunkId, plaintext: bytes | bytearray | memoryview) -> bytearray:
        """Seal under the current key, format 2. `chunk_id` must be the plaintext's id."""
        head = header(self.keyring.current)
        aead = self._chunk_aead(None, head, chunk_id)
        out = bytearray(len(head) + len(plaintext) + TAG_SIZE)
        out[: len(head)] = head
        aead.encrypt_into(ZERO_NONCE, plaintext, head + chunk_id.raw, memoryview(out)[len(head) :])
        return out

    def verify(
        self,
        chunk_id: ChunkId,
        sealed: bytes | bytearray | memoryview,
        plaintext: bytes | bytearray | memoryview,
    ) -> None:
        """Check that `sealed` opens to exactly `plaintext` (our own output, before it is
        trusted and uploaded): tag and bytes, without digesting the plaintext again."""
        out = bytearray(self.plaintext_size(chunk_id, sealed))
        try:
            self._decrypt(chunk_id, memoryview(sealed), memoryview(out))
        except ChunkCorrupt:
            raise ChunkCorrupt(chunk_id, "our own seal does not verify") from None
        if out != plaintext:  # bytearray == buffer is one memcmp
            raise ChunkCorrupt(chunk_id, "our own seal does not open to its plaintext")

    def plaintext_size(self, chunk_id: ChunkId, sealed: bytes | bytearray | memoryview) -> int:
        """Size the sealed chunk claims for its plaintext (after checking the header)."""
        start, _head, _key_id, _version = _parse(chunk_id, sealed)
        return len(sealed) - start - TAG_SIZE

    def open_into(
        self,
        chunk_id: ChunkId,
        sealed: bytes | bytearray | memoryview,
        out: memoryview | Sequence[memoryview],
        *,
        digest_key: bytes,
        lanes: Lanes | None = None,
    ) -> None:
        """Verify and decrypt into `out`, then hash the plaintext once against the id.
        `out` is one buffer of exactly the plaintext size, or segments (writable buffers
        whose sizes add up to it) that the plaintext fills in order, so it can land straight
        where its pieces belong: then format 2 opens as a stream (Opening), and `lanes`
        may lend the hash a thread. `sealed` is only read. ChunkCorrupt, UnknownKey. On
        error `out` holds garbage and must not be used."""
        sealed = memoryview(sealed)
        if isinstance(out, memoryview):
            self._decrypt(chunk_id, sealed, out)
            # One thread: get_many opens chunks in parallel, which beats a threaded hash here.
            _check(chunk_id, blake3.blake3(out, key=digest_key).digest())
        else:
            self._open_segments(chunk_id, sealed, out, digest_key, lanes)

    def open(
        self, chunk_id: ChunkId, sealed: bytes | bytearray | memoryview, *, digest_key: bytes
    ) -> bytes:
        out = bytearray(self.plaintext_size(chunk_id, sealed))
        self.open_into(chunk_id, sealed, memoryview(out), digest_key=digest_key)
        return bytes(out)

    def _decrypt(self, chunk_id: ChunkId, sealed: memoryview, out: memoryview) -> None:
        start, head, key_id, version = _sized(chunk_id, sealed, out.nbytes)
        aad = head + chunk_id.raw
        try:
            if version == VERSION:
                aead = self._chunk_aead(key_id, head, chunk_id)
                aead.decrypt_into(ZERO_NONCE, sealed[start:], aad, out)
            else:
                nonce = bytes(sealed[start - NONCE_SIZE : start])
                self._v1_aead(key_id).decrypt_into(nonce, sealed[start:], aad, out)
        except InvalidTag:
            raise ChunkCorrupt(chunk_id, "seal tag does not verify") from None

    def _open_segments(
        self,
        chunk_id: ChunkId,
        sealed: memoryview,
        segments: Sequence[memoryview],
        key: bytes,
        lanes: Lanes | None,
    ) -> None:
        opening = self.opening(chunk_id, sealed, segments, digest_key=key, lanes=lanes)
        if opening is None:  # GCM-SIV cannot stream: open whole, then scatter
            segments = [memoryview(s).cast("B") for s in segments]
            whole = memoryview(bytearray(sum(s.nbytes for s in segments)))
            self._decrypt(chunk_id, sealed, whole)
            scatter(whole, segments)
            _check(chunk_id, blake3.blake3(whole, key=key).digest())
            return
        opening.finish()

    def opening(
        self,
        chunk_id: ChunkId,
        sealed: memoryview,
        segments: Sequence[memoryview],
        *,
        digest_key: bytes,
        lanes: Lanes | None = None,
    ) -> Opening | None:
        """A format 2 chunk opened into `segments` as its bytes land in `sealed` (the
        whole object's buffer; at least its header, HEADER_MAX bytes, has landed); None
        for format 1, which opens only whole. ChunkCorrupt (a malformed header, a size
        that is not the segments'), UnknownKey."""
        segments = [memoryview(s).cast("B") for s in segments]
        size = sum(s.nbytes for s in segments)
        start, head, key_id, version = _sized(chunk_id, sealed, size)
        if version == VERSION_V1:
            return None
        chunk_key = self._chunk_key(key_id, head, chunk_id)
        return Opening(chunk_id, sealed, segments, start, chunk_key, head, digest_key, lanes)


class Opening:
    """One format 2 chunk opened in stream order, run by run as its sealed bytes land in
    `sealed` (`advance`): each run (at most RUN bytes, starting at a multiple of ALIGN in
    the stream) that one segment holds whole is decrypted into it and hashed there; any
    other is decrypted into a run buffer of the opening thread's (reused chunk after
    chunk, so it is in the cache; cryptography refuses, from 51, to decrypt a run onto
    itself), hashed there and copied into the segments it belongs in. A block's frame
    lands in one segment per head and layer (64 KiB for the demo model) but where the
    engine lays it in one buffer (a one-block cut that fills its capacity): then every
    run past the first lands in place. A 256-token restore of the demo model, its block
    laid in one buffer and opened in place, against one through run buffers (Intel Xeon
    VM, `restore_phases.py`'s restore in one process, alternating, 150 each way, two
    runs): 4.98 and 5.36 ms against 7.02 and 7.32 ms at the median. `finish`
    opens what is left — hashing those runs on a lane of `lanes` where one is free
    (cas/lanes.py), the read being over — then checks the tag and the digest. `sealed`
    is only read. Until finish returns, the segments hold garbage. Used by one thread at
    a time."""

    def __init__(
        self,
        chunk_id: ChunkId,
        sealed: memoryview,
        segments: list[memoryview],
        start: int,
        chunk_key: bytes,
        head: bytes,
        digest_key: bytes,
        lanes: Lanes | None = None,
    ) -> None:
        self.chunk_id, self._sealed, self._segments = chunk_id, sealed, segments
        self._start = self.pos = start  # pos: the next sealed byte to open
        self._end = len(sealed) - TAG_SIZE
        self._at = (0, 0)  # (segment, offset in it) of the next plaintext byte
        self._hasher = blake3.blake3(key=digest_key)
        self._stream = Cipher(algorithms.AES(chunk_key), modes.GCM(ZERO_NONCE)).decryptor()
        self._stream.authenticate_additional_data(head + chunk_id.raw)
        self._lanes = lanes

    def advance(self, landed: int) -> None:
        """Open the runs that have landed whole before offset `landed` (all of the rest
        once `landed` reaches the tag), hashed inline."""
        self._open(self._run_end(landed), None)

    def finish(self) -> None:
        """Open the rest (the whole object has landed), then check the tag and the
        plaintext's digest; ChunkCorrupt when either fails."""
        lanes = self._lanes if self._end - self.pos >= LANE_MIN else None
        lane = lanes.take() if lanes is not None else None
        drained = False  # a lane given back with runs still to hash is retired
        try:
            self._open(self._end, lane)
            try:
                self._stream.finalize_with_tag(bytes(self._sealed[self._end :]))
            except InvalidTag:
                raise ChunkCorrupt(self.chunk_id, "seal tag does not verify") from None
            if lane is not None:
                lane.drained()  # raises what hashing raised
                drained = True
        finally:
            if lanes is not None and lane is not None:
                lanes.give(lane, drained=drained)
        _check(self.chunk_id, self._hasher.digest())

    def _run_end(self, landed: int) -> int:
        upto = min(landed, self._end)
        return upto if upto == self._end else self._start + (upto - self._start) // ALIGN * ALIGN

    def _open(self, upto: int, lane: Lane | None) -> None:
        free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()  # run buffers not in use
        for buffer in _run_buffers():
            free.put(buffer)
        while self.pos < upto:
            n = min(RUN, upto - self.pos)
            sealed = self._sealed[self.pos : self.pos + n]
            place = self._place(n)
            if place is not None:  # decrypted where it belongs and hashed there: no copy
                self._stream.update_into(sealed, place)
                self._hash(place, lane, None)
            else:
                buffer = free.get()
                run = buffer[:n]
                self._stream.update_into(sealed, run)
                self._hash(run, lane, partial(free.put, buffer))
                self._scatter(run)
            self.pos += n

    def _hash(
        self, run: memoryview, lane: Lane | None, release: Callable[[], object] | None
    ) -> None:
        """Hash `run` on the lane, or here; then `release()` (the lane is done with it)."""
        if lane is not None:
            lane.hash(self._hasher, run, release=release)
            return
        self._hasher.update(run)
        if release is not None:
            release()

    def _place(self, n: int) -> memoryview | None:
        """Where the next `n` plaintext bytes belong when one segment holds them all (the
        position moved past them), else None."""
        i, off = self._at
        while i < len(self._segments) and off == self._segments[i].nbytes:
            i, off = i + 1, 0
        if i == len(self._segments) or off + n > self._segments[i].nbytes:
            return None
        self._at = (i, off + n)
        return self._segments[i][off : off + n]

    def _scatter(self, run: memoryview) -> None:
        """Copy an opened run into the segments, from where the last one ended."""
        i, off, k = *self._at, 0
        while k < run.nbytes:
            seg = self._segments[i]
            n = min(run.nbytes - k, seg.nbytes - off)
            seg[off : off + n] = run[k : k + n]
            k, off = k + n, off + n
            if off == seg.nbytes:
                i, off = i + 1, 0
        self._at = (i, off)


_local = threading.local()


def _run_buffers() -> list[memoryview]:
    """This thread's RING buffers of RUN bytes that runs are opened into. A lane retired
    with runs still queued (its chunk failed) may read them after the next chunk reuses
    them; what it hashes then goes into a hasher no one reads."""
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = [memoryview(bytearray(RUN)) for _ in range(RING)]
    return buffers


def _check(chunk_id: ChunkId, digest: bytes) -> None:
    if digest != chunk_id.raw:
        raise ChunkCorrupt(chunk_id, "plaintext does not hash to the chunk id")


def _parse(
    chunk_id: ChunkId, sealed: bytes | bytearray | memoryview
) -> tuple[int, bytes, str, int]:
    """(offset of the ciphertext, header bytes, key id, format version); ChunkCorrupt on a
    malformed header."""
    m = len(MAGIC)
    if len(sealed) < m + 2 or bytes(sealed[:m]) != MAGIC:
        raise ChunkCorrupt(chunk_id, "not a sealed chunk (bad magic)")
    version, kid_len = sealed[m], sealed[m + 1]
    if version not in VERSIONS:
        raise ChunkCorrupt(chunk_id, f"unsupported seal format version {version}")
    end = m + 2 + kid_len
    start = end + (NONCE_SIZE if version == VERSION_V1 else 0)
    if kid_len == 0 or len(sealed) < start + TAG_SIZE:
        raise ChunkCorrupt(chunk_id, f"truncated: {len(sealed)} bytes")
    try:
        key_id = bytes(sealed[m + 2 : end]).decode()
    except UnicodeDecodeError:
        raise ChunkCorrupt(chunk_id, "key id is not text") from None
    if version == VERSION_V1 and bytes(sealed[end:start]) != chunk_id.raw[:NONCE_SIZE]:
        raise ChunkCorrupt(chunk_id, "nonce does not belong to the chunk id")
    return start, bytes(sealed[:end]), key_id, version


def _sized(chunk_id: ChunkId, sealed: memoryview, size: int) -> tuple[int, bytes, str, int]:
    """_parse, and ChunkCorrupt unless the plaintext is `size` bytes."""
    start, head, key_id, version = _parse(chunk_id, sealed)
    held = len(sealed) - start - TAG_SIZE
    if held != size:
        raise ChunkCorrupt(chunk_id, f"holds {held} plaintext bytes, expected {size}")
    return start, head, key_id, version
