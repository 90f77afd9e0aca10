#!/bin/sh
# Best effort: a fast BLAS for MLX's CPU backend on Debian/Ubuntu (~35x on
# matmul here). Never fails setup; without it the engine runs, only slower.
[ "$(uname -s)" = Linux ] || exit 0
ls /usr/lib/*/openblas-pthread/libopenblas*.so* >/dev/null 2>&1 && exit 0
command -v apt-get >/dev/null 2>&1 || exit 0
[ "$(id -u)" = 0 ] || { echo "kvpack: run 'sudo apt-get install libopenblas0-pthread' for a fast BLAS"; exit 0; }
apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 \
  || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1; } \
  || echo "kvpack: could not install libopenblas0-pthread; MLX will use its reference BLAS"
