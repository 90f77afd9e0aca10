"""bench — measuring the product on this machine, with controls and receipts.

- serve.py: `kvpack bench`: cold / warm / miss / durable legs per depth, each on a fresh
  `kvpack serve` process (a restarted one for the durable leg), judged and written as
  receipts.
- store.py: `kvpack bench-store`: chunk-store throughput per backend beside raw
  baselines and the machine's BLAKE3 and AEAD speed.
- seaweedfs.py: a local SeaweedFS S3 server (`weed mini`), for bench-store, the test
  fixtures and users (infra/seaweedfs.sh).
"""
