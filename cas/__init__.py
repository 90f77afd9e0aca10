"""cas — bytes: sealed, content-addressed chunks.

Words (see DESIGN.md):
- chunk: sealed bytes of one block (or one logits plane), stored once and
  named by its content digest.
- chunk id: a keyed BLAKE3 digest of a chunk's plaintext. The key is derived
  per namespace, so equal content dedups inside a namespace and digests reveal
  nothing across namespaces.
- seal: authenticated encryption at rest; the sealed object names the key id
  that sealed it, so keys can rotate (old keys still open, the current seals).
- object store: where sealed objects live, an S3-compatible bucket or a local
  directory. Objects are immutable; writes are put-if-absent.

This package knows nothing of MLX or SQL.
"""
