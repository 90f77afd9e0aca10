#!/bin/sh
# First start only: create an admin key (every namespace) and a tenant key, and print
# each token once, when it is created. The catalog is the record: a key whose label
# `kvpack api-keys list` already shows (revoked ones too) is not created again, so later
# starts print no token. The catalog keeps only hashes: a token not copied from this
# output is gone for good; make another with `kvpack api-keys create`.
#   kvpack-bootstrap-keys [TENANT_NAMESPACE]    (default: default, the server's own)
# The catalog is found as `kvpack serve` finds it (KVPACK_DATABASE_URL, ...).
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
