#!/bin/sh
# Best effort: the tools tests/infra checks infra/ with, from Debian's packages:
# docker-compose (`docker-compose config` validates infra/compose.yaml; no Docker daemon
# needed) and systemd-analyze (`verify` checks infra/kvpack.service). Never fails setup;
# without them those tests skip, except under CI=true, where they fail.
command -v apt-get >/dev/null 2>&1 || exit 0
missing=""
command -v docker-compose >/dev/null 2>&1 || missing="$missing docker-compose"
command -v systemd-analyze >/dev/null 2>&1 || missing="$missing systemd"
[ -n "$missing" ] || exit 0
[ "$(id -u)" = 0 ] || { echo "kvpack: run 'sudo apt-get install$missing' for the infra checks"; exit 0; }
# shellcheck disable=SC2086  # one word per package
apt-get install -y -qq $missing >/dev/null 2>&1 \
  || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq $missing >/dev/null 2>&1; } \
  || echo "kvpack: could not install$missing; the infra checks that need them will skip (fail under CI=true)"
