#!/bin/sh
# Entrypoint of the replicas' store image (deploy/replicas/build-images.sh: Debian's postgresql-15, no registry).
# The environment is the official postgres image's, so that PTC_POSTGRES_IMAGE=postgres:15 works unchanged:
#   POSTGRES_PASSWORD  required on the first start: the password of POSTGRES_USER (hex or URL-safe: no quote)
#   POSTGRES_USER      the service's role, owner of POSTGRES_DB (default ptc)
#   POSTGRES_DB        the database (default: POSTGRES_USER)
#   PGDATA             the data directory (default /var/lib/postgresql/data; a bind mount keeps it)
#
#   postgres-entrypoint.sh postgres [-c name=value ...]   initdb when PGDATA is empty, then run the server
#   postgres-entrypoint.sh OTHER...                        run OTHER (pg_isready, psql, sh)
#
# Started as root: it gives PGDATA to the postgres user (CHOWN, FOWNER), then drops to that user (SETUID, SETGID) with
# setpriv for initdb and the server; the server never runs as root. The first start makes the cluster with
# scram-sha-256 for TCP (pg_hba: loopback only, initdb's default), peer for local sockets, the superuser
# "postgres" without a password (so it cannot log in over TCP), and the role POSTGRES_USER (LOGIN, no
# superuser) owning POSTGRES_DB. Later starts find PG_VERSION and only run the server.
set -eu

export PGDATA="${PGDATA:-/var/lib/postgresql/data}"
bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
export PATH="$bin:$PATH"

if [ "${1:-}" != postgres ]; then exec "$@"; fi
shift

as_postgres() { if [ "$(id -u)" = 0 ]; then setpriv --reuid=postgres --regid=postgres --init-groups -- "$@"; else "$@"; fi; }

if [ "$(id -u)" = 0 ]; then
  # Root without DAC_OVERRIDE: chmod before chown (then FOWNER covers a PGDATA already the postgres user's).
  mkdir -p "$PGDATA"
  chmod 0700 "$PGDATA"
  chown postgres:postgres "$PGDATA"
fi

# Tested as postgres: root without DAC_READ_SEARCH cannot look into the 0700 directory.
if ! as_postgres test -s "$PGDATA/PG_VERSION"; then
  user=${POSTGRES_USER:-ptc}
  db=${POSTGRES_DB:-$user}
  password=${POSTGRES_PASSWORD:-}
  if [ -z "$password" ]; then echo "postgres-entrypoint: POSTGRES_PASSWORD is required on the first start" >&2; exit 2; fi
  case "$password$user$db" in
    *"'"* | *'"'* | *'\'*) echo "postgres-entrypoint: no quote or backslash in POSTGRES_PASSWORD, _USER, _DB" >&2; exit 2 ;;
  esac
  echo "postgres-entrypoint: first start: initdb in $PGDATA (role $user, database $db)" >&2
  as_postgres initdb --username=postgres --auth-local=peer --auth-host=scram-sha-256 --encoding=UTF8 \
    --locale=C.UTF-8 -D "$PGDATA" >/dev/null
  # Single-user mode: no server, no socket, no port while the role and database are made (one statement a line).
  printf '%s\n' "CREATE ROLE \"$user\" LOGIN PASSWORD '$password';" |
    as_postgres postgres --single -D "$PGDATA" postgres >/dev/null
  printf '%s\n' "CREATE DATABASE \"$db\" OWNER \"$user\";" |
    as_postgres postgres --single -D "$PGDATA" postgres >/dev/null
fi

exec_postgres() { if [ "$(id -u)" = 0 ]; then exec setpriv --reuid=postgres --regid=postgres --init-groups -- postgres "$@"; else exec postgres "$@"; fi; }
exec_postgres -D "$PGDATA" "$@"
