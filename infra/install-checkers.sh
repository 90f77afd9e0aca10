#!/bin/sh
# Best effort: the Debian packages some tests check with. docker-compose (`docker-compose
# config` validates infra/compose*.yaml; no Docker daemon needed), systemd-analyze
# (`verify` checks infra/kvpack.service), and headless Chromium with its WebDriver (the
# status page test, tests/kvpack/server/test_status.py). Never fails setup; without them
# those tests skip, except under CI=true, where they fail.
command -v apt-get >/dev/null 2>&1 || exit 0
missing=""
command -v docker-compose >/dev/null 2>&1 || missing="$missing docker-compose"
command -v systemd-analyze >/dev/null 2>&1 || missing="$missing systemd"
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
command -v chromedriver >/dev/null 2>&1 || missing="$missing chromium-driver"
[ -n "$missing" ] || exit 0
[ "$(id -u)" = 0 ] || { echo "kvpack: run 'sudo apt-get install$missing' for the checks that need them"; exit 0; }
export DEBIAN_FRONTEND=noninteractive
# shellcheck disable=SC2086  # one word per package
apt-get install -y -qq $missing >/dev/null 2>&1 \
  || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq $missing >/dev/null 2>&1; } \
  || echo "kvpack: could not install$missing; the tests that need them will skip (fail under CI=true)"
