#!/bin/sh
# Best effort: headless Chromium and its WebDriver for the status page's browser test
# (tests/kvpack/server/test_status.py). Never fails setup; without them that test skips
# (and fails under CI=true, where it must run).
command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 && exit 0
[ "$(uname -s)" = Linux ] || { echo "kvpack: install Chromium and chromedriver for the browser test"; exit 0; }
command -v apt-get >/dev/null 2>&1 || exit 0
[ "$(id -u)" = 0 ] || { echo "kvpack: run 'sudo apt-get install chromium chromium-driver' for the browser test"; exit 0; }
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 \
  || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1; } \
  || echo "kvpack: could not install chromium and chromium-driver; the browser test will skip"
