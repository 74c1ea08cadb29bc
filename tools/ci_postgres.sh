#!/usr/bin/env bash
# CI: PostgreSQL's server binaries for the metadata tests, on a fresh Debian machine as
# root. Idempotent. Nothing is started here: tests/pg_server.py makes its own cluster
# (initdb in a temporary folder), runs it as the unprivileged `postgres` user on a Unix
# socket only (no TCP), and stops it at the end of the session. A cluster the package
# may start for itself is not used.
set -euo pipefail
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
fi
id postgres >/dev/null  # the package's user, which the test cluster runs as
command -v runuser >/dev/null  # util-linux: how root starts it as that user
ls -d /usr/lib/postgresql/*/bin | tail -1
