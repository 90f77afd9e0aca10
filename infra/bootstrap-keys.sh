#!/bin/sh
# First start only: create an admin key (every namespace) and a tenant key, and print
# each token once, when it is created. The catalog is the record: a key whose label
# `kvpack api-keys list` already shows (revoked ones too) is not created again, so later
# starts print no token. The catalog keeps only hashes: a token not copied from this
# output is gone for good; make another with `kvpack api-keys create`.
#   kvpack-bootstrap-keys [TENANT_NAMESPACE]    (default: default, the server's own)
# The catalog is found as `kvpack serve` finds it (KVPACK_DATABASE_URL, ...).
# With KVPACK_METRICS_KEY_FILE set, an admin key for Prometheus is also written to that
# file (never printed) whenever the file does not exist, e.g. on a fresh volume.
set -eu
tenant_namespace=${1:-default}
listed=$(kvpack api-keys list)

bootstrap() {  # role namespace label
  if printf '%s\n' "$listed" | grep -q -- "  $3\$"; then
    echo "kvpack-bootstrap-keys: the $1 key '$3' exists already; its token is not shown again" >&2
    return
  fi
  token=$(kvpack api-keys create --role "$1" --namespace "$2" --label "$3")
  printf '%s key (namespace %s): %s\n' "$1" "$2" "$token"
}

bootstrap admin '*' compose-admin
bootstrap tenant "$tenant_namespace" compose-tenant

if [ -n "${KVPACK_METRICS_KEY_FILE:-}" ] && [ ! -s "$KVPACK_METRICS_KEY_FILE" ]; then
  # 0644: Prometheus runs as its own user; only it and this step mount the volume.
  kvpack api-keys create --role admin --namespace '*' --label "compose-metrics-$(date -u +%Y%m%dT%H%M%SZ)" \
    > "$KVPACK_METRICS_KEY_FILE.new"
  chmod 0644 "$KVPACK_METRICS_KEY_FILE.new"
  mv "$KVPACK_METRICS_KEY_FILE.new" "$KVPACK_METRICS_KEY_FILE"
  echo "kvpack-bootstrap-keys: a metrics admin key is in $KVPACK_METRICS_KEY_FILE" >&2
fi
