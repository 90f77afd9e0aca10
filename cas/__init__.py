"""cas — bytes: sealed, content-addressed chunks.

Words (see docs/architecture.md):
- chunk: sealed bytes of one block (or one logits plane), stored once and
  named by its content digest.
- chunk id: a keyed BLAKE3 digest of a chunk's plaintext. The key is derived
  per namespace, so equal content dedups inside a namespace and digests reveal
  nothing across namespaces.
- seal: authenticated encryption at rest (cas/seal.py: format 2 is AES-256-GCM under
  a one-time key per chunk; format 1, AES-256-GCM-SIV, still opens); the sealed object
  names the key id that sealed it, so keys can rotate (old keys still open, the current
  seals).
- floor: what the machine needs at least to read, open and hash given chunk sizes
  (cas/floor.py), the yardstick of the benches.
- object store: where sealed objects live, an S3-compatible bucket or a local
  directory. Objects are immutable; writes are put-if-absent.

This package knows nothing of MLX or SQL.
"""
